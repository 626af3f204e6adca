"""A step-time model: computation (measured) + collectives (fixed costs + bytes over bandwidth).

    >>> net = Network.parse("10gbit", latency="20us")
    >>> t = step_time(0.012, des_traffic(4 * 4096 * 17), n=16, net=net)
    >>> round(t["total"], 6), round(4096 / t["total"])       # seconds per step, samples/s
    (0.014018, 292200)

Per process and step, with bandwidth b (bytes/s per host and direction):

- fixed: every dependent *phase* waits one Horovod cycle (``cycle``; a collective whose input
  depends on an earlier one cannot join that one's cycle), and every collective call costs its
  MPI messages: ``call`` seconds if measured (scripts/bench_collectives.py), else 2(N-1) x
  ``latency`` (ring allreduce: 2(N-1) steps; all-to-all: split sizes, then the data);
- bandwidth: a ring allreduce of P bytes sends 2(N-1)/N P; an all-to-all sends its segments for
  other processes and receives theirs: max(out, in) / b.

DES: one phase, ONE allreduce of 4 B w bytes (w floats per sample); with the data-parallel tail
four (``des_tail_traffic``), and a computation that falls with N. PS: the slice-size allreduce;
per table an all-to-all of ids, then one of rows (forward), then one of gradient rows (backward);
then the dense allreduce - 5 phases, 3 T + 2 calls. Horovod runs the collectives on its own
thread, so the PS's per-table work (deduplicating one table's ids, the owner's lookup) goes on
while other tables' bytes travel: ``overlap`` is the share of its computation that runs while
its bytes travel (calibrated on the netbed, ``calibrate_overlap``). DES's one allreduce needs
every partial, and the rest of the step needs its result: nothing overlaps, unless the batch is
cut into K micro-batches (``des_traffic(p, K)``, ``sliced_compute``): then slice k's allreduce
travels while slice k+1's partials are computed (``pipeline``). Computation is
measured with the collectives replaced by no-ops (``des.train --comm noop``), or better with
the processes still kept in step by one 4-byte allreduce per step (``--comm sync``): a
synchronous step waits for the slowest process, and on shared cores that wait is most of DES's
gap to the no-op time. ``b`` is the
effective bandwidth: on the netbed MPI over TCP reaches about 60 % of the token bucket's rate in
an allreduce (measured) and more in an all-to-all, which keeps every link busy at once, so
calibrate both with scripts/bench_collectives.py (``alltoall_bandwidth``).

Shared cores (``cores``): when the N processes whose computation was timed share fewer cores
than N (the netbed: every emulated host on this machine's cores), a process that waits for its
bytes frees its share of the cores for the others, so its wait overlaps their computation. The
step is then the larger of the cores' bound (the computation as measured, all processes
competing) and one process's own path (its computation with a core to itself, compute x cores
/ N, plus its communication). With cores >= N, or on a cluster (``cores=None``: each host has
its own), that is the sum of the terms; so too on the netbed with a CPU budget per host
(``des.netbed --cpus``), where a waiting host's budget is not the others' to take.

    >>> shared = step_time(0.400, des_traffic(2e6), n=4, net=Network(1e7, cycle=0.0), cores=2)  # 4 on 2 cores
    >>> round(shared["total"], 3), round(step_time(0.400, des_traffic(2e6), 4, Network(1e7, cycle=0.0))["total"], 3)
    (0.5, 0.7)

(shared: max(0.4, 0.4 x 2/4 + 0.3 s of bytes); one host each: 0.4 + 0.3.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from des_ops.wire import ring_share

_RATE = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8,
         "bps": 1.0, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9}
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
HOROVOD_CYCLE = 1e-3      # Horovod's default cycle time (HOROVOD_CYCLE_TIME, ms)


def parse_rate(text: str) -> float:
    """'10gbit' -> bytes per second (tc's units: bit, kbit, mbit, gbit; bps, kbps, ... are bytes)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]+)\s*", text)
    if not m or m.group(2).lower() not in _RATE:
        raise ValueError(f"bandwidth {text!r}: a number and one of {', '.join(_RATE)} (e.g. 10gbit)")
    return float(m.group(1)) * _RATE[m.group(2).lower()]


def parse_time(text: str) -> float:
    """'20us' -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-z]+)\s*", text)
    if not m or m.group(2) not in _TIME:
        raise ValueError(f"time {text!r}: a number and one of {', '.join(_TIME)} (e.g. 20us)")
    return float(m.group(1)) * _TIME[m.group(2)]


@dataclass(frozen=True)
class Network:
    bandwidth: float                   # effective bytes/s per host and direction
    latency: float = 20e-6             # seconds per message
    cycle: float = HOROVOD_CYCLE       # seconds a dependent phase waits
    call: float | None = None          # measured seconds per call within a phase (else from latency)
    alltoall_bandwidth: float | None = None   # effective bytes/s of all-to-all traffic (else ``bandwidth``)

    @classmethod
    def parse(cls, bandwidth: str, latency: str = "20us", cycle: float = HOROVOD_CYCLE) -> "Network":
        return cls(parse_rate(bandwidth), parse_time(latency), cycle)

    def call_time(self, n: int) -> float:
        return self.call if self.call is not None else 2 * (n - 1) * self.latency


def step_time(compute: float, traffic: dict, n: int, net: Network, cores: int | None = None,
              overlap: float = 0.0, sliced_compute: float = 0.0) -> dict:
    """Seconds per step and its terms. ``traffic`` (one process, one step): {"phases": k,
    "allreduce": [payload bytes per call], "alltoall": [(bytes out, bytes in) per call]}.
    ``cores``: the cores the n processes shared when ``compute`` was timed and share when they
    run (None: one host each). ``overlap``: the share of the computation that runs while the
    step's bytes travel (``calibrate_overlap``; 0 = none: DES's one allreduce waits for every
    partial), so the step is (1 - overlap) x computation + communication, and never less than
    either term alone. ``traffic["slices"]`` K > 1 (DES's micro-batches, ``des_traffic(p, K)``):
    ``sliced_compute`` seconds of the computation (the partials' forward) run in K slices, each
    followed by its own collective (a K-th of the communication), so the slices' computation and
    communication form a two-stage pipeline (``pipeline``)."""
    if not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap {overlap}: a share of the computation, 0..1")
    if not 0.0 <= sliced_compute <= compute:
        raise ValueError(f"sliced_compute {sliced_compute}: a part of the computation, 0..{compute}")
    fixed = bandwidth = 0.0
    if n > 1:
        calls = len(traffic.get("allreduce", [])) + len(traffic.get("alltoall", []))
        fixed = traffic.get("phases", 1) * net.cycle + calls * net.call_time(n)
        bandwidth = sum(ring_share(n) * p for p in traffic.get("allreduce", [])) / net.bandwidth
        bandwidth += sum(max(o, i) for o, i in traffic.get("alltoall", [])) / (net.alltoall_bandwidth or net.bandwidth)
    share = min(1.0, cores / n) if cores else 1.0     # one process's path with a core of its own
    own, sliced = compute * share, sliced_compute * share
    comm = fixed + bandwidth
    slices = traffic.get("slices", 1)
    path = own * (1.0 - overlap) - sliced + pipeline(sliced, comm, slices)
    total = max(compute, comm, path)
    return {"n": n, "compute": compute, "fixed": fixed, "bandwidth": bandwidth, "total": total,
            "own_compute": own, "overlap": overlap, "sliced_compute": sliced, "slices": slices,
            "comm_share": comm / total if total else 0.0}


def pipeline(compute: float, communication: float, slices: int) -> float:
    """Seconds of K slices, each computed (``compute`` / K) and then sent (``communication`` / K)
    while the next is computed: the first slice's computation, K - 1 stages of the slower of the
    two, the last slice's communication. K = 1: compute + communication.

    >>> [round(pipeline(c, m, k), 3) for c, m, k in ((0.4, 0.8, 1), (0.4, 0.8, 4), (0.8, 0.4, 4))]
    [1.2, 0.9, 0.9]
    """
    c, m = compute / slices, communication / slices
    return c + (slices - 1) * max(c, m) + m


def calibrate_sliced(measured: float, compute: float, communication: float, slices: int) -> float:
    """The ``sliced_compute`` that makes ``step_time`` equal a step measured with K > 1 slices
    (one host each), where the slices' communication is the slower stage: measured = compute -
    s + s / K + communication, clipped to 0..compute. Where the computation is the slower stage
    the step (compute + communication / K) does not depend on s: calibrate at the K whose
    communication weighs most, then predict the other K with it.

    >>> round(calibrate_sliced(1.15, 0.5, 0.8, 4), 3)     # 1.15 = 0.5 - s + s / 4 + 0.8
    0.2
    """
    if slices < 2:
        raise ValueError("calibrate_sliced: needs a step measured with 2 or more slices")
    return min(compute, max(0.0, (compute + communication - measured) / (1.0 - 1.0 / slices)))


def calibrate_overlap(measured: float, compute: float, communication: float) -> float:
    """The ``overlap`` that makes ``step_time`` equal a measured step (one host each), from
    measured = (1 - overlap) x compute + communication, clipped to 0..1. Calibrate where the
    communication weighs most (there the step depends on the overlap most, and on the noise of
    the computation least), then predict the other points with it.

    >>> round(calibrate_overlap(0.5165, 0.3313, 0.3103), 3)      # the PS at N=2, 30mbit (README)
    0.378
    """
    if compute <= 0:
        return 0.0
    return min(1.0, max(0.0, (compute + communication - measured) / compute))


def des_traffic(payload_bytes: float, slices: int = 1) -> dict:
    """DES: one phase, one allreduce of the partials (4 B w bytes); with K micro-batches K phases
    (each slice's allreduce waits its own Horovod cycle) of a K-th of the bytes each.

    >>> des_traffic(1000.0, 2)
    {'phases': 2, 'allreduce': [500.0, 500.0], 'slices': 2}
    """
    if slices == 1:
        return {"phases": 1, "allreduce": [payload_bytes]}
    return {"phases": slices, "allreduce": [payload_bytes / slices] * slices, "slices": slices}


def des_tail_traffic(payload_bytes: float, output_bytes: float, tail_gradient_bytes: float) -> dict:
    """DES with the data-parallel tail (des_ops.tail): four dependent phases - the reduce-scatter
    of the partials (4 B w), the all-gather of the outputs, the backward all-gather of the partials'
    gradient, the allreduce of the tail's gradients. A ring reduce-scatter or all-gather of P bytes
    sends (N-1)/N P, half a ring allreduce: here an allreduce of P/2.

    >>> des_tail_traffic(1000.0, 40.0, 300.0)
    {'phases': 4, 'allreduce': [500.0, 20.0, 500.0, 300.0]}
    """
    return {"phases": 4, "allreduce": [payload_bytes / 2, output_bytes / 2, payload_bytes / 2, tail_gradient_bytes]}


def ps_traffic(lookups: int, alltoall_out: float, alltoall_in: float, dense_bytes: float) -> dict:
    """PS: 5 phases; slice sizes (4 B), 3 all-to-alls per table looked up (``lookups``: one per
    width with fused tables, one per field without; this process's bytes out / in to other
    processes, spread over them), the dense gradients' allreduce."""
    calls = max(1, 3 * lookups)
    return {"phases": 5, "allreduce": [4.0, dense_bytes],
            "alltoall": [(alltoall_out / calls, alltoall_in / calls)] * calls}

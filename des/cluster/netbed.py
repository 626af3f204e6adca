"""An emulated multi-host cluster on one machine: Linux network namespaces as hosts.

Each host ``deshK`` is a network namespace with one interface ``eth0`` (address 10.77.0.K/24),
joined by a veth pair to a bridge ``desbr0`` (10.77.0.254, so mpirun's daemons can reach back;
no uplink: traffic stays between the namespaces made here). Each host's sending side is
shaped like a NIC: a ``tbf`` token bucket at ``rate`` (measured here: 98.8 Mbit/s through a
100mbit bucket) that holds 100 us of it (at least 2 frames), after a ``tc netem`` delay when
``delay`` is given (kernels without netem, such as this project's machines, refuse ``delay``
with a message), and each TCP socket may queue 1 ms of the rate below it (``EAGER``, ``TSQ_TIME``
below). mpirun starts one process per host through an rsh agent that runs ``ip netns exec deshK``
(scripts/netbed_rsh.sh), with Open MPI's TCP transport on the bridge subnet only, messages up to
4 MiB sent in one phase. Needs root (as on this project's machines).

A host's CPU: without ``cpus`` every host's processes share all of this machine's cores, so a
process that waits for the network leaves its share to the others and a host's speed depends
on what the other hosts do. ``cpus=C`` gives every host a CPU budget of its own, as a cluster's
hosts have: a cgroup per host (``desh<K>`` under the cpu controller, cgroup v1 or v2) with a CFS
quota of C CPUs over a short period (``cpu_period_us``; default the shortest the kernel takes for
C, at least 2.5 ms: its smallest quota is 1 ms), which the rsh agent joins before it starts the host's
daemon (so every process of the host is in it). ``cpus="share"`` is 0.9 x this machine's cores /
hosts (a tenth is left to mpirun and the kernel's network processing, which run outside them).

    python -m des.netbed up 2 --rate 1gbit --delay 100us
    python -m des.netbed up 4 --rate 100mbit --cpus share      # each host 0.45 CPU (0.9 x 2 cores / 4)
    python -m des.netbed run 2 --rate 1gbit -- python -m des.train --mode des ...   # up, run, down
    python -m des.netbed down

    >>> with Netbed(2, rate="1gbit", delay="100us") as bed:          # doctest: +SKIP
    ...     subprocess.run(bed.mpirun(2) + ["python", "-m", "des.train", ...])
    ...     bed.sent_bytes()                # bytes each host put on its interface
    ...     bed.cpu_seconds()               # CPU time each host's processes used (with cpus)
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

from des.cluster.timemodel import parse_rate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout
PREFIX, BRIDGE, SUBNET = "desh", "desbr0", "10.77.0"
AGENT = os.path.join(ROOT, "scripts", "netbed_rsh.sh")
# Open MPI's ring allreduce: the algorithm des.cluster.timemodel prices and the one that keeps every link
# busy. Open MPI's default choice for these sizes sent 1 MiB at 1/2.2 of a 100mbit link (N=4),
# the ring at 1/1.44 (scripts/bench_collectives.py on the netbed); the ring's sums are the same
# on every process.
# The token bucket's depth: 100 us at the rate, at least 2 full frames. The bucket fills while the
# link is idle and then lets that many bytes pass at once, which no NIC does: with the former
# 16 KB minimum an 8 KB message after 5 ms idle crossed a "30mbit" host at 612 Mbit/s (one the
# size of a PS all-to-all's message per table), with 3028 B at 40 Mbit/s; bulk rates are the same
# (28.6 and 28.7 Mbit/s for 4 MiB).
BURST_MIN, BURST_TIME = 3028, 100e-6
# "share": this machine's cores / hosts, less a tenth left to what runs outside the hosts' cgroups
# (the kernel's network processing, mpirun): budgets that add up to every core are caps the hosts
# then compete for, not budgets each host gets.
SHARE = 0.9
CPUACCT_V1 = "/sys/fs/cgroup/cpuacct"
# The CFS period of a host's quota. A host that has used its quota waits for the next period, and
# a process waiting for the network spends its quota polling (Open MPI's progress loop), so it is
# late by up to period x (1 - C) when its bytes come: with 10 ms the PS (3 collectives per table)
# stepped in 1,137.5 ms at 30 Mbit/s (N=4, 0.45 CPU), with 2.5 ms in 789.5 ms (README). The default:
# the shortest period the kernel takes for the budget (its smallest quota is 1 ms), at least 2.5 ms.
MIN_PERIOD_US, MIN_QUOTA_US = 2500, 1000
RING_ALLREDUCE = ("--mca", "coll_tuned_use_dynamic_rules", "1", "--mca", "coll_tuned_allreduce_algorithm", "4")
# Open MPI's TCP transport sends a message above 64 KB in two phases: 64 KB, then the rest once
# the receiver's acknowledgement comes back. On a shaped host that acknowledgement queues behind
# the receiver's own outgoing data, and the sender's link idles meanwhile: a 1 MiB ring allreduce
# (N=4, 30 Mbit/s, 0.45 CPU per host) took 1.49x its wire time, all-to-alls 1.61x. Sent in one
# phase up to 4 MiB (and with the short socket queues below): 1.11x and 1.17x
# (scripts/bench_collectives.py; README). Both modes' collectives are sent this way.
EAGER = ("--mca", "btl_tcp_eager_limit", "4194304", "--mca", "btl_tcp_rndv_eager_limit", "4194304",
         "--mca", "btl_tcp_max_send_size", "4194304")
# How many bytes one TCP socket may have queued below it (Linux's TSQ, net.ipv4.tcp_limit_output_bytes,
# a per-namespace setting; 4 MiB here): every ACK and acknowledgement a host sends waits behind its
# queue, over a second at 30 Mbit/s. A NIC drains its host's 4 MiB in under 4 ms at 10 Gbit/s;
# each host here gets 1 ms at its rate, at least 16 KB (1.26x -> 1.11x above).
TSQ_TIME, TSQ_MIN = 1e-3, 16384


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "netns", "exec", ns] if ns else []) + list(args)
    run = subprocess.run(cmd, capture_output=True, text=True)
    if check and run.returncode != 0:
        raise RuntimeError(f"netbed: `{' '.join(cmd)}` failed: {run.stderr.strip()}")
    return run


def hosts() -> list[str]:
    """Namespaces of the netbed that exist now (deshK), in order."""
    out = _ip("ip", "netns", "list", check=False).stdout.split()
    return sorted((h for h in out if h.startswith(PREFIX) and h[len(PREFIX):].isdigit()),
                  key=lambda h: int(h[len(PREFIX):]))


def cpu_root() -> tuple[str, int] | None:
    """Where per-host cpu cgroups are made, and the cgroup version: (path, 1 or 2), or None."""
    if os.path.exists("/sys/fs/cgroup/cpu/cpu.cfs_quota_us"):
        return "/sys/fs/cgroup/cpu", 1
    try:
        with open("/sys/fs/cgroup/cgroup.controllers") as fh:
            if "cpu" in fh.read().split():
                return "/sys/fs/cgroup", 2
    except OSError:
        pass
    return None


def default_period_us(cpus: float | None) -> int:
    """The shortest CFS period with a quota the kernel takes (>= 1 ms), at least 2.5 ms.

        >>> default_period_us(0.45), default_period_us(0.25), default_period_us(None)
        (2500, 4000, 2500)
    """
    return max(MIN_PERIOD_US, math.ceil(MIN_QUOTA_US / cpus)) if cpus else MIN_PERIOD_US


def parse_cpus(cpus: float | str | None, n: int) -> float | None:
    """A host's CPU budget: a number of CPUs, "share" (0.9 x this machine's cores / ``n``) or None."""
    if cpus is None or cpus == "none":
        return None
    value = SHARE * (os.cpu_count() or 1) / n if cpus == "share" else float(cpus)
    if not 0.01 <= value <= (os.cpu_count() or 1):
        raise ValueError(f"netbed: a host's CPUs must be 0.01..{os.cpu_count()} (or 'share'), not {cpus}")
    return value


class Netbed:
    """``n`` hosts on one bridge; ``rate`` (tc units: 1gbit, 100mbit) and ``delay`` (100us, 1ms)
    shape every host's outgoing traffic; ``cpus`` (a number, "share" or None) is each host's CPU
    budget. A context manager: torn down on exit (also on errors)."""

    def __init__(self, n: int, rate: str | None = "1gbit", delay: str | None = None, burst: str | None = None,
                 cpus: float | str | None = None, cpu_period_us: int | None = None):
        if n < 1 or n > 250:
            raise ValueError(f"netbed: 1..250 hosts, not {n}")
        if os.geteuid() != 0:
            raise PermissionError("netbed: network namespaces need root")
        self.n, self.rate, self.delay = n, rate, delay
        if burst is None and rate:
            burst = f"{max(BURST_MIN, int(parse_rate(rate) * BURST_TIME))}b"
        self.burst = burst
        self.cpus = parse_cpus(cpus, n)
        if self.cpus is not None and cpu_root() is None:
            raise RuntimeError("netbed: --cpus needs the cgroup cpu controller (cgroup v1 cpu or v2 cpu.max), "
                               "which this machine does not offer")
        self.cpu_period_us = int(cpu_period_us or default_period_us(self.cpus))
        if self.cpus is not None and not (MIN_QUOTA_US <= self.cpus * self.cpu_period_us
                                          and self.cpu_period_us <= 1_000_000):
            raise ValueError(f"netbed: a CPU budget of {self.cpus:g} over a {self.cpu_period_us} us period is a "
                             f"quota of {self.cpus * self.cpu_period_us:.0f} us; the kernel's smallest is "
                             f"{MIN_QUOTA_US} us and its longest period 1 s: use a period of at least "
                             f"{math.ceil(MIN_QUOTA_US / self.cpus)} us")

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k}"

    def up(self) -> "Netbed":
        down()
        try:
            _ip("ip", "link", "add", BRIDGE, "type", "bridge")
            _ip("ip", "addr", "add", f"{SUBNET}.254/24", "dev", BRIDGE)
            _ip("ip", "link", "set", BRIDGE, "up")
            for k in range(1, self.n + 1):
                ns, veth = f"{PREFIX}{k}", f"desv{k}"
                _ip("ip", "netns", "add", ns)
                _ip("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("ip", "link", "set", veth, "master", BRIDGE, "up")
                _ip("ip", "addr", "add", f"{self.address(k)}/24", "dev", "eth0", ns=ns)
                _ip("ip", "link", "set", "eth0", "up", ns=ns)
                _ip("ip", "link", "set", "lo", "up", ns=ns)
                self._shape(ns)
                if self.cpus is not None:
                    self._limit_cpu(ns)
            self._wait_ready()
        except BaseException:
            down()
            raise
        return self

    def _wait_ready(self, timeout: float = 15.0) -> None:
        """Until the bridge and every port forward (mpirun's daemons started earlier could not
        reach back and crashed now and then)."""
        def state(path: str) -> str:
            try:
                with open(path) as fh:
                    return fh.read().strip()
            except OSError:
                return ""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ports = [state(f"/sys/class/net/desv{k}/brport/state") for k in range(1, self.n + 1)]
            links = [state(f"/sys/class/net/desv{k}/operstate") for k in range(1, self.n + 1)]
            if state(f"/sys/class/net/{BRIDGE}/operstate") == "up" and set(ports) == {"3"} and set(links) == {"up"}:
                time.sleep(0.5)
                return
            time.sleep(0.1)
        raise RuntimeError(f"netbed: links not ready after {timeout:.0f} s")

    def _shape(self, ns: str) -> None:
        parent = ["root"]
        if self.delay:
            run = _ip("tc", "qdisc", "add", "dev", "eth0", "root", "handle", "1:", "netem", "delay", self.delay,
                      ns=ns, check=False)
            if run.returncode != 0:
                raise RuntimeError(f"netbed: --delay {self.delay} needs tc's netem qdisc, which this kernel does "
                                   f"not offer ({run.stderr.strip()}); run without --delay (rate shaping by "
                                   f"tbf works)")
            parent = ["parent", "1:"]
        if self.rate:
            _ip("tc", "qdisc", "add", "dev", "eth0", *parent, "handle", "2:", "tbf", "rate", self.rate,
                "burst", self.burst, "latency", "1s", ns=ns)
            tsq = max(TSQ_MIN, int(parse_rate(self.rate) * TSQ_TIME))
            _ip("sh", "-c", f"echo {tsq} > /proc/sys/net/ipv4/tcp_limit_output_bytes", ns=ns)

    def _limit_cpu(self, ns: str) -> None:
        root, version = cpu_root()
        path = os.path.join(root, ns)
        os.makedirs(path, exist_ok=True)
        quota = int(round(self.cpus * self.cpu_period_us))
        if version == 1:
            _write(os.path.join(path, "cpu.cfs_period_us"), self.cpu_period_us)
            _write(os.path.join(path, "cpu.cfs_quota_us"), quota)
            if os.path.isdir(CPUACCT_V1):        # v1 counts CPU time in its own hierarchy
                os.makedirs(os.path.join(CPUACCT_V1, ns), exist_ok=True)
        else:
            try:                                   # children get cpu.max only where the parent hands it down
                _write(os.path.join(root, "cgroup.subtree_control"), "+cpu")
            except OSError:
                pass
            _write(os.path.join(path, "cpu.max"), f"{quota} {self.cpu_period_us}")

    def cpu_seconds(self) -> list[float]:
        """CPU time each host's processes have used so far (seconds; needs ``cpus``)."""
        return [_cpu_stat(f"{PREFIX}{k}")["usage"] for k in range(1, self.n + 1)]

    def throttled_seconds(self) -> list[float]:
        """Time each host spent throttled by its quota so far (seconds; needs ``cpus``)."""
        return [_cpu_stat(f"{PREFIX}{k}")["throttled"] for k in range(1, self.n + 1)]

    def mpirun(self, np_: int | None = None, env: tuple[str, ...] = ()) -> list[str]:
        """The mpirun command line (one process per host, round robin when ``np_`` > hosts)."""
        np_ = np_ or self.n
        per_host = -(-np_ // self.n)
        host_list = ",".join(f"{self.address(k)}:{per_host}" for k in range(1, self.n + 1))
        cmd = ["mpirun", "-np", str(np_), "--host", host_list, "--map-by", "node", "--bind-to", "none",
               "--oversubscribe", "--mca", "plm_rsh_agent", AGENT, "--mca", "btl", "tcp,self",
               "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24", "--mca", "oob_tcp_if_include", f"{SUBNET}.0/24",
               *RING_ALLREDUCE, *EAGER, "--wdir", os.getcwd()]
        horovod = sorted(k for k in os.environ if k.startswith("HOROVOD_"))    # the user's Horovod knobs
        for name in ("PATH", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "OMPI_MCA_mpi_yield_when_idle", *horovod, *env):
            if name in os.environ:
                cmd += ["-x", name]
        return cmd + ["-x", "DES_WIRE_INTERFACE=eth0"]     # des.train reads each host's interface counter

    def run(self, cmd: list[str], attempts: int = 3, **kwargs) -> subprocess.CompletedProcess:
        """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)`` for an mpirun line
        from :meth:`mpirun`, again (up to ``attempts`` times) only when Open MPI's daemons did not
        start: an ``orted`` crashes at start-up across the namespaces about once in 30 launches
        here. Any other failure is returned at once.

            >>> bed.run(bed.mpirun(2) + ["python", "-m", "des.train", ...], timeout=600)  # doctest: +SKIP
        """
        for _ in range(attempts):
            done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
            if done.returncode == 0 or "ORTE was unable to reliably start" not in done.stderr + done.stdout:
                break
        return done

    def sent_bytes(self) -> list[int]:
        """Bytes each host has sent on its interface so far (its veth's receive counter)."""
        out = []
        for k in range(1, self.n + 1):
            with open(f"/sys/class/net/desv{k}/statistics/rx_bytes") as fh:
                out.append(int(fh.read()))
        return out

    def __enter__(self) -> "Netbed":
        return self.up()

    def __exit__(self, *exc) -> None:
        down()


def _write(path: str, value) -> None:
    with open(path, "w") as fh:
        fh.write(str(value))


def _cpu_stat(ns: str) -> dict:
    """{"usage": s, "throttled": s} of a host's cgroup."""
    root, version = cpu_root()
    with open(os.path.join(root, ns, "cpu.stat")) as fh:
        stat = dict(line.split() for line in fh if line.strip())
    if version == 2:
        return {"usage": int(stat["usage_usec"]) / 1e6, "throttled": int(stat.get("throttled_usec", 0)) / 1e6}
    usage = float("nan")          # v1 without a cpuacct controller: not counted
    for acct in (os.path.join(root, ns, "cpuacct.usage"), os.path.join(CPUACCT_V1, ns, "cpuacct.usage")):
        if os.path.exists(acct):
            with open(acct) as fh:
                usage = int(fh.read()) / 1e9
            break
    return {"usage": usage, "throttled": int(stat.get("throttled_time", 0)) / 1e9}


def _cgroups() -> list[str]:
    roots = [r for r in ((cpu_root() or ("",))[0], CPUACCT_V1) if r and os.path.isdir(r)]
    return [os.path.join(root, d) for root in dict.fromkeys(roots) for d in os.listdir(root)
            if d.startswith(PREFIX) and d[len(PREFIX):].isdigit() and os.path.isdir(os.path.join(root, d))]


def _links() -> list[str]:
    return [d for d in os.listdir("/sys/class/net") if d == BRIDGE or (d.startswith("desv") and d[4:].isdigit())]


def down(timeout: float = 15.0) -> None:
    """Remove every netbed namespace, veth and the bridge; idempotent. Waits until the kernel
    has released them (a namespace's veth outlives ``ip netns del`` for a moment, and a new
    netbed made at once would find its name taken)."""
    for ns in hosts():
        _ip("ip", "netns", "del", ns, check=False)
    deadline = time.monotonic() + timeout
    while True:
        left = _links()
        for link in left:
            _ip("ip", "link", "del", link, check=False)
        if not _links() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    if _links():
        raise RuntimeError(f"netbed: could not remove {_links()}")
    for path in _cgroups():        # empty once the host's processes have ended
        while True:
            try:
                os.rmdir(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"netbed: could not remove the cgroup {path} (processes left in it?)")
                time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(prog="python -m des.netbed", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["up", "down", "run", "status"])
    ap.add_argument("hosts", type=int, nargs="?", default=2)
    ap.add_argument("--np", type=int, help="processes (default: one per host)")
    ap.add_argument("--rate", default="1gbit", help="each host's sending rate (tc units; 'none' = unshaped)")
    ap.add_argument("--delay", default=None, help="one-way delay added to each host's sends (e.g. 100us)")
    ap.add_argument("--cpus", default=None,
                    help="each host's CPU budget: a number of CPUs or 'share' (0.9 x cores / hosts); "
                         "default: all cores shared")
    ap.add_argument("--cpu-period-us", type=int, default=None,
                    help="the CFS period of a host's CPU quota (default: the shortest with a quota >= 1000 us, "
                         "at least 2500)")
    a = ap.parse_args(argv)
    rate = None if a.rate == "none" else a.rate
    if a.action == "down":
        down()
        return 0
    if a.action == "status":
        print(" ".join(hosts()) or "no netbed hosts")
        return 0
    bed = Netbed(a.hosts, rate, a.delay, cpus=a.cpus, cpu_period_us=a.cpu_period_us)
    if a.action == "up":
        bed.up()
        print(f"netbed: {a.hosts} hosts {', '.join(bed.address(k) for k in range(1, a.hosts + 1))}; "
              f"rate {rate or 'unshaped'}, delay {a.delay or 0}, "
              f"CPUs {bed.cpus if bed.cpus is not None else 'shared'} per host. mpirun with:\n  " + " ".join(bed.mpirun(a.np)))
        return 0
    if not cmd:
        ap.error("run needs a command after --")
    with bed:
        before = bed.sent_bytes()
        code = subprocess.run(bed.mpirun(a.np) + cmd).returncode
        sent = [b - s for b, s in zip(bed.sent_bytes(), before)]
    print(f"netbed: bytes sent per host on the wire: {sent}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())

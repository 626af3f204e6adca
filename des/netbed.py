"""An emulated multi-host cluster on one machine: Linux network namespaces as hosts.

Each host ``deshK`` is a network namespace with one interface ``eth0`` (address 10.77.0.K/24),
joined by a veth pair to a bridge ``desbr0`` (10.77.0.254, so mpirun's daemons can reach back;
no uplink: traffic stays between the namespaces made here). Each host's sending side is
shaped like a NIC: a ``tbf`` token bucket at ``rate`` (measured here: 98.8 Mbit/s through a
100mbit bucket), after a ``tc netem`` delay when ``delay`` is given (kernels without netem,
such as this project's machines, refuse ``delay`` with a message). mpirun starts
one process per host through an rsh agent that runs ``ip netns exec deshK`` (scripts/netbed_rsh.sh),
with Open MPI's TCP transport on the bridge subnet only. Needs root (as on this project's machines).

    python -m des.netbed up 2 --rate 1gbit --delay 100us
    python -m des.netbed run 2 --rate 1gbit -- python -m des.train --mode des ...   # up, run, down
    python -m des.netbed down

    >>> with Netbed(2, rate="1gbit", delay="100us") as bed:          # doctest: +SKIP
    ...     subprocess.run(bed.mpirun(2) + ["python", "-m", "des.train", ...])
    ...     bed.sent_bytes()                # bytes each host put on its interface
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX, BRIDGE, SUBNET = "desh", "desbr0", "10.77.0"
AGENT = os.path.join(ROOT, "scripts", "netbed_rsh.sh")
# Open MPI's ring allreduce: the algorithm des.timemodel prices and the one that keeps every link
# busy. Open MPI's default choice for these sizes sent 1 MiB at 1/2.2 of a 100mbit link (N=4),
# the ring at 1/1.44 (scripts/bench_collectives.py on the netbed); the ring's sums are the same
# on every process.
RING_ALLREDUCE = ("--mca", "coll_tuned_use_dynamic_rules", "1", "--mca", "coll_tuned_allreduce_algorithm", "4")


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


class Netbed:
    """``n`` hosts on one bridge; ``rate`` (tc units: 1gbit, 100mbit) and ``delay`` (100us, 1ms)
    shape every host's outgoing traffic. A context manager: torn down on exit (also on errors)."""

    def __init__(self, n: int, rate: str | None = "1gbit", delay: str | None = None, burst: str | None = None):
        if n < 1 or n > 250:
            raise ValueError(f"netbed: 1..250 hosts, not {n}")
        if os.geteuid() != 0:
            raise PermissionError("netbed: network namespaces need root")
        self.n, self.rate, self.delay = n, rate, delay
        if burst is None and rate:             # 1 ms at the rate (a bigger bucket lets messages pass unshaped)
            from des.timemodel import parse_rate
            burst = f"{max(16384, int(parse_rate(rate) * 1e-3))}b"
        self.burst = burst

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

    def mpirun(self, np_: int | None = None, env: tuple[str, ...] = ()) -> list[str]:
        """The mpirun command line (one process per host, round robin when ``np_`` > hosts)."""
        np_ = np_ or self.n
        per_host = -(-np_ // self.n)
        host_list = ",".join(f"{self.address(k)}:{per_host}" for k in range(1, self.n + 1))
        cmd = ["mpirun", "-np", str(np_), "--host", host_list, "--map-by", "node", "--bind-to", "none",
               "--oversubscribe", "--mca", "plm_rsh_agent", AGENT, "--mca", "btl", "tcp,self",
               "--mca", "btl_tcp_if_include", f"{SUBNET}.0/24", "--mca", "oob_tcp_if_include", f"{SUBNET}.0/24",
               *RING_ALLREDUCE, "--wdir", os.getcwd()]
        for name in ("PATH", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL", "OMPI_MCA_mpi_yield_when_idle", *env):
            if name in os.environ:
                cmd += ["-x", name]
        return cmd + ["-x", "DES_WIRE_INTERFACE=eth0"]     # des.train reads each host's interface counter

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
    a = ap.parse_args(argv)
    rate = None if a.rate == "none" else a.rate
    if a.action == "down":
        down()
        return 0
    if a.action == "status":
        print(" ".join(hosts()) or "no netbed hosts")
        return 0
    bed = Netbed(a.hosts, rate, a.delay)
    if a.action == "up":
        bed.up()
        print(f"netbed: {a.hosts} hosts {', '.join(bed.address(k) for k in range(1, a.hosts + 1))}; "
              f"rate {rate or 'unshaped'}, delay {a.delay or 0}. mpirun with:\n  " + " ".join(bed.mpirun(a.np)))
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

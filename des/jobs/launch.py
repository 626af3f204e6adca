"""``python -m des.launch``: run a des.train job under mpirun and restart it from its last complete
checkpoint when a process dies, up to ``--max-restarts`` times.

    python -m des.launch -np 4 --max-restarts 3 --min-np 2 -- \\
        --mode des --data train.txt --checkpoint ckpt --checkpoint-every 10min
    python -m des.launch -np 4 --hosts a,b,c,d --min-np 2 -- --mode des ...    # one process per host

Each attempt is one mpirun of des.train. When it fails (a process killed, the stall inspector
ending the job, any non-zero exit) every process of the attempt is stopped and the job goes on
from the newest complete checkpoint in ``--checkpoint`` (``des.train --restore``: exact on any
number of processes). With ``--hosts``, the launcher then checks every host (``--host-check``, by
default an ``ssh HOST true``) and restarts on the slots of the hosts that answer, as many processes
as before if they fit, down to ``--min-np``. Without it (one machine), with the same number of
processes, or, with ``--min-np M`` below ``-np``, one fewer per restart down to M (the lost
process's slot is not reused). A job that fails before
its first checkpoint is not restarted: it ends with that failure's exit status, as it does when
the restarts are used up. The launcher's log (stderr, ``[des.launch]``) says what failed (mpirun's
words: rank, host, signal or exit code), what it restarted from (epoch, step) and how much work
was lost (seconds since that checkpoint). Ctrl-C (or SIGTERM) stops every process it started.
One launcher at a time may write a checkpoint folder (a lock file in it). ``--record PATH`` writes
every attempt (processes, hosts, start, end, exit status, what failed, where it restarted from)
as JSON, for scripts/bench_launch.py.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from des.jobs.config import RunConfig
from des.jobs.runs import launch_env

LOCK = ".des-launch.lock"


class LaunchError(RuntimeError):
    """A launch that cannot start or go on: the message is one line."""


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """(the launcher's options, des.train's arguments after ``--``)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser(prog="python -m des.launch", description=__doc__.split("\n\n")[0])
    ap.add_argument("-np", "--np", type=int, required=True, help="processes of the first attempt")
    ap.add_argument("--max-restarts", type=int, default=3, metavar="K", help="restarts after failures (default 3)")
    ap.add_argument("--min-np", type=int, default=None, metavar="M",
                    help="below -np: each restart runs one process fewer, down to M (default: -np, the same)")
    ap.add_argument("--hosts", default=None, metavar="H[:SLOTS],...",
                    help="mpirun's hosts (one slot each unless :SLOTS); after a failure, the hosts that fail "
                         "--host-check are left out of the next attempt")
    ap.add_argument("--host-check", default="ssh -o BatchMode=yes -o ConnectTimeout=5 {host} true",
                    help="a command that ends with 0 on a live host, {host} replaced (default: %(default)s)")
    ap.add_argument("--mpirun", default="mpirun -np {np} --oversubscribe --bind-to none",
                    help="the launch command before python, {np} replaced, and {hosts} by the live hosts "
                         "(appended as --host {hosts} when --hosts is given and the command has no {hosts}) "
                         "(default: %(default)s)")
    ap.add_argument("--record", default=None, metavar="PATH", help="write every attempt here as JSON")
    ap.add_argument("--stop-grace", type=float, default=10.0, metavar="S",
                    help="seconds between SIGTERM and SIGKILL when stopping an attempt, and that mpirun gets to end "
                         "the job itself once it said a process is gone (default 10)")
    a = ap.parse_args(argv[:split])
    train = argv[split + 1:]
    if a.np < 1 or a.max_restarts < 0:
        ap.error(f"-np {a.np} / --max-restarts {a.max_restarts}: -np >= 1 and --max-restarts >= 0")
    a.min_np = a.np if a.min_np is None else a.min_np
    if not 1 <= a.min_np <= a.np:
        ap.error(f"--min-np {a.min_np}: between 1 and -np {a.np}")
    try:
        a.hosts = parse_hosts(a.hosts) if a.hosts else None
    except ValueError as e:
        ap.error(f"--hosts: {e}")
    if a.hosts and sum(a.hosts.values()) < a.np:
        ap.error(f"--hosts: {sum(a.hosts.values())} slot(s) for -np {a.np}")
    if a.hosts and "{hosts}" not in a.mpirun:
        a.mpirun += " --host {hosts}"
    if not train:
        ap.error("no des.train arguments: python -m des.launch -np N -- --mode des --data ... --checkpoint DIR")
    config = RunConfig.parse(train)           # des.train's own checks, before any process starts
    if config.restore:
        ap.error("--restore: the launcher restores from --checkpoint itself (start a new folder, or copy the "
                 "checkpoint there)")
    if a.max_restarts and not config.checkpoint:
        ap.error("--max-restarts needs a des.train --checkpoint DIR (and --checkpoint-every) to restart from")
    a.checkpoint = config.checkpoint
    return a, train


def parse_hosts(text: str) -> dict[str, int]:
    """``"a,b:2"`` -> {"a": 1, "b": 2}: mpirun's host list, in order."""
    hosts: dict[str, int] = {}
    for item in text.split(","):
        name, _, slots = item.strip().partition(":")
        if not name or (slots and not slots.isdigit()) or name in hosts:
            raise ValueError(f"{item!r}: HOST or HOST:SLOTS, each host once")
        hosts[name] = int(slots or 1)
    return hosts


def live_hosts(hosts: dict[str, int], check: str, timeout: float = 30.0) -> tuple[dict[str, int], list[str]]:
    """(the hosts whose ``check`` command ends with 0, the others)."""
    live, lost = {}, []
    for name, slots in hosts.items():
        try:
            ok = subprocess.run(check.format(host=name).split(), capture_output=True, timeout=timeout).returncode == 0
        except (subprocess.TimeoutExpired, OSError):
            ok = False
        if ok:
            live[name] = slots
        else:
            lost.append(name)
    return live, lost


def lock(folder: str):
    """The folder's lock, held while the returned file is open (a context manager)."""
    os.makedirs(folder, exist_ok=True)
    fh = open(os.path.join(folder, LOCK), "a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise LaunchError(f"{folder}: another des.launch is writing this checkpoint folder "
                          f"(lock {os.path.join(folder, LOCK)})") from None
    fh.seek(0), fh.truncate(), fh.write(f"{os.getpid()}\n"), fh.flush()
    return fh


def newest(folder: str, since: float = 0.0) -> tuple[str, dict, float] | None:
    """(path, position, seconds since it was written) of the newest complete checkpoint written
    after ``since`` (a time.time(); a checkpoint an earlier job left in the folder is not this
    job's), or None."""
    for name in ("state", "state.old"):
        path = os.path.join(folder, name, "config.json")
        try:
            with open(path) as fh:
                config = json.load(fh)
            written = os.path.getmtime(path)
        except (OSError, ValueError):
            continue
        if written > since:
            return os.path.dirname(path), config.get("position") or {}, time.time() - written
    return None


def what_failed(rc: int, tail: str) -> str:
    """mpirun's own line about the failed process, or the exit status."""
    found = re.search(r"(?:mpirun|Open MPI) (?:noticed|detected) that process rank (\d+) with PID (\d+) on node "
                      r"(\S+) exited on signal (\d+) \(([^)]+)\)", tail)
    if found:       # Open MPI prints PID 0 when the process was gone before it asked
        pid = f" (PID {found[2]})" if found[2] != "0" else ""
        return f"rank {found[1]}{pid} on {found[3]}: signal {found[4]} ({found[5]})"
    found = re.search(r"process rank (\d+) with PID (\d+) on node (\S+) exited with status (\d+)", tail)
    if found:
        return f"rank {found[1]} (PID {found[2]}) on {found[3]}: exit status {found[4]}"
    found = re.search(r"communication peer process has unexpectedly disconnected.*?Peer host:\s*(\S+)", tail, re.S)
    if found:
        return f"exit status {rc}: the processes lost their connection to {found[1]}"
    found = re.search(r"Primary job\s+terminated normally, but (\d+) process returned\s+a non-zero exit code", tail)
    return f"exit status {rc}" + (f" ({found[1]} process(es) returned non-zero)" if found else "")


# mpirun's words once a process of the job is gone: the job cannot go on. mpirun then stops the
# others itself, except when it cannot reach a host any more (a host taken down mid-job: mpirun
# waited on its daemon for minutes here), so the attempt is stopped ``--stop-grace`` s after such a line.
FAILED = re.compile(r"noticed that process rank|peer process has unexpectedly disconnected|ORTE has lost "
                    r"communication|ORTE was unable to reliably start|Primary job\s+terminated normally, but")


class Attempt:
    """One mpirun of des.train in its own process group; its output goes through, the tail is kept.
    Once mpirun says a process is gone (``FAILED``), the attempt ends within ``grace`` seconds."""

    def __init__(self, cmd: list[str], grace: float = 10.0):
        self.proc = subprocess.Popen(cmd, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, text=True, bufsize=1)
        self.tail: list[str] = []
        self.grace, self.watchdog = grace, None

    def wait(self) -> int:
        for line in self.proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            self.tail = (self.tail + [line])[-200:]
            if self.watchdog is None and FAILED.search(line):
                self.watchdog = threading.Timer(self.grace, self.stop, args=(self.grace,))
                self.watchdog.daemon = True
                self.watchdog.start()
        rc = self.proc.wait()
        if self.watchdog is not None:
            self.watchdog.cancel()
        return rc

    def stop(self, grace: float) -> None:
        """SIGTERM to the whole group, SIGKILL after ``grace`` s: no process is left behind."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
                return
            except subprocess.TimeoutExpired:
                continue


def log(message: str) -> None:
    print(f"[des.launch] {message}", file=sys.stderr, flush=True)


def run(a: argparse.Namespace, train: list[str]) -> int:
    """Attempts until one ends with 0, the job fails before a checkpoint, or the restarts run out."""
    folder = a.checkpoint
    np, hosts, restore, restarts, attempt = a.np, a.hosts, [], 0, None
    stopping, record = [], []
    launched = time.time()          # only this launch's checkpoints are restarted from

    def stop(signum, _frame):
        stopping.append(signum)
        if attempt is not None:
            attempt.stop(a.stop_grace)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, stop)
    while True:
        host_list = ",".join(f"{h}:{n}" for h, n in hosts.items()) if hosts else ""
        cmd = [*a.mpirun.format(np=np, hosts=host_list).split(), sys.executable, "-m", "des.train", *train, *restore]
        log(f"attempt {restarts + 1}: {np} process(es){f' on {host_list}' if hosts else ''}: {' '.join(cmd)}")
        entry = {"attempt": restarts + 1, "np": np, "hosts": host_list, "restored": restore[1:], "start": time.time()}
        record.append(entry)
        attempt = Attempt(cmd, a.stop_grace)
        rc = attempt.wait()
        entry.update(end=time.time(), rc=rc)
        _write(a.record, record)
        if stopping:
            attempt.stop(a.stop_grace)
            log(f"stopped by signal {stopping[0]}: every process of the attempt ended")
            return 130
        if rc == 0:
            log(f"done after {restarts} restart(s)")
            return 0
        attempt.stop(a.stop_grace)                  # what mpirun left running
        failed = entry["failed"] = what_failed(rc, "".join(attempt.tail))
        entry["tail"] = attempt.tail[-40:]
        last = newest(folder, launched) if folder else None
        _write(a.record, record)
        if last is None:
            log(f"failed before its first checkpoint ({failed}, after {entry['end'] - entry['start']:.0f} s): "
                f"not restarted")
            return rc
        if restarts >= a.max_restarts:
            log(f"failed ({failed}); {restarts} restart(s) used of --max-restarts {a.max_restarts}: giving up")
            return rc
        path, position, age = last
        np, hosts, lost = next_size(a, np, hosts)
        gone = f"; host(s) lost: {', '.join(lost)}" if lost else ""
        if np < a.min_np:
            log(f"failed ({failed}){gone}: {np} slot(s) left, below --min-np {a.min_np}: giving up")
            return rc
        restarts += 1
        entry.update(position=position, lost_seconds=age, lost_hosts=lost)
        _write(a.record, record)
        log(f"failed: {failed}{gone}; restart {restarts} of {a.max_restarts} from {path} (epoch "
            f"{position.get('epoch', 0) + 1}, step {position.get('step', 0)}), {age:.0f} s of work since that "
            f"checkpoint lost; on {np} process(es)")
        restore = ["--restore", folder]


def next_size(a: argparse.Namespace, np: int, hosts: dict[str, int] | None) -> tuple[int, dict | None, list[str]]:
    """(processes, hosts, hosts lost) of the next attempt: on the hosts that pass --host-check, as many
    processes as before if they fit; on one machine, one fewer down to --min-np if below -np."""
    if hosts:
        live, lost = live_hosts(hosts, a.host_check)
        return min(np, sum(live.values())), live, lost
    return (max(a.min_np, np - 1) if a.min_np < a.np else np), None, []


def _write(path: str | None, record: list) -> None:
    if path:
        with open(path + ".tmp", "w") as fh:
            json.dump(record, fh, indent=1)
        os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> int:
    a, train = parse(argv)
    try:
        with lock(a.checkpoint) if a.checkpoint else contextlib.nullcontext():    # held while the job runs
            return run(a, train)
    except LaunchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

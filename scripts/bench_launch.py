"""The time a lost process and a lost host cost a des.launch job, on the emulated cluster.

One DES job (criteo-like data, one process per netbed host) is launched three times through
``python -m des.launch --hosts ... --checkpoint-every EVERY``: uninterrupted; with one training
process killed (SIGKILL) some seconds after its first checkpoint (the launcher restarts on every
host: the host still answers); and with a host taken down at the same point (every process in
its namespace killed, the namespace deleted: the launcher's ``--host-check`` finds it gone and
restarts on the others). For each it gives the wall time, the time lost against the
uninterrupted run and what it went to (the failure noticed; the hosts checked and the next
mpirun started; the work since the checkpoint, redone), the processes each attempt ran and the
final log loss against the uninterrupted run's. Prints a Markdown table and writes ``--report``.

    .venv/bin/python scripts/bench_launch.py --hosts 3 --rate 1gbit --report reports/launch_netbed.md
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench_des import ROOT, synth_data, write_report

sys.path.insert(0, ROOT)
from des.cluster.netbed import AGENT, PREFIX, Netbed  # noqa: E402
from des.jobs.runs import launch_env  # noqa: E402


def launch_template(bed: Netbed, n: int) -> str:
    """The netbed's mpirun line with ``{np}`` and ``{hosts}`` for des.launch --mpirun."""
    cmd = bed.mpirun(n)
    cmd[cmd.index("-np") + 1] = "{np}"
    cmd[cmd.index("--host") + 1] = "{hosts}"
    return " ".join(cmd)


def namespace_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def trainers(pids: list[int]) -> list[int]:
    keep = []
    for pid in pids:
        try:
            if b"des.train" in open(f"/proc/{pid}/cmdline", "rb").read():
                keep.append(pid)
        except OSError:
            pass
    return keep


def strike(kind: str, ns: str, ckpt: str, after: float, said: dict) -> None:
    """``after`` s past the first complete checkpoint: kill one training process of host ``ns``
    ("process"), or every process in it and the host with them ("host")."""
    marker = os.path.join(ckpt, "state", "config.json")
    while not os.path.exists(marker):
        time.sleep(0.05)
    time.sleep(after)
    pids = namespace_pids(ns)
    victims = trainers(pids)[:1] if kind == "process" else pids
    said["time"] = time.time()
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if kind == "host":
        subprocess.run(["ip", "netns", "delete", ns], check=True)
    said["victims"] = victims
    # the checkpoint the launcher will restart from (no save completes once a process is gone)
    said["kept"] = ckpt + ".at_strike"
    shutil.copytree(os.path.join(ckpt, "state"), os.path.join(said["kept"], "state"))


def resumed(a, bed: Netbed, data: str, tmp: str, kept: str, np: int) -> dict:
    """des.train resumed from ``kept`` on the first ``np`` hosts, no launcher: what the restarted
    job must equal."""
    summary = os.path.join(tmp, "resumed.summary.json")
    hosts = ",".join(f"{bed.address(k)}:1" for k in range(1, np + 1))
    cmd = [*launch_template(bed, a.hosts).format(np=np, hosts=hosts).split(), sys.executable, "-m", "des.train",
           *train_args(a, data, os.path.join(tmp, "resumed.ckpt"), summary), "--restore", kept]
    t0 = time.time()
    done = bed.run(cmd, env=launch_env(), cwd=ROOT, timeout=3600)
    if done.returncode != 0:
        sys.exit(f"resumed: des.train ended with {done.returncode}:\n{done.stderr[-3000:]}")
    return {"wall": time.time() - t0, "attempts": [{"np": np}], "summary": json.load(open(summary + ".rank0"))}


def train_args(a, data: str, ckpt: str, summary: str) -> list[str]:
    return ["--mode", "des", "--data", data, "--batch", str(a.batch), "--epochs", str(a.epochs), "--threads", "1",
            "--checkpoint", ckpt, "--checkpoint-every", a.every, "--summary-json", summary]


def run(kind: str, a, bed: Netbed, data: str, tmp: str, tries: int = 3, np: int | None = None) -> dict:
    np = np or a.hosts
    """One des.launch job with its strike; launched again (up to ``tries`` times) only when Open MPI's
    daemons did not start on the first attempt (as des.netbed's ``run``: about one launch in 30 here)."""
    for t in range(tries):
        ckpt, record, summary = (os.path.join(tmp, f"{kind}.{np}.{t}.{x}") for x in ("ckpt", "record.json", "summary.json"))
        hosts = ",".join(bed.address(k) for k in range(1, np + 1))
        cmd = [sys.executable, "-m", "des.launch", "-np", str(np), "--hosts", hosts, "--min-np", "1",
               "--max-restarts", "1", "--mpirun", launch_template(bed, a.hosts),
               "--host-check", f"{AGENT} {{host}} true", "--record", record, "--", *train_args(a, data, ckpt, summary)]
        said: dict = {}
        if kind != "uninterrupted":
            threading.Thread(target=strike, args=(kind.split()[0], f"{PREFIX}{a.hosts}", ckpt, a.after, said),
                             daemon=True).start()
        t0 = time.time()
        done = subprocess.run(cmd, env=launch_env(), cwd=ROOT, capture_output=True, text=True, timeout=3600)
        wall = time.time() - t0
        if done.returncode == 0 or not ("ORTE was unable to reliably start" in done.stdout + done.stderr
                                        and "failed before its first checkpoint" in done.stderr):
            break
        print(f"{kind}: Open MPI's daemons did not start; launching again", flush=True)
    if done.returncode != 0:
        sys.exit(f"{kind}: des.launch ended with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    log = [ln for ln in done.stderr.splitlines() if ln.startswith("[des.launch]")]
    print(f"{kind}: {wall:.1f} s\n  " + "\n  ".join(ln[:300] for ln in log), flush=True)
    attempts = json.load(open(record))
    if len(attempts) > 1:
        print("  mpirun's last lines:\n" + "".join(attempts[0]["tail"][-25:]), flush=True)
    return {"wall": wall, "attempts": attempts, "said": said, "log": log,
            "summary": json.load(open(summary + ".rank0"))}


def row(kind: str, r: dict, base: dict) -> str:
    at, summary = r["attempts"], r["summary"]
    nps = " → ".join(str(x["np"]) for x in at)
    startup = summary["seconds_to_first_step"]            # of the last attempt: the restart's
    diff = abs(summary["logloss"] - base["summary"]["logloss"])
    shown = "–" if r is base else f"{diff:.1e}"
    if len(at) == 1:
        return f"| {kind} | {nps} | {r['wall']:.1f} | – | – | – | {startup:.1f} | – | {summary['logloss']:.6f} | {shown} |"
    noticed, restart = at[0]["end"] - r["said"]["time"], at[1]["start"] - at[0]["end"]
    redone = at[0]["lost_seconds"] - noticed        # the launcher's age of the checkpoint, less the wait after the strike
    pos = at[0]["position"]
    return (f"| {kind} | {nps} | {r['wall']:.1f} | {noticed + restart + startup + redone:.1f} | {noticed:.1f} | "
            f"{restart:.1f} | {startup:.1f} | {redone:.1f} (epoch {pos.get('epoch', 0) + 1}, step {pos.get('step', 0)}) | "
            f"{summary['logloss']:.6f} | {shown} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hosts", type=int, default=3)
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--rows", type=int, default=150_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--every", default="5s", help="des.train --checkpoint-every")
    ap.add_argument("--after", type=float, default=3.0, help="seconds after the first checkpoint to strike")
    ap.add_argument("--runs", default="uninterrupted,process killed,host down", help=argparse.SUPPRESS)
    ap.add_argument("--report", default=os.path.join(ROOT, "reports", "launch_netbed.md"))
    a = ap.parse_args()
    data = synth_data(a.rows)
    tmp = tempfile.mkdtemp()
    runs = {}
    try:
        with Netbed(a.hosts, rate=a.rate) as bed:
            for kind in a.runs.split(","):
                runs[kind] = run(kind, a, bed, data, tmp)
            # what the job ends as after the host is lost, uninterrupted: the same job on one host fewer
            runs[f"uninterrupted on {a.hosts - 1}"] = run("uninterrupted", a, bed, data, tmp, np=a.hosts - 1)
            if "host down" in runs:
                runs[f"resumed on {a.hosts - 1} from the host-down run's checkpoint"] = resumed(
                    a, bed, data, tmp, runs["host down"]["said"]["kept"], a.hosts - 1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(os.path.dirname(data), ignore_errors=True)
    base = runs["uninterrupted"]
    lines = [f"# A lost process and a lost host: time lost by a des.launch job ({a.hosts} netbed hosts)", "",
             f"`scripts/bench_launch.py --hosts {a.hosts} --rate {a.rate} --rows {a.rows} --batch {a.batch} --epochs "
             f"{a.epochs} --every {a.every} --after {a.after:g}`, {time.strftime('%Y-%m-%d')}: DES DeepFM on "
             f"criteo-like data ({a.rows} rows, the last 10 % held out), one process per emulated host at {a.rate} "
             f"(des.netbed; the hosts share this machine's 2 cores), `python -m des.launch -np {a.hosts} --hosts ... "
             f"--min-np 1 --max-restarts 1 -- --checkpoint-every {a.every}`. The strike comes {a.after:g} s after "
             f"the first complete checkpoint, at host {a.hosts}: 'process killed' kills one training process "
             f"(SIGKILL), 'host down' kills every process of the host's namespace and deletes it. One run each.", "",
             "| run | processes per attempt | wall s | lost s | noticed s | restart s | start-up s | work redone s (from) "
             "| log loss | differs by |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [row(kind, r, runs["host down"] if kind.startswith("resumed") else base) for kind, r in runs.items()]
    lines += ["", "differs by: from the uninterrupted run's log loss; on the last line, from the host-down run's.",
              "", "lost: what the failure cost, the sum of: noticed, from the strike to the end of the failed mpirun "
              "(mpirun sees its process die and stops the job; when a host is gone it waits on the host's daemon, and "
              "des.launch stops the attempt --stop-grace, 10 s, after mpirun's first line about a lost process); restart, from there to the next mpirun's "
              "start (every process of the attempt stopped, the hosts checked); start-up, from the next mpirun's "
              "start to its first step done (TensorFlow, the model, the restore; des.train's "
              "seconds_to_first_step; on the uninterrupted line, the job's own start-up); work redone, the "
              "seconds from the checkpoint it restarted from to the strike. Wall times differ by more: "
              "the restart on 2 hosts runs at 2 processes' speed. On fewer processes the log loss may differ "
              "from the uninterrupted run's in float32 summation order (Adam amplifies it over the epochs): the "
              "job on one host fewer from the start shows how much; the last line is what the restart must equal, "
              f"des.train resumed on {a.hosts - 1} hosts from the checkpoint the launcher restarted from (copied at "
              f"the strike), its log loss against the host-down run's.",
              "", "The launcher's log:", ""]
    for kind, r in runs.items():
        if "log" not in r:
            continue
        lines += [f"- {kind}:"] + [f"  - `{ln[len('[des.launch] '):][:400]}`" for ln in r["log"]]
    print("\n".join(lines))
    write_report(a.report, lines)


if __name__ == "__main__":
    main()

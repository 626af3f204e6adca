"""What an idle Horovod process costs: N ranks under mpirun call hvd.init() and sleep; each
reports the CPU seconds its process used while idle (Horovod's background thread meets the
other ranks every HOROVOD_CYCLE_TIME, and Open MPI polls while it waits for them). Median over
``--repeats`` launches per cycle time; prints a Markdown table and writes it to ``--report``.

    .venv/bin/python scripts/bench_horovod_idle.py --np 3 --idle 15 --cycles default,5,10 --repeats 3
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDLE = """
import time
import horovod.tensorflow as hvd
import tensorflow as tf
hvd.init()
hvd.allreduce(tf.zeros([1]), name="start")          # every rank is up before the clock starts
t0 = time.process_time()
time.sleep({idle})
print(f"rank {{hvd.rank()}} cpu {{time.process_time() - t0:.3f}}", flush=True)
hvd.allreduce(tf.zeros([1]), name="end")
"""


def launch(n: int, idle: float, cycle: str) -> list[float]:
    """CPU seconds of each rank's process over ``idle`` seconds of sleep."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("HOROVOD_CYCLE_TIME", None)
    if cycle != "default":
        env["HOROVOD_CYCLE_TIME"] = cycle
    cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", sys.executable, "-c",
           IDLE.format(idle=idle)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120 + idle)
    if done.returncode != 0:
        raise SystemExit(f"mpirun failed ({done.returncode}): {done.stderr[-2000:]}")
    cpu = {int(r): float(c) for r, c in re.findall(r"rank (\d+) cpu ([\d.]+)", done.stdout)}
    return [cpu[r] for r in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=3)
    ap.add_argument("--idle", type=float, default=15.0, help="seconds each rank sleeps")
    ap.add_argument("--cycles", default="default,5,10", help="HOROVOD_CYCLE_TIME values (ms); 'default': unset (1 ms)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report", default=os.path.join(ROOT, "reports", "horovod_idle.md"))
    a = ap.parse_args()
    lines = ["# What an idle Horovod process costs", "",
             f"`scripts/bench_horovod_idle.py --np {a.np} --idle {a.idle:g} --cycles {a.cycles} --repeats {a.repeats}`, "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, this machine ({os.cpu_count()} cores, shared), "
             f"OMPI_MCA_mpi_yield_when_idle=1. Each of {a.np} ranks calls hvd.init() and sleeps {a.idle:g} s; the "
             f"CPU seconds its process used meanwhile, per rank the median over {a.repeats} launches "
             f"(rank 0 is Horovod's coordinator).", "",
             "| HOROVOD_CYCLE_TIME (ms) | " + " | ".join(f"rank {r} CPU s" for r in range(a.np))
             + " | all ranks, share of one core |",
             "|---|" + "---|" * (a.np + 1)]
    print("\n".join(lines), flush=True)
    for cycle in a.cycles.split(","):
        runs = [launch(a.np, a.idle, cycle) for _ in range(a.repeats)]
        per_rank = [statistics.median(r[k] for r in runs) for k in range(a.np)]
        share = sum(per_rank) / a.idle
        label = "unset (1)" if cycle == "default" else cycle
        lines.append(f"| {label} | " + " | ".join(f"{c:.2f}" for c in per_rank) + f" | {share:.2f} |")
        print(lines[-1], "  launches:", [[round(c, 2) for c in r] for r in runs], flush=True)
    os.makedirs(os.path.dirname(a.report), exist_ok=True)
    with open(a.report, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"wrote {a.report}")


if __name__ == "__main__":
    main()

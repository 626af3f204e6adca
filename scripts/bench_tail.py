"""Benchmark the data-parallel tail against the replicated one: CPU seconds per step per process
and samples/second of DES DeepFM under mpirun, for each (N, hidden) given. One run, medians of
``--repeats`` launches; prints a Markdown table and writes it to ``--report``.

    .venv/bin/python scripts/bench_tail.py --rows 60000 --batch 4096 --steps 12 --repeats 2
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_des import ENV, ROOT, run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--configs", default="2:400,400,400;4:400,400,400;4:128,64", help="N:hidden;...")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--report", default=os.path.join(ROOT, "reports", "tail.md"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    data = os.path.join(tmp, "train.txt")
    subprocess.run([sys.executable, "-m", "des.data.synth", "--rows", str(a.rows), "--out", data],
                   env=ENV, cwd=ROOT, check=True, capture_output=True)
    lines = [f"# Data-parallel vs replicated tail (DES DeepFM, criteo-like synthetic data, {a.rows} rows)", "",
             f"`scripts/bench_tail.py --rows {a.rows} --batch {a.batch} --steps {a.steps} --repeats {a.repeats} "
             f"--configs '{a.configs}'`, {time.strftime('%Y-%m-%d')}, this machine (2 shared cores; N processes "
             f"oversubscribe them, --threads 1). Global batch {a.batch}, dim {a.dim}; median over launches of "
             f"each launch's median step.", "",
             "| N | hidden | tail | CPU s/step/process | samples/s | train AUC at the last step | CPU ratio dp/rep | samples/s ratio |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    for config in a.configs.split(";"):
        n, hidden = config.split(":")
        a.hidden = hidden
        got = {}
        for tail in ("replicated", "data_parallel"):
            runs = [run(int(n), "des", "deepfm", data, a, os.path.join(tmp, f"{n}_{tail}_{k}.json"),
                        extra=("--tail", tail)) for k in range(a.repeats)]
            got[tail] = (statistics.median(r["cpu_seconds_per_step"] for r in runs),
                         statistics.median(r["samples_per_second"] for r in runs), runs[0]["train_auc_by_step"][-1][1])
        for tail, (cpu, sps, auc) in got.items():
            ratio = (f"{got['data_parallel'][0] / got['replicated'][0]:.2f}x | "
                     f"{got['data_parallel'][1] / got['replicated'][1]:.2f}x") if tail == "data_parallel" else " | "
            line = f"| {n} | {hidden} | {tail} | {cpu:.3f} | {sps:,.0f} | {auc:.4f} | {ratio} |"
            lines.append(line)
            print(line, flush=True)
    os.makedirs(os.path.dirname(a.report), exist_ok=True)
    with open(a.report, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"written: {a.report}")


if __name__ == "__main__":
    main()

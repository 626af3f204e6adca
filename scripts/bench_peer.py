"""Benchmark DES against the peer users pick today, TFRA's own all-to-all embedding
(scripts/peer_tfra.py): samples/s, CPU seconds per step per process and seconds to the first
step of a DeepFM on criteo-like synthetic data under mpirun, for each (N, hidden) given; DES with
its fused tables and the replicated or the data-parallel tail. One run, medians of ``--repeats``
launches; prints a Markdown table and writes it to ``--report``.

    .venv/bin/python scripts/bench_peer.py --rows 60000 --batch 4096 --steps 12 --repeats 2
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench_des import ENV, ROOT, run


def peer(n, data, a, out):
    args = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", sys.executable,
            os.path.join(ROOT, "scripts", "peer_tfra.py"), "--data", data, "--batch", str(a.batch),
            "--steps", str(a.steps), "--dim", str(a.dim), "--hidden", a.hidden, "--summary-json", out]
    p = subprocess.run(args, env=ENV, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{p.stderr[-2000:]}")
    return json.load(open(out + ".rank0"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--configs", default="2:128,64;4:128,64;4:400,400,400", help="N:hidden;...")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--report", default=os.path.join(ROOT, "reports", "peer.md"))
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    data = os.path.join(tmp, "train.txt")
    subprocess.run([sys.executable, "-m", "des.data.synth", "--rows", str(a.rows), "--out", data],
                   env=ENV, cwd=ROOT, check=True, capture_output=True)
    lines = [f"# DES vs TFRA's all-to-all embedding (DeepFM, criteo-like synthetic data, {a.rows} rows)", "",
             f"`scripts/bench_peer.py --rows {a.rows} --batch {a.batch} --steps {a.steps} --repeats {a.repeats} "
             f"--configs '{a.configs}'`, {time.strftime('%Y-%m-%d')}, this machine (2 shared cores; N processes "
             f"oversubscribe them, one TF thread each). Global batch {a.batch}, dim {a.dim}; median over "
             f"launches of each launch's median step (the first step excluded). DES: fused tables; the peer: "
             f"HvdAllToAllEmbedding, all fields in one table per width, Adam, dense gradients averaged by "
             f"Horovod (scripts/peer_tfra.py).", "",
             "| N | hidden | system | samples/s | CPU s/step/process | first step (s) | samples/s vs TFRA |",
             "|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    systems = {"TFRA HvdAllToAllEmbedding": lambda n, out: peer(n, data, a, out),
               "DES, replicated tail": lambda n, out: run(n, "des", "deepfm", data, a, out, ("--tail", "replicated")),
               "DES, data-parallel tail": lambda n, out: run(n, "des", "deepfm", data, a, out,
                                                             ("--tail", "data_parallel"))}
    for config in a.configs.split(";"):
        n, a.hidden = config.split(":")
        got = {}
        for k, (name, launch) in enumerate(systems.items()):
            runs = [launch(int(n), os.path.join(tmp, f"{n}_{k}_{r}.json")) for r in range(a.repeats)]
            got[name] = [statistics.median(r[key] for r in runs)
                         for key in ("samples_per_second", "cpu_seconds_per_step", "seconds_to_first_step")]
        base = got["TFRA HvdAllToAllEmbedding"][0]
        for name, (sps, cpu, first) in got.items():
            line = f"| {n} | {a.hidden} | {name} | {sps:,.0f} | {cpu:.3f} | {first:.1f} | {sps / base:.2f}x |"
            lines.append(line)
            print(line, flush=True)
    os.makedirs(os.path.dirname(a.report), exist_ok=True)
    with open(a.report, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"written: {a.report}")


if __name__ == "__main__":
    main()

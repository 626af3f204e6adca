"""Benchmark DES: bytes/step (measured vs analytic) per model, and samples/second of DES at
N=1,2,4 vs the plain single-process model. Prints a Markdown table; one run, medians.

    .venv/bin/python scripts/bench_des.py --rows 100000 --batch 4096 --steps 12
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2")


def run(n, mode, model, data, a, out, extra=(), launcher=None):
    """des.train on ``n`` processes (mpirun when n > 1, or ``launcher``: a netbed's mpirun) with
    ``a``'s batch, steps, dim and hidden, plus ``extra`` arguments; rank 0's summary."""
    args = [sys.executable, "-m", "des.train", "--mode", mode, "--model", model, "--data", data,
            "--batch", str(a.batch), "--steps", str(a.steps), "--holdout", "0", "--threads", "1",
            "--dim", str(a.dim), "--hidden", a.hidden, "--shuffle-buffer", "0", "--summary-json", out,
            # the PS checks its bytes against the formula on 2 steps, not des.train's 20: the check hands each
            # step's ids to Python, and in a run of a few steps it would be in every measured step
            "--check-bytes", "2", *extra]
    if launcher:
        args = list(launcher) + args
    elif n > 1:
        args = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none"] + args
    launch(args, netbed=bool(launcher))
    return json.load(open(out if n == 1 else out + ".rank0"))


def launch(args: list[str], netbed: bool = False) -> None:
    """Run ``args`` (stop the benchmark with its stderr if it fails); on the netbed again, up to 3
    times, when Open MPI's daemons did not start."""
    for _ in range(3):     # Open MPI's daemons across the netbed's namespaces fail to start now and then
        p = subprocess.run(args, env=ENV, cwd=ROOT, capture_output=True, text=True)
        if p.returncode == 0 or not netbed or "ORTE" not in p.stderr + p.stdout:
            break
        print("mpirun could not start its daemons on the netbed; again", flush=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{p.stderr[-2000:]}")


def config_parser(configs: str, report: str) -> argparse.ArgumentParser:
    """The options of the benchmarks that sweep (N, hidden) configurations (bench_tail, bench_peer)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--configs", default=configs, help="N:hidden;...")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--report", default=os.path.join(ROOT, "reports", report))
    return ap


def synth_data(rows: int, preset: str = "criteo-like") -> str:
    """``rows`` generated lines of a criteo-format ``preset`` in a new temporary folder: the file's path."""
    data = os.path.join(tempfile.mkdtemp(), "train.txt")
    subprocess.run([sys.executable, "-m", "des.data.synth", "--rows", str(rows), "--out", data, "--preset", preset],
                   env=ENV, cwd=ROOT, check=True, capture_output=True)
    return data


def preset_data(preset: str, rows: int, runs: str, columnar: bool = False) -> tuple[str, tuple, str]:
    """(data, des.train's reader arguments, a folder for the runs' summaries) of a benchmark:
    criteo-like text in a new temporary folder (``columnar``: and its columnar copy beside it,
    which every system then reads), or the wide preset's columnar copy (written once under
    reports/compare/data; a text parser reading the global batch would decide DES's speed there),
    its summaries under reports/compare/``runs``."""
    sys.path.insert(0, ROOT)
    from des.jobs.compare import ensure_columnar, ensure_data
    if preset != "wide":
        data = synth_data(rows, preset)
        if not columnar:
            return data, (), os.path.dirname(data)
        cols, _ = ensure_columnar([data], "criteo", None, json.load(open(data + ".meta.json")))
        return cols, ("--format", "columnar"), os.path.dirname(data)
    text = ensure_data("wide", rows, 0, os.path.join(ROOT, "reports", "compare", "data"))
    data, _ = ensure_columnar([text], "libffm", None, json.load(open(text + ".meta.json")))
    tmp = os.path.join(ROOT, "reports", "compare", runs)
    os.makedirs(tmp, exist_ok=True)
    return data, ("--format", "columnar"), tmp


def write_report(path: str, lines: list[str]) -> None:
    """The Markdown lines a benchmark printed, written to ``path`` (its committed report)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print(f"written: {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--models", default="lr,fm,dnn,wdl,deepfm")
    ap.add_argument("--speed-model", default="deepfm")
    a = ap.parse_args()
    tmp = tempfile.mkdtemp()
    data = os.path.join(tmp, "train.txt")
    subprocess.run([sys.executable, "-m", "des.data.synth", "--rows", str(a.rows), "--out", data],
                   env=ENV, cwd=ROOT, check=True, capture_output=True)
    print(f"## bytes per step per process, B={a.batch}, N={a.np}, criteo-like, dim {a.dim}, hidden {a.hidden}\n")
    print("| model | floats/sample | handed to allreduce, measured | analytic 4·B·w | ring 2(N−1)/N |")
    print("|---|---|---|---|---|")
    for m in a.models.split(","):
        s = run(a.np, "des", m, data, a, os.path.join(tmp, f"{m}.json"))
        print(f"| {m} | {s['floats_per_sample']} | {s['bytes_per_step_measured']:.0f} | "
              f"{s['bytes_per_step_analytic']} | {s['ring_bytes_per_step']:.0f} |", flush=True)
    print(f"\n## samples/second per process, {a.speed_model}, B={a.batch} (median step, 2 cores)\n")
    plain = run(1, "single", a.speed_model, data, a, os.path.join(tmp, "plain.json"))["samples_per_second"]
    print("| run | samples/s | vs plain |\n|---|---|---|")
    print(f"| plain, 1 process | {plain:.0f} | 1.00 |", flush=True)
    for n in (1, 2, 4):
        s = run(n, "des", a.speed_model, data, a, os.path.join(tmp, f"speed{n}.json"))["samples_per_second"]
        print(f"| DES N={n} | {s:.0f} | {s / plain:.2f} |", flush=True)


if __name__ == "__main__":
    main()

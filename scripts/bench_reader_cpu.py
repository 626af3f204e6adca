"""CPU a reader spends per batch (all of its threads), the cost two processes sharing two cores
pay beside their steps: the text reader (criteo-like TSV, every input or half of them, as a DES
process of 2 reads) and the columnar one, with the default shuffle buffer and without.

    .venv/bin/python scripts/bench_reader_cpu.py --label after --out reports/reader_cpu.md
    PYTHONPATH=<a checkout of another commit> .venv/bin/python scripts/bench_reader_cpu.py --label before --out ...

Each row: the median over ``--repeats`` passes of CPU ms (process time) per batch of ``--batch``
lines after the first batch, TensorFlow limited to one thread per pool as des.train --threads 1;
``--label`` names the code measured (the rows of earlier labels in ``--out`` are kept, so two
checkouts can be compared in one report: run one after the other, nothing else running).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cpu_ms_per_batch(make, batches: int, repeats: int) -> float:
    got = []
    for _ in range(repeats):
        it = iter(make())
        next(it)
        c0 = time.process_time()
        for _ in range(batches):
            next(it)
        got.append(1000 * (time.process_time() - c0) / batches)
    return statistics.median(got)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--label", required=True, help="names the code measured, e.g. a commit")
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--batches", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(ROOT, "reports", "reader_cpu.md"))
    a = ap.parse_args()
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    from des.data import criteo_spec
    from des.data.columnar import make_dataset as columnar_dataset
    from des.data.readers import make_dataset as text_dataset

    tmp = tempfile.mkdtemp()
    text = os.path.join(tmp, "train.txt")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    subprocess.run([sys.executable, "-m", "des.data.synth", "--preset", "criteo-like", "--rows", str(a.rows),
                    "--out", text], env=env, check=True, capture_output=True)
    subprocess.run([sys.executable, "-m", "des.data.convert", "--data", text, "--out", text + ".cols"],
                   env=env, check=True, capture_output=True)
    spec = criteo_spec(dim=8)
    half = spec.input_names()[::2]
    cases = [("text, every input", lambda s: text_dataset([text], "criteo", spec, a.batch, shuffle_buffer=s, seed=1)),
             ("text, half the inputs", lambda s: text_dataset([text], "criteo", spec, a.batch, shuffle_buffer=s,
                                                              seed=1, inputs=half)),
             ("columnar, half the inputs", lambda s: columnar_dataset(text + ".cols", spec, a.batch, shuffle_buffer=s,
                                                                      seed=1, inputs=half))]
    rows = []
    for name, make in cases:
        for shuffle in (50_000, 0):
            ms = cpu_ms_per_batch(lambda: make(shuffle), a.batches, a.repeats)
            rows.append(f"| {a.label} | {name} | {shuffle:,} | {ms:.1f} |")
            print(rows[-1], flush=True)
    head = ["# CPU a reader spends per batch",
            "",
            f"Written by `scripts/bench_reader_cpu.py --label <code> --rows {a.rows} --batch {a.batch} --batches "
            f"{a.batches} --repeats {a.repeats}` on {platform.node()} ({os.cpu_count()} cores, shared): criteo-like "
            f"TSV ({a.rows:,} lines) and its columnar copy, CPU ms (all threads) per batch of {a.batch:,} lines, "
            f"median of {a.repeats} passes of {a.batches} batches, TensorFlow at one thread per pool. Each label is "
            f"one checkout, run one after the other (UTC: the label's line).",
            "",
            "| code | reader | shuffle buffer | CPU ms per batch |",
            "|---|---|---|---|"]
    kept = []
    if os.path.exists(a.out):
        kept = [line for line in open(a.out).read().splitlines()
                if line.startswith("| ") and not line.startswith(f"| {a.label} |") and not line.startswith("| code")]
    when = [line for line in (open(a.out).read().splitlines() if os.path.exists(a.out) else [])
            if line.startswith("- ") and not line.startswith(f"- {a.label}:")]
    when.append(f"- {a.label}: {time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC")
    with open(a.out, "w") as fh:
        fh.write("\n".join(head + kept + rows + [""] + when) + "\n")
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()

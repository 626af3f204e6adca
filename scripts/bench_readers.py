"""Does reading keep up with training? Lines/second of each reader next to the samples/second
of one single-process training step on the same batches. One run; medians of --repeats passes.

    .venv/bin/python scripts/bench_readers.py --batch 2048 --repeats 3

It generates Criteo-like TSV and wide libffm (~950 features per line), times
``make_dataset(...)`` end to end (decode, validate, hash, pad; tf.data's own parallelism),
then times ``model.train_on_batch`` on batches already in memory. ratio = reader lines/s
÷ training samples/s: above 1, the reader is not the bottleneck on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def time_reader(make, repeats: int) -> float:
    """Median lines/s of a pass over make(), steady state: the clock starts after the first batch
    (tracing and pipeline start-up are paid once per job)."""
    rates = []
    for _ in range(repeats):
        n, t0 = 0, None
        for _, y in make():
            if t0 is None:
                t0 = time.perf_counter()
                continue
            n += int(y.shape[0])
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def time_training(model_name: str, spec, batches, repeats: int) -> float:
    """Median samples/s of train_on_batch over the cached batches (after a warm-up step)."""
    import models
    model = models.build(model_name, spec)
    model.compile(models.make_optimizer("adam"), "binary_crossentropy")
    x, y = batches[0]
    model.train_on_batch(x, y)
    rates = []
    for _ in range(repeats):
        t0, n = time.perf_counter(), 0
        for x, y in batches:
            model.train_on_batch(x, y)
            n += int(y.shape[0])
        rates.append(n / (time.perf_counter() - t0))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--criteo-rows", type=int, default=200_000)
    ap.add_argument("--wide-rows", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="deepfm")
    ap.add_argument("--train-batches", type=int, default=5)
    a = ap.parse_args()

    import des  # noqa: F401  (quiets TF logs)
    from des.data import FeatureSpec, criteo_spec
    from des.data.readers import make_dataset

    tmp = tempfile.mkdtemp()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    cases = []
    for preset, rows, fname in (("criteo-like", a.criteo_rows, "criteo.txt"), ("wide", a.wide_rows, "wide.ffm")):
        path = os.path.join(tmp, fname)
        subprocess.run([sys.executable, "-m", "des.data.synth", "--preset", preset, "--rows", str(rows),
                        "--out", path], env=env, cwd=ROOT, check=True, capture_output=True)
        meta = json.load(open(path + ".meta.json"))
        if preset == "wide":
            spec, fmt = FeatureSpec.from_json(json.dumps(meta["spec"])), "libffm"
        else:
            spec, fmt = criteo_spec(8, cardinalities=meta.get("cardinalities")), "criteo"
        cases.append((preset, fmt, path, spec, meta))

    print(f"## reader lines/s vs {a.model} training samples/s, batch {a.batch}, "
          f"{os.cpu_count()} cores, medians of {a.repeats}\n")
    print("| data | format | features/line | reader lines/s | reader lines/s (skip mode) | "
          "training samples/s | reader ÷ training |")
    print("|---|---|---|---|---|---|---|")
    for preset, fmt, path, spec, meta in cases:
        def make(skip=False):
            return make_dataset(path, fmt, spec, a.batch, skip_bad_lines=skip)
        rate = time_reader(make, a.repeats)
        rate_skip = time_reader(lambda: make(True), a.repeats)
        batches = list(make().take(a.train_batches))
        train = time_training(a.model, spec, batches, a.repeats)
        feats = meta.get("active_features_per_sample", len(spec.sparse()))
        print(f"| {preset} | {fmt} | {feats} | {rate:,.0f} | {rate_skip:,.0f} | {train:,.0f} | "
              f"{rate / train:.1f}x |", flush=True)


if __name__ == "__main__":
    main()

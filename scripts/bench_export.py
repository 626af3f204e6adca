"""What ``des.export(model, out)`` costs for a big table: rows, time, size on disk and the memory
peak of the process that writes it, and the load time where neither des nor TFRA is imported.

    .venv/bin/python scripts/bench_export.py --rows 15000000 --dim 8 --out reports/export.md

The model is a user's TFRA model (one ``de.keras.layers.Embedding`` of ``--rows`` random 55-bit
keys with random rows, a Dense on top), made key-deterministic as des.transform makes it. The
peak is the process's resident high-water mark (VmHWM, reset just before the export), next to
its resident memory with the table filled; the table's own payload is rows x (8 + 4 x dim) bytes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow_recommenders_addons import dynamic_embedding as de  # noqa: E402

import des  # noqa: E402
from des.runtime import export  # noqa: E402

CHUNK = 1_000_000


def status(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def build(rows: int, dim: int, seed: int) -> tf.keras.Model:
    ids = tf.keras.Input([], dtype=tf.int64, name="C1")
    table = de.keras.layers.Embedding(dim, name="big_table")
    model = tf.keras.Model(ids, tf.keras.layers.Dense(1, activation="sigmoid")(table(ids)))
    des.make_keyed(model, seed=0)
    rng = np.random.default_rng(seed)
    for at in range(0, rows, CHUNK):
        n = min(CHUNK, rows - at)
        keys = rng.integers(0, 2 ** 55, n, dtype=np.int64)
        table.params.upsert(tf.constant(keys), tf.constant(rng.uniform(-0.05, 0.05, (n, dim)).astype(np.float32)))
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=15_000_000)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the report here (markdown)")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    model = build(a.rows, a.dim, a.seed)
    held = int(model.get_layer("big_table").params.size())
    filled, fill_seconds = status("VmRSS"), time.perf_counter() - t0
    probe = {"C1": tf.constant(np.random.default_rng(1).integers(0, 2 ** 55, 64, dtype=np.int64))}
    want = np.asarray(model(probe["C1"]))
    with open("/proc/self/clear_refs", "w") as fh:          # reset VmHWM to the current RSS
        fh.write("5")
    tmp = tempfile.mkdtemp()
    out = os.path.join(tmp, "served")
    t0 = time.perf_counter()
    info = export(model, out)
    seconds, peak = time.perf_counter() - t0, status("VmHWM")
    load = export.load_seconds(out)
    served = tf.saved_model.load(out).signatures["serving_default"]
    got = list(served(**probe).values())[0].numpy()
    payload = held * (8 + 4 * a.dim)
    lines = [
        "# des.export of a big TFRA table",
        "",
        f"`{' '.join(['scripts/bench_export.py'] + (argv if argv is not None else sys.argv[1:]))}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores.",
        "",
        "| what | value |",
        "|---|---|",
        f"| rows held (dim {a.dim}) | {held:,} |",
        f"| table payload, keys + rows | {payload / 2**30:.2f} GiB |",
        f"| process RSS with the table filled ({fill_seconds:.0f} s to fill) | {filled / 2**30:.2f} GiB |",
        f"| peak RSS while exporting | {peak / 2**30:.2f} GiB (+{(peak - filled) / 2**30:.2f} GiB, "
        f"{(peak - filled) / payload:.1f}x the payload) |",
        f"| export time | {seconds:.0f} s |",
        f"| SavedModel on disk | {info['bytes'] / 2**30:.2f} GiB |",
        f"| tf.saved_model.load where neither des nor TFRA is imported | {load:.1f} s |",
        f"| served vs the model, 64 keys (most unseen) | max abs diff {np.abs(got.reshape(want.shape) - want).max():.1e} |",
        "",
        "The export holds the table's keys and rows in memory while it writes them (a copy as numpy,",
        "one as the static table's matrix and index, and TensorFlow's while saving): the peak above the",
        "filled process is what streaming the rows to disk would save.",
    ]
    print("\n".join(lines))
    if a.out:
        with open(a.out, "w") as fh:
            fh.write("\n".join(lines) + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

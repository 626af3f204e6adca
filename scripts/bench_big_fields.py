"""Table rows each process holds after des.transform of a user's model whose largest field is too
big for one owner, with and without splitting it by key stripe (des.compiler.big_tables).

The model: the criteo-big-field preset's 39 fields (des.data.synth: C26 has 1,000,000 values, about
80% of all fields' rows), each a Keras ``Embedding(cardinality, dim)`` (a static table holds all its
rows from the start, trained or not), FM over their stack and a first Dense over their
concatenation (DeepFM). Each N runs in the simulated world (des_ops.comm.InProcessWorld): every
process transforms the model and the rows of the tables it holds are counted. "whole" is
``des.Options(stripe_min_rows=None)`` (every field with one owner), "split" the default (a field
with more than an even share of all fields' rows and at least 1,000,000 is split by key stripe).
Prints a Markdown table and writes it to ``--report``:

    .venv/bin/python scripts/bench_big_fields.py --worlds 2,4,8 --report reports/big_fields_rows.md
"""
import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(64)     # the simulated world: one thread per process

import des  # noqa: E402
from bench_des import write_report  # noqa: E402
from des.data.synth import PRESETS  # noqa: E402
from des.graph.sources import source_of  # noqa: E402
from des.jobs.verify import _on_every_rank  # noqa: E402
from des_ops.comm import InProcessWorld  # noqa: E402
from models.spec import CRITEO_CAT, CRITEO_INT  # noqa: E402

L = tf.keras.layers


def cardinalities() -> dict[str, int]:
    """The criteo-big-field preset's rows per field (as des.data.synth writes them in its metadata)."""
    p = PRESETS["criteo-big-field"]
    return dict(zip(CRITEO_INT + CRITEO_CAT, [c + 1 for c in p.int_card + p.cat_card]))


def user_deepfm(rows: dict[str, int], dim: int) -> tf.keras.Model:
    """A user's DeepFM: a Keras Embedding(rows, dim) and Embedding(rows, 1) per field, FM by TF ops
    over their stack, the linear sum, a first Dense over the concatenation."""
    x = {f: tf.keras.Input(shape=(), dtype=tf.int64, name=f) for f in rows}
    e = tf.stack([L.Embedding(n, dim, name=f"emb_{f}")(x[f]) for f, n in rows.items()], axis=1)
    linear = tf.add_n([L.Embedding(n, 1, name=f"w_{f}")(x[f]) for f, n in rows.items()])
    s = tf.reduce_sum(e, axis=1)
    fm = 0.5 * tf.reduce_sum(s * s - tf.reduce_sum(e * e, axis=1), axis=1, keepdims=True)
    deep = L.Dense(1)(L.Dense(64, activation="relu")(L.Flatten()(e)))
    return tf.keras.Model(x, tf.sigmoid(linear + fm + deep))


def rows_held(n: int, dim: int, stripe_min_rows) -> tuple[list[int], list[str]]:
    """Every process's table rows (width-dim and 1-wide tables) after des.transform at N = n, and
    rank 0's report lines on fields too big for one owner."""
    world, rows = InProcessWorld(n), cardinalities()

    def one(r: int):
        tf.keras.utils.set_random_seed(0)
        model, report = des.transform(user_deepfm(rows, dim), des.Options(stripe_min_rows=stripe_min_rows),
                                      comm=world.communicator(r))
        held = sum(int(source_of(t).rows(t)) for t in des.distributed(model).layer.owned if source_of(t) is not None)
        return held, report.big_fields
    out = _on_every_rank(world, one)
    return [h for h, _ in out], out[0][1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", default="2,4,8")
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--report", default=os.path.join(ROOT, "reports", "big_fields_rows.md"))
    a = ap.parse_args()
    total = 2 * sum(cardinalities().values())          # a width-dim and a 1-wide table per field
    lines = ["# Table rows per process: a field too big for one owner, whole or split by key stripe", "",
             f"`scripts/bench_big_fields.py --worlds {a.worlds} --dim {a.dim}`, {time.strftime('%Y-%m-%d %H:%M')}. "
             f"A user's Keras DeepFM over the criteo-big-field preset's 39 fields (C26: 1,000,000 of "
             f"{total // 2:,} rows), two tables per field ({total:,} rows in all); des.transform on every process "
             f"of the simulated world, rows of the tables each process holds. whole: "
             f"`des.Options(stripe_min_rows=None)`; split: the defaults (des.compiler.big_tables). The largest "
             f"process's share against the ideal 1/N is the memory a process must have beyond an even split.",
             "", "| N | tables | rows per process (min - max) | largest / (all / N) |", "|---|---|---|---|"]
    notes = []
    for n in [int(w) for w in a.worlds.split(",")]:
        for name, smr in (("whole", None), ("split", 1_000_000)):
            held, big = rows_held(n, a.dim, smr)
            lines.append(f"| {n} | {name} | {min(held):,} - {max(held):,} | {max(held) / (total / n):.2f}x |")
            print(lines[-1], flush=True)
            if name == "split":
                notes += [f"N = {n}: {line}" for line in big]
    lines += ["", "Notes (rank 0's report):", ""] + [f"- {note}" for note in notes]
    write_report(a.report, lines)


if __name__ == "__main__":
    main()

"""One process of a parameter-server run under mpirun (used by tests/test_mpi.py):

    mpirun -np 3 python scripts/mpi_ps.py deepfm adam OUT_DIR [per-field|fused]

Each rank trains the PS model on ITS slice of the shared global batches (keys repeat within
and across slices; the last global batch has fewer rows than processes, so some rank gets
none), predicts the shared probe after every step, and pickles to OUT_DIR/rank<r>.pkl the
predictions, the final snapshot (this process's share of every table's rows, the weights) and,
per step, the bytes and ids counted by the exchange (scalars, and the bytes per destination
and per source of every all-to-all kind) and the analytic ones.
"""
import os
import pickle
import sys

import des  # noqa: F401
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import models  # noqa: E402
from des.data.readers import _slice_batch  # noqa: E402
from des.baselines.ps.rewrite import analytic_bytes, dense_parameters, shard, table_inputs  # noqa: E402
from des.jobs.verify import optimizer_factory, ps_batches, PS_SPEC, snapshot  # noqa: E402
from des.baselines.ps.tables import KeyExchange  # noqa: E402
from des_ops.fused import fused_tables  # noqa: E402

LR = {"sgd": 0.2, "adagrad": 0.05, "adam": 0.01, "ftrl": 0.05}


def main(name: str, optimizer: str, out: str, tables: str = "per-field") -> None:
    exchange = KeyExchange()
    rank, n = exchange.rank, exchange.world_size
    batches, probe = ps_batches()
    model = shard(models.build(name, PS_SPEC, seed=3, hidden=(8, 4)), exchange, fuse=tables in ("fused", "joined"),
                  join_linear=tables == "joined")
    model.compile(optimizer_factory(optimizer, LR)(), "binary_crossentropy")
    tables, dense = table_inputs(model), dense_parameters(model)
    preds, measured, analytic, rows = [], [], [], []
    for x, y in batches:
        xs, ys = _slice_batch(x, y, rank, n)
        before = exchange.snapshot()
        model.train_on_batch(xs, ys)
        after = exchange.snapshot()
        delta = {k: after[k] - before[k] for k in after if k not in ("sent", "received")}
        for side in ("sent", "received"):
            delta[side] = {k: [a - b for a, b in zip(after[side][k], before[side][k])] for k in after[side]}
        measured.append(delta)
        analytic.append(analytic_bytes({k: v.numpy() for k, v in xs.items()}, tables, rank, n, dense))
        rows.append(int(ys.shape[0]))
        preds.append(model.predict_on_batch(probe))
    with open(os.path.join(out, f"rank{rank}.pkl"), "wb") as fh:
        pickle.dump({"predictions": preds, "measured": measured, "analytic": analytic, "rows": rows,
                     "snapshot": snapshot(model), "rank": rank,
                     "fused_tables": len(fused_tables(model))}, fh)


if __name__ == "__main__":
    main(*sys.argv[1:5])

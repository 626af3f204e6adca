"""One process of the cache-mode checks under mpirun (used by tests/test_cache.py):

    mpirun -np 3 python scripts/mpi_cache.py OUT_DIR

Runs every configuration of CONFIGS in this one launch. Each rank trains the cached model on
ITS slice of shared global batches, predicts a shared probe after every step (s = 0 runs), and
after a final flush pickles to OUT_DIR/<config>.rank<r>.pkl: the predictions, the cache
counters per step, per table (a fused table: by its packed keys) the gradient totals it computed
and (as owner) applied, and its owned rows with their start rows (for the SGD row check).
"""
import math
import os
import pickle
import sys
import time

import des  # noqa: F401  (quiets TF logs first)
import tensorflow as tf

if __name__ == "__main__":   # (tests import CONFIGS from this file)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)

import models  # noqa: E402
from des.baselines.cache.rewrite import cache  # noqa: E402
from des.data.readers import _slice_batch  # noqa: E402
from des.jobs.verify import PS_SPEC, optimizer_factory, ps_batches, random_batches  # noqa: E402
from des.baselines.ps.tables import KeyExchange  # noqa: E402

LR = {"sgd": 0.2, "adagrad": 0.05, "adam": 0.01, "ftrl": 0.05}
# name: (model, optimizer, staleness, capacity rows per table, eviction, fused tables, batches);
# fused: one table and one cache per width, of the members' capacity together
CONFIGS = {
    "exact-wdl-sgd": ("wdl", "sgd", 0, 1000, "lru", False, "ps"),
    "exact-deepfm-ftrl+adam-small-fused": ("deepfm", "ftrl+adam", 0, 4, "lru", True, "ps"),
    "stale10-sgd-lru-fused": ("deepfm", "sgd", 10, 6, "lru", True, "long"),
    "stale3-adagrad-lfu": ("fm", "adagrad", 3, 5, "lfu", False, "long"),
    "async-sgd-fused": ("deepfm", "sgd", math.inf, 8, "lru", True, "long"),
}


def batches_of(kind: str):
    if kind == "ps":
        return ps_batches()
    return random_batches(PS_SPEC, 30, 64, seed=6), random_batches(PS_SPEC, 1, 16, seed=99)[0][0]


def run(name: str, out: str, exchange: KeyExchange) -> None:
    model_name, optimizer, staleness, capacity, eviction, fuse, kind = CONFIGS[name]
    rank, n = exchange.rank, exchange.world_size
    batches, probe = batches_of(kind)
    model = cache(models.build(model_name, PS_SPEC, seed=3, hidden=(8, 4)), exchange, staleness=staleness,
                  capacity=capacity, eviction=eviction, audit=True, fuse=fuse)
    model.compile(optimizer_factory(optimizer, LR)(), "binary_crossentropy")
    counters = dict(exchange.counters, **model.cached_tables()[0][0].counters)
    read = lambda: {k: int(v.numpy()) for k, v in counters.items()}
    preds, steps = [], []
    for x, y in batches:
        xs, ys = _slice_batch(x, y, rank, n)
        before = read()
        model.train_on_batch(xs, ys)
        after = read()
        steps.append({k: after[k] - before[k] for k in after})
        steps[-1]["max_read_gap"] = after["max_read_gap"]
        steps[-1]["over_capacity"] = after["over_capacity"]
        if staleness == 0:
            preds.append(model.predict_on_batch(probe))
    model.flush()
    preds.append(model.predict_on_batch(probe))
    tables = {}
    for layer, _ in model.cached_tables():
        lines = layer.lines
        ck, cv = lines.computed.export()
        ak, av = lines.applied.export()
        keys, rows = layer.params.export()
        init = layer.new_rows(keys)
        tables[layer.field + ("/linear" if layer.linear else "")] = {
            "computed": (ck.numpy(), cv.numpy()), "applied": (ak.numpy(), av.numpy()),
            "rows": (keys.numpy(), rows.numpy(), init.numpy()), "capacity": layer.config.capacity}
    with open(os.path.join(out, f"{name}.rank{rank}.pkl"), "wb") as fh:
        pickle.dump({"predictions": preds, "steps": steps, "tables": tables, "lr": LR.get(optimizer)}, fh)


def main(out: str, names: list[str]) -> None:
    exchange = KeyExchange()
    for name in names or list(CONFIGS):
        start = time.perf_counter()
        run(name, out, exchange)
        if exchange.rank == 0:
            print(f"{name}: {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

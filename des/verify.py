"""Equivalence checking: train a model for some steps and snapshot what it learned, then
compare a DES model (any N, real or simulated world) with the untouched model.

    >>> ref = train_and_snapshot(build(), "adam", 1e-3, batches, probe)
    >>> outs = run_in_process_world(4, build, lambda m: train_and_snapshot(m, "adam", 1e-3, batches, probe))
    >>> diff = compare(ref, outs)          # max abs diff of predictions, rows and weights

Snapshots key tables by (field, width) and dense weights by layer and weight name, so a
reference built separately (same seed) lines up with every process's share.
"""
from __future__ import annotations

import threading
import traceback
from typing import Callable

import numpy as np
import tensorflow as tf

from des.data.spec import PAD_ID, FeatureSpec, Field
from des_ops.comm import InProcessWorld


def table_layers(model: tf.keras.Model) -> list:
    des_layer = getattr(model, "des_layer", None)
    if des_layer is not None:
        return list(des_layer.owned)
    return [l for l in model.layers if getattr(l, "des_embedding", False)]


def snapshot(model: tf.keras.Model) -> dict:
    """{"tables": {(field, dim): {key: row}}, "weights": {name: array}, "first_dense": {(dense, field): rows}}."""
    tables = {}
    for t in table_layers(model):
        keys, values = t.params.export()
        tables[(t.field, t.dim)] = dict(zip(keys.numpy().tolist(), values.numpy()))
    weights, first = {}, {}
    des_layer = getattr(model, "des_layer", None)
    tail = [l for l in model.layers if l is not des_layer and not getattr(l, "des_embedding", False)]
    if des_layer is not None:
        dims = {t.name: t.dim for t in des_layer.owned}
        for op in des_layer.ops:
            if hasattr(op, "rows_by_field"):
                dense = op.source
                for f, rows in op.rows_by_field(dims).items():
                    first[(dense, f)] = rows
                if op.bias is not None:
                    weights[f"{dense}/bias"] = op.bias.numpy()
    else:
        from des.compiler import find_substitutions
        from des.ir import Graph
        matches, _ = find_substitutions(Graph(model))
        for m in matches:
            if m.rule == "embed_concat_dense":
                kernel, start = m.root.layer.kernel.numpy(), 0
                for e in m.embeds:
                    first[(m.root.layer.name, e.attrs["field"])] = kernel[start:start + e.attrs["dim"]]
                    start += e.attrs["dim"]
                if m.root.layer.use_bias:
                    weights[f"{m.root.layer.name}/bias"] = m.root.layer.bias.numpy()
                tail.remove(m.root.layer)
    for l in tail:
        for w in l.weights:
            weights[f"{l.name}/{w.name.split('/')[-1].split(':')[0]}"] = w.numpy()
    return {"tables": tables, "weights": weights, "first_dense": first}


def optimizer_factory(name: str, learning_rates: dict[str, float]) -> Callable:
    """``"adam"``, or ``"ftrl+adam"``: FTRL on the linear part, Adam on the rest."""
    from models.optim import make_optimizer
    if "+" in name:
        linear, rest = name.split("+")
        return lambda: make_optimizer(rest, learning_rates[rest], linear=linear,
                                      linear_learning_rate=learning_rates[linear])
    return lambda: make_optimizer(name, learning_rates[name])


def train_and_snapshot(model, optimizer, learning_rate: float | None, batches, probe) -> dict:
    """train_on_batch over ``batches``; predictions on ``probe`` after every step; final snapshot.

    ``optimizer``: a name for make_optimizer, or a function that makes the optimizer."""
    from models.optim import make_optimizer
    opt = optimizer() if callable(optimizer) else make_optimizer(optimizer, learning_rate)
    model.compile(opt, loss="binary_crossentropy")
    preds = []
    for x, y in batches:
        model.train_on_batch(x, y)
        preds.append(np.asarray(model.predict_on_batch(probe)))
    return {"predictions": np.stack(preds), **snapshot(model)}


def _maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    """Max over elements of min(abs diff, relative diff)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = np.abs(a - b)
    return float(np.max(np.minimum(d, d / np.maximum(np.abs(b), 1e-30)))) if d.size else 0.0


def compare(ref: dict, ranks: list[dict]) -> dict[str, float]:
    """Max diffs (abs or relative, whichever is smaller) between the reference and all ranks.

    Every table and first-Dense row block must be owned by exactly one rank; every rank's
    predictions and replicated weights must match the reference."""
    out = {"predictions": 0.0, "tables": 0.0, "first_dense": 0.0, "weights": 0.0}
    owned_tables: dict = {}
    owned_rows: dict = {}
    for r, snap in enumerate(ranks):
        out["predictions"] = max(out["predictions"], _maxdiff(snap["predictions"], ref["predictions"]))
        for k, rows in snap["tables"].items():
            if k in owned_tables:
                raise AssertionError(f"table {k} owned by ranks {owned_tables[k]} and {r}")
            owned_tables[k] = r
            ref_rows = ref["tables"][k]
            if set(rows) != set(ref_rows):
                raise AssertionError(f"table {k} on rank {r}: {len(rows)} keys, reference has {len(ref_rows)}")
            for key, v in rows.items():
                out["tables"] = max(out["tables"], _maxdiff(v, ref_rows[key]))
        for k, v in snap["first_dense"].items():
            owned_rows[k] = r
            out["first_dense"] = max(out["first_dense"], _maxdiff(v, ref["first_dense"][k]))
        if set(snap["weights"]) != set(ref["weights"]):
            raise AssertionError(f"rank {r} weights {sorted(snap['weights'])} != reference {sorted(ref['weights'])}")
        for k, v in snap["weights"].items():
            out["weights"] = max(out["weights"], _maxdiff(v, ref["weights"][k]))
    if set(owned_tables) != set(ref["tables"]):
        raise AssertionError(f"tables owned by no rank: {sorted(set(ref['tables']) - set(owned_tables))}")
    if set(owned_rows) != set(ref["first_dense"]):
        raise AssertionError(f"Dense rows owned by no rank: {sorted(set(ref['first_dense']) - set(owned_rows))}")
    return out


def run_in_process_world(world_size: int, build: Callable[[], tf.keras.Model],
                         work: Callable[[tf.keras.Model], object], **transform_kwargs) -> list:
    """Transform ``build()`` once per simulated rank, run ``work`` on every rank in its own thread."""
    from des.compiler import transform
    world = InProcessWorld(world_size)
    des_models = [transform(build(), comm=world.communicator(r), **transform_kwargs)[0]
                  for r in range(world_size)]
    results: list = [None] * world_size
    errors: list = []

    def run(r):
        try:
            results[r] = work(des_models[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((r, e, traceback.format_exc()))
            world._barrier.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        r, e, tb = min(errors, key=lambda x: "BrokenBarrierError" in x[2])
        raise RuntimeError(f"simulated rank {r} failed: {e}\n{tb}")
    return results


def small_spec(n_fields: int = 6, dim: int = 4) -> FeatureSpec:
    return FeatureSpec(tuple(Field(f"f{i}", "categorical", dim, cardinality=10 * (i + 1))
                             for i in range(n_fields)))


def random_batches(spec: FeatureSpec, steps: int, batch: int, seed: int = 0):
    """Zipf-like ids (keys repeat within and across batches), labels from a planted rule.
    Multi-valued fields get 0..max_len ids per sample (PAD_ID after them), weighted ones
    also weights in [0.5, 2)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = {}
        score = np.zeros(batch)
        for i, f in enumerate(spec.sparse()):
            card = f.cardinality or 50
            shape = (batch, f.max_len) if f.kind == "multi" else (batch,)
            ids = np.minimum(rng.zipf(1.3, shape), card).astype(np.int64) * 1000003 + i
            if f.kind == "multi":
                pad = np.arange(f.max_len)[None, :] >= rng.integers(0, f.max_len + 1, batch)[:, None]
                ids[pad] = PAD_ID
                w = np.where(pad, 0.0, rng.uniform(0.5, 2.0, shape)).astype(np.float32)
                if f.weighted:
                    x[f.weight_name] = tf.constant(w)
                score += (np.sin(ids % 7) * (w if f.weighted else ~pad)).sum(axis=1)
            else:
                score += np.sin(ids % 7)
            x[f.name] = tf.constant(ids)
        y = (score + rng.normal(0, 1, batch) > 0).astype(np.float32)
        out.append((x, tf.constant(y)))
    return out


PS_SPEC = FeatureSpec((Field("u", "categorical", 3, 30), Field("tags", "multi", 3, 40, max_len=4),
                       Field("terms", "multi", 3, 60, max_len=5, weighted=True),
                       Field("ad", "categorical", 3, 20)))


def ps_batches(steps: int = 8, batch: int = 24):
    """Global batches for the PS equivalence runs: Zipf keys (duplicates within and across
    slices), then a batch of 2 rows (with 3+ processes some slice is empty) and a last
    batch of 3 rows, plus a probe batch."""
    out = random_batches(PS_SPEC, steps, batch, seed=6)
    out += [random_batches(PS_SPEC, 1, 2, seed=7)[0], random_batches(PS_SPEC, 1, 3, seed=8)[0]]
    return out, random_batches(PS_SPEC, 1, 16, seed=99)[0][0]

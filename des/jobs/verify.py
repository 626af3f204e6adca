"""Equivalence checking: train a model for some steps and snapshot what it learned, then
compare a DES model (any N, real or simulated world) with the untouched model.

    >>> import models
    >>> spec = small_spec(n_fields=3, dim=4)
    >>> batches, probe = random_batches(spec, steps=3, batch=16), random_batches(spec, 1, 8, seed=9)[0][0]
    >>> build = lambda: models.deepfm(spec, hidden=(8,), seed=1)
    >>> ref = train_and_snapshot(build(), "adam", 1e-3, batches, probe)
    >>> outs = run_in_process_world(2, build, lambda m: train_and_snapshot(m, "adam", 1e-3, batches, probe))
    >>> diff = compare(ref, outs)          # max abs diff of predictions, rows and weights
    >>> sorted(diff), max(diff.values()) < 1e-5
    (['owned', 'predictions', 'tables', 'weights'], True)

Snapshots (des.runtime.state) key tables and weights by their place in the original graph, so a
reference built separately from the same code lines up with every process's share.
"""
from __future__ import annotations

import threading
import traceback
from typing import Callable

import numpy as np
import tensorflow as tf

from des.baselines.ps.tables import KeyExchange
import des
from des.graph.ir import Graph
from des.compiler.keys import create_slots, state_keys
from des.runtime.state import snapshot as state_snapshot
from des_ops.comm import InProcessWorld
from des_ops.serial_tracing import running_as
from models.optim import make_optimizer
from models.spec import PAD_ID, FeatureSpec, Field


def table_layers(model: tf.keras.Model) -> list:
    """The dynamic (TFRA) table layers of a model: for a DES model, those this process owns."""
    return [layer for layer, src in state_keys(model).tables.values() if src.dynamic]


def snapshot(model: tf.keras.Model) -> dict:
    """What the model learned, keyed alike on every process and in every build (des.runtime.state)."""
    return state_snapshot(model)


def copy_state(src: tf.keras.Model, dst: tf.keras.Model) -> None:
    """Give ``dst`` (another build of the same model code) the weights and table rows of ``src``."""
    a, b = Graph(src), Graph(dst)
    done = set()
    for na, nb in zip(a.nodes, b.nodes):
        if id(na.layer) in done or na.kind == "input":
            continue
        done.add(id(na.layer))
        if na.kind == "table" and na.attrs["source"].dynamic:
            nb.attrs["source"].load(nb.layer, *na.attrs["source"].export(na.layer))
        else:
            for wa, wb in zip(na.layer.weights, nb.layer.weights):
                wb.assign(wa)


def optimizer_factory(name: str, learning_rates: dict[str, float]) -> Callable:
    """``"adam"``, or ``"ftrl+adam"``: FTRL on the linear part, Adam on the rest."""
    if "+" in name:
        linear, rest = name.split("+")
        return lambda: make_optimizer(rest, learning_rates[rest], linear=linear,
                                      linear_learning_rate=learning_rates[linear])
    return lambda: make_optimizer(name, learning_rates[name])


def train_and_snapshot(model, optimizer, learning_rate: float | None, batches, probe) -> dict:
    """train_on_batch over ``batches``; predictions on ``probe`` after every step; final snapshot.

    ``optimizer``: a name for make_optimizer, or a function that makes the optimizer."""
    opt = optimizer() if callable(optimizer) else make_optimizer(optimizer, learning_rate)
    model.compile(opt, loss="binary_crossentropy")
    create_slots(model, opt)          # slots before the first step: one trace of the step, not two
    preds = []
    for x, y in batches:
        model.train_on_batch(x, y)
        preds.append(np.asarray(model.predict_on_batch(probe)))
    return {"predictions": np.stack(preds), **snapshot(model)}


def fit_and_snapshot(model, batches, probe, optimizer="adam", learning_rate: float = 0.02,
                     epochs: int = 1, shuffle_seed: int | None = None, shuffle_buffer: int | None = None) -> dict:
    """The user's loop: compile (``optimizer``: a models.optim name, made with ``learning_rate``, or a
    Keras optimizer) with an AUC metric and fit ``epochs`` epochs over the rows of
    ``batches``, batched as they are; in order, or with ``shuffle_seed`` through tf.data
    ``shuffle(shuffle_buffer or all rows, seed, reshuffle_each_iteration=True)`` (a new order
    every epoch, the same sequence of orders wherever the seeds are the same); then predictions on ``probe``,
    the fit's last AUC and loss, and the snapshot. A model with several outputs (multi-task, as
    MMoE) learns the same labels on each; its predictions are the outputs side by side, its AUC the
    first output's."""
    model.compile(make_optimizer(optimizer, learning_rate) if isinstance(optimizer, str) else optimizer,
                  "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(name="auc")])
    create_slots(model, model.optimizer)
    xs = {k: tf.concat([x[k] for x, _ in batches], 0) for k in batches[0][0]}
    ys = tf.concat([y for _, y in batches], 0)
    tasks = len(model.outputs)
    ds = tf.data.Dataset.from_tensor_slices((xs, ys if tasks == 1 else (ys,) * tasks))
    if shuffle_seed is not None:
        ds = ds.shuffle(shuffle_buffer or int(ys.shape[0]), seed=shuffle_seed, reshuffle_each_iteration=True)
    ds = ds.batch(int(batches[0][1].shape[0]))
    hist = model.fit(ds, epochs=epochs, verbose=0, shuffle=False).history
    predictions = model.predict_on_batch(probe)
    if tasks > 1:
        predictions = np.concatenate([np.asarray(p) for p in predictions], axis=1)
    auc = hist["auc" if tasks == 1 else f"{model.output_names[0]}_auc"][-1]
    return {"predictions": np.asarray(predictions), "auc": auc, "loss": hist["loss"][-1], **snapshot(model)}


def _maxdiff(a: np.ndarray, b: np.ndarray) -> float:
    """Max over elements of min(abs diff, relative diff)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    d = np.abs(a - b)
    return float(np.max(np.minimum(d, d / np.maximum(np.abs(b), 1e-30)))) if d.size else 0.0


def compare(ref: dict, ranks: list[dict]) -> dict[str, float]:
    """Max diffs (abs or relative, whichever is smaller) between the reference and all ranks.

    Every table row and every owned block (kernel rows of a field, a field chain's weights) must be
    held by exactly one rank (a block every rank holds whole, ``snap["whole"]``, by every rank; a
    table split by key range, each of its rows by one rank); every rank's predictions and
    replicated weights must match."""
    out = {"predictions": 0.0, "tables": 0.0, "owned": 0.0, "weights": 0.0}
    holder: dict = {}
    row_holder: dict = {}
    for r, snap in enumerate(ranks):
        out["predictions"] = max(out["predictions"], _maxdiff(snap["predictions"], ref["predictions"]))
        for k, rows in snap["tables"].items():
            held = row_holder.setdefault(k, {})
            twice = [key for key in rows if key in held]
            if twice:
                raise AssertionError(f"table {k}: {len(twice)} rows (key {twice[0]}) held by ranks {held[twice[0]]} "
                                     f"and {r}")
            held.update(dict.fromkeys(rows, r))
            holder[("table", k)] = r
            ref_rows = ref["tables"][k]
            if set(rows) - set(ref_rows):
                raise AssertionError(f"table {k} on rank {r}: {len(set(rows) - set(ref_rows))} keys the reference "
                                     f"does not have")
            for key, v in rows.items():
                out["tables"] = max(out["tables"], _maxdiff(v, ref_rows[key]))
        for k, v in snap["owned"].items():
            if ("owned", k) in holder and k not in snap.get("whole", ()):
                raise AssertionError(f"{k} held by ranks {holder[('owned', k)]} and {r}")
            holder[("owned", k)] = r
            out["owned"] = max(out["owned"], _maxdiff(v, ref["owned"][k]))
        if set(snap["weights"]) != set(ref["weights"]):
            raise AssertionError(f"rank {r} weights {sorted(snap['weights'])} != reference {sorted(ref['weights'])}")
        for k, v in snap["weights"].items():
            out["weights"] = max(out["weights"], _maxdiff(v, ref["weights"][k]))
    for k, held in row_holder.items():
        if set(held) != set(ref["tables"][k]):
            raise AssertionError(f"table {k}: the ranks hold {len(held)} keys, the reference {len(ref['tables'][k])}")
    missing = {("table", k) for k in ref["tables"]} | {("owned", k) for k in ref["owned"]}
    if missing - set(holder):
        raise AssertionError(f"held by no rank: {sorted(missing - set(holder))}")
    return out


def run_in_process_world(world_size: int, build: Callable[[], tf.keras.Model],
                         work: Callable[[tf.keras.Model], object], init_from: tf.keras.Model | None = None,
                         **transform_kwargs) -> list:
    """Build and transform ``build()`` once per simulated rank, rank 0 first (with ``init_from``,
    rank 0 takes its weights and rows; the other ranks start from their own random ones and
    get rank 0's by the transform's broadcast, which never waits on a later rank), then run
    ``work`` on every rank in its own thread."""
    world = InProcessWorld(world_size)
    des_models = []
    where = {k: transform_kwargs.pop(k) for k in ("spec", "sample") if k in transform_kwargs}   # des.transform's own
    options = des.Options(**transform_kwargs)
    for r in range(world_size):
        m = build()
        if r == 0 and init_from is not None:
            copy_state(init_from, m)
        des_models.append(des.transform(m, options, comm=world.communicator(r), **where)[0])
    return _on_every_rank(world, lambda r: work(des_models[r]))


def _on_every_rank(world: InProcessWorld, work: Callable[[int], object]) -> list:
    """``work(rank)`` for every rank of ``world``, each in its own thread; the first real error
    (not another rank's aborted wait) is raised with its traceback."""
    results: list = [None] * world.world_size
    errors: list = []

    def run(r):
        try:
            with running_as(world.tracing, r):     # one rank builds graphs at a time
                results[r] = work(r)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((r, e, traceback.format_exc()))
            world.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        r, e, tb = min(errors, key=lambda x: "another simulated rank failed" in x[2] or "Broken" in x[2])
        raise RuntimeError(f"simulated rank {r} failed: {e}\n{tb}")
    return results


def run_sharded_world(world_size: int, work: Callable[[object], object], wire_dtype: str = "float32") -> list:
    """The PS / cache modes in the simulated world: ``work(exchange)`` on every rank in its own
    thread, ``exchange`` a des.baselines.ps.tables.KeyExchange of an InProcessWorld (rows on the
    wire in ``wire_dtype``); returns each rank's result. Collectives meet by name (the table and
    the kind), so ranks may run them in any order.

        >>> outs = run_sharded_world(3, lambda ex: train(ps.shard(build(), ex), slices_of(ex.rank)))  # doctest: +SKIP
        >>> run_sharded_world(3, lambda ex: (ex.rank, ex.world_size))
        [(0, 3), (1, 3), (2, 3)]
    """
    world = InProcessWorld(world_size)
    return _on_every_rank(world, lambda r: work(KeyExchange(world.communicator(r), wire_dtype)))


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

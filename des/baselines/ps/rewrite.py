"""The parameter-server baseline (``--mode ps``): the same reference model, tables sharded by key.

    >>> import models
    >>> from models.optim import make_optimizer
    >>> from des.jobs.verify import random_batches, small_spec
    >>> spec = small_spec(n_fields=3, dim=4)
    >>> x, y = random_batches(spec, steps=1, batch=64)[0]
    >>> my_slice = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)   # this process's rows
    >>> exchange = KeyExchange()         # under mpirun: all processes; else a world of one
    >>> ps_model = shard(models.deepfm(spec, hidden=(8,)), exchange)     # every FieldEmbedding -> sharded
    >>> ps_model.compile(make_optimizer("adam"), "binary_crossentropy")
    >>> history = ps_model.fit(my_slice, verbose=0)
    >>> [type(l).__name__ for l in ps_model.layers if l.name.startswith("ps4_")]
    ['ShardedFieldEmbedding', 'ShardedFieldEmbedding', 'ShardedFieldEmbedding']

Data parallel: each process trains on its own slice of every global batch (readers'
``shard=``). Per step the sharded tables move ids, rows and gradient rows by all-to-all
(des.baselines.ps.tables) and ONE allreduce sums the dense gradients. Each process's loss is its
slice's mean loss times n_local / n_global (one scalar allreduce of the slice sizes), so the
summed gradients are those of the global batch's mean loss - the update the single-process
model makes on the whole batch, also when slices are uneven or empty.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

from des.baselines.ps.tables import (KeyExchange, ShardedFieldEmbedding, ShardedFusedTable, ShardedKeyedEmbedding,
                                    ShardedStaticEmbedding)
from des.compiler.fusion import fuse_model
from des.graph.ir import Graph, replay
from des.compiler.keys import trace_once
from des_ops.fused import fusion_groups, linear_partners
from des_ops.tail import batchwise
from des_ops.wire import ring_share


class PSModel(tf.keras.Model):
    """A functional model whose train_step allreduces dense gradients (sparse ones went by all-to-all)."""

    exchange: KeyExchange
    record_ids: int = 0   # hand the ids of the first K training steps to ``recorded`` (byte checks)
    ps_tables: list | None = None     # a fused model: (ids, weights, dim) of the tables it fuses
    table_pairs: tuple = ()           # an unfused model: (sharded table, the model's table it replaces)
    fused_lines: tuple = ()           # a fused model: one report line per fused table

    def use(self, exchange: KeyExchange, ps_tables: list | None = None, fused_lines=()) -> "PSModel":
        """Set by ``shard``: the exchange its steps sum over, and what fusing its tables said."""
        self.exchange, self.ps_tables, self.fused_lines = exchange, ps_tables, tuple(fused_lines)
        self.recorded: list[dict] = []
        return self

    def record_first_steps(self, k: int) -> None:
        """Keep the ids of the first ``k`` training steps in ``recorded`` (traffic_summary checks
        the measured bytes against the formula on them)."""
        self.record_ids = k

    def train_step(self, data):
        x, y = data[0], data[1]
        pred, _ = self.update(x, y)
        return self.compute_metrics(x, y, pred, None)

    def update(self, x, y) -> tuple[tf.Tensor, tf.Tensor]:
        """One step on this process's slice ``(x, y)`` of the global batch: its share of the global
        mean loss, sparse gradients to their owners, dense ones summed. Returns the predictions
        and the share (the processes' shares sum to the global batch's loss, penalties included)."""
        if self.record_ids:
            names = sorted({ids for ids, _, _ in table_inputs(self)})
            tf.py_function(lambda *ids: self._record(names, ids), [x[n] for n in names], [])
        n_local = tf.cast(tf.shape(tf.nest.flatten(y)[0])[0], tf.float32)
        n_global = self.exchange.sum_across(n_local[None], counter="control_bytes")[0]
        held = [layer for layer in self.layers if getattr(layer, "des_sharded_by_key", False)]
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            share = n_local / n_global
            loss = self.compute_loss(x, y, pred) * share
            # the penalty of the rows this process holds counts once, not in proportion to its slice
            penalties = [p for layer in held for p in layer.losses]
            if penalties:
                loss += tf.add_n(penalties) * (1.0 - share)
        variables = self.trainable_variables
        grads = tape.gradient(loss, variables)
        by_key = {w.ref() for layer in held for w in layer.trainable_weights}
        dense = [i for i, v in enumerate(variables) if not isinstance(v, de.TrainableWrapper) and v.ref() not in by_key]
        summed = self.allreduce_dense([grads[i] for i in dense], [variables[i] for i in dense])
        for i, g in zip(dense, summed):
            grads[i] = g
        self.optimizer.apply_gradients([(g, v) for g, v in zip(grads, variables) if g is not None])
        return pred, loss

    def allreduce_dense(self, grads: list, variables: list) -> list:
        """The dense gradients summed over processes in ONE allreduce (a missing one is zero)."""
        if not variables or self.exchange.world_size == 1:
            return grads
        parts = [tf.zeros_like(v) if g is None else tf.convert_to_tensor(g) for g, v in zip(grads, variables)]
        total = self.exchange.sum_across(tf.concat([tf.reshape(g, [-1]) for g in parts], 0))
        sizes = [int(np.prod(v.shape)) for v in variables]
        return [tf.reshape(g, v.shape) for g, v in zip(tf.split(total, sizes), variables)]


    def _record(self, names, ids) -> None:
        if len(self.recorded) < self.record_ids:
            self.recorded.append({n: t.numpy() for n, t in zip(names, ids)})


def shard(model: tf.keras.Model, exchange: KeyExchange, make_table=None, cls=PSModel,
          mode: str = "ps", fuse: bool = False, join_linear: bool = False, seed: int = 0) -> PSModel:
    """The same model with every FieldEmbedding replaced by a ShardedFieldEmbedding
    (or by ``make_table(old_layer)``, e.g. a cached one), and every TFRA Embedding of a user's
    model by a ShardedKeyedEmbedding (the rows its keyed table holds, from (table, key, ``seed``)
    as in des.transform), as a ``cls`` model. ``fuse``: the
    sharded tables of one width share one TFRA table per process (des.baselines.ps.tables.ShardedFusedTable):
    one set of all-to-alls per width and step instead of one per table; ``join_linear``: and a field's
    linear weight travels in its embedding's row (des_ops.fused: one exchange of ids for both)."""
    graph = Graph(model)
    embeds = [n for n in graph.nodes if n.kind == "table"]
    given, pairs = {}, []
    env = {t: graph.tensors[t] for t in graph.input_ids}
    why = refusal(graph, mode, keyed_too=not make_table)
    if why:
        raise ValueError(why)
    made: dict[int, tf.keras.layers.Layer] = {}        # a table called several times (shared): one sharded table
    for n in embeds:
        old = n.layer
        if id(old) in made:
            new = made[id(old)]
        elif n.attrs["source"].name == "Keras Embedding":
            new = ShardedStaticEmbedding(old, exchange, graph.layer_key(old))
        elif not getattr(old, "des_embedding", False) and not getattr(old, "des_squashed", False):
            n.attrs["source"].keyed(old, seed, graph.layer_key(old))    # rows from (table, key, seed), as DES's
            new = ShardedKeyedEmbedding(old, exchange, graph.layer_key(old))
        else:
            new = make_table(old) if make_table else ShardedFieldEmbedding(old.field, old.dim, exchange, old.seed,
                                                                              old.init_scale, linear=old.linear)
        args = tf.nest.map_structure(lambda t: env.get(id(t), t), n.call_args)
        out = new(*args, **n.call_kwargs)
        given[n.output] = lambda look, out=out: out
        if id(old) not in made:
            made[id(old)] = new
            pairs.append((new, old))
    ps = replay(graph, {n.index for n in embeds}, given, cls=cls, suffix=mode).use(exchange)
    object.__setattr__(ps, "table_pairs", tuple(pairs))     # not tracked: the model's own tables are not its weights
    if fuse:
        graph = Graph(ps)
        entries = [(n.layer, *names, n.attrs["dim"]) for n, names in _table_nodes(graph)]
        fused, lines = fuse_model(ps, join_linear=join_linear)
        ps = fused.use(exchange, joined_inputs(entries), lines)
        object.__setattr__(ps, "table_pairs", tuple(pairs))    # the sharded tables read their rows in the fused ones
    return trace_once(ps)


def refusal(graph: Graph, mode: str = "ps", keyed_too: bool = True) -> str:
    """Why ``shard`` cannot shard the model of ``graph`` ("" if it can): every table must read model
    inputs directly and be a FieldEmbedding or (``keyed_too``) a TFRA Embedding, and no layer may
    compute over the batch (each process trains on its slice: des_ops.tail.batchwise)."""
    slices = batchwise(list(dict.fromkeys(n.layer for n in graph.nodes if n.kind not in ("input", "table"))))
    if slices:
        return f"each process of a PS trains on its slice of the batch, and {slices[0]}"
    for n in graph.nodes:
        if n.kind != "table":
            continue
        old = n.layer
        if any(graph.input_name(t) is None for t in n.tensor_operands()):
            return f"embedding {old.name!r} does not read model inputs directly"
        if type(old).__name__ == "SquashedEmbedding":     # TFRA's bag table: its lookup sums a sample's rows
            return (f"--mode {mode} shards a TFRA table's rows, not its combiner: {old.name!r} is a "
                    f"{type(old).__name__} (combiner {old.combiner!r})")
        keyed = keyed_too and n.attrs["source"].name == "TFRA Embedding" and not getattr(old, "des_squashed", False)
        static = keyed_too and n.attrs["source"].name == "Keras Embedding"
        if not getattr(old, "des_embedding", False) and not keyed and not static:
            return (f"--mode {mode} shards FieldEmbedding, TFRA Embedding and Keras Embedding tables; {old.name!r} "
                    f"is a {n.attrs['source'].name}")
    return ""


def lookup_tables(model: tf.keras.Model) -> list:
    """The table layers a PS model looks up, each with its own all-to-alls (a fused model: one
    per width)."""
    return [layer for layer in model.layers if isinstance(layer, (ShardedFieldEmbedding, ShardedFusedTable))]


def dense_parameters(model: tf.keras.Model) -> int:
    """Floats in the dense (allreduced) trainable weights."""
    return int(sum(np.prod(v.shape) for v in model.trainable_variables
                   if not isinstance(v, de.TrainableWrapper)))


def analytic_bytes(feats: dict, tables: list[tuple[str, str | None, int]], rank: int, world_size: int,
                   dense_params: int, bytes_per_float: int = 4) -> dict[str, float]:
    """Bytes one process moves in one PS step, from its slice's ids (numpy), by the formulas:

    all-to-all: for each table, u = its distinct non-padding ids whose owner is another
    process: 8u (ids out) + b*dim*u (rows back) + b*dim*u (gradient rows out), b =
    ``bytes_per_float`` (4; 2 with float16 rows on the wire);
    dense: a ring allreduce of the 4*dense_params bytes of dense gradients sends 2(N-1)/N of it.
    ``tables``: (ids input name, weights input name or None, dim) per table. ``unique_floats``: the
    floats of the slice's distinct rows, summed over tables (what DES's rows exchange weighs,
    des.jobs.auto).
    """
    out = {"ids_bytes": 0, "rows_bytes": 0, "grad_bytes": 0, "unique_ids": 0, "remote_ids": 0, "unique_floats": 0}
    for name, _, dim in tables:
        ids = np.unique(np.asarray(feats[name]).reshape(-1))
        ids = ids[ids != -1]
        remote = int(np.sum(np.mod(ids, world_size) != rank)) if world_size > 1 else 0
        out["unique_ids"] += len(ids)
        out["unique_floats"] += dim * len(ids)
        out["remote_ids"] += remote
        out["ids_bytes"] += 8 * remote
        out["rows_bytes"] += bytes_per_float * dim * remote
        out["grad_bytes"] += bytes_per_float * dim * remote
    out["dense_bytes"] = 4 * dense_params if world_size > 1 else 0
    out["dense_ring_bytes"] = ring_share(world_size) * out["dense_bytes"]
    out["alltoall_bytes"] = out["ids_bytes"] + out["rows_bytes"] + out["grad_bytes"]
    return out


def table_inputs(model: tf.keras.Model, join_linear: bool = False) -> list[tuple[str, str | None, int]]:
    """(ids input, weights input or None, dim) of every sharded table of a PS model (of a fused one:
    of its lookups, see ``joined_inputs``). ``join_linear``: of an untouched model, as the PS would
    look its tables up with joined rows (a linear weight and an embedding read with the same inputs
    are one lookup)."""
    if isinstance(model, PSModel) and model.ps_tables is not None:
        return model.ps_tables
    graph = Graph(model)
    nodes = _table_nodes(graph)
    partner = {}
    if join_linear:
        partner = linear_partners([n for group in fusion_groups([n for n, _ in nodes], True).values() for n in group])
    out: dict[tuple, dict] = {}
    for k, (n, names) in enumerate(nodes):
        other = partner.get(id(n.layer))
        key = (min(id(n.layer), id(other)), names) if other is not None else (k,)
        out.setdefault(key, {"names": names, "widths": {}})["widths"][id(n.layer)] = n.attrs["dim"]
    return [(*v["names"], sum(v["widths"].values())) for v in out.values()]


def _table_nodes(graph: Graph) -> list[tuple]:
    """(node, (ids input, weights input or None)) of every table node of ``graph``."""
    out = []
    for n in graph.nodes:
        if n.kind == "table":
            names = [graph.input_name(t) for t in n.tensor_operands()]
            out.append((n, (names[0], names[1] if len(names) > 1 else None)))
    return out


def joined_inputs(entries: list[tuple]) -> list[tuple]:
    """(ids, weights, width) per lookup of a fused model, from ``entries`` (layer, ids, weights, width)
    of the per-field tables it fused: the tables whose rows share one key (a joined embedding and
    linear weight, des_ops.fused) count as ONE lookup, their ids travel once and their rows are
    the widths together."""
    out: dict[tuple, tuple] = {}
    for k, (layer, ids, weights, width) in enumerate(entries):
        fused = getattr(layer, "des_fused", None)    # (fused table, member): its rows travel table.dim wide
        key = (id(fused[0]), fused[0].slot_of(fused[1]), ids, weights) if fused else (k,)
        out.setdefault(key, (ids, weights, fused[0].dim if fused else width))
    return list(out.values())


def traffic_summary(model: PSModel, steps: list[dict], rank: int, n: int) -> dict:
    """Medians of the PS counters per step, and the analytic bytes of the first steps (by the
    formulas, in numpy, from the ids those steps trained on) compared with what was measured.

    Measured: the all-to-all bytes of this process's lookups (ids out, rows in, gradient rows out:
    segments handed to / returned by all-to-all for other processes) and the allreduce payloads;
    per destination in ``per_destination``. Analytic: ``analytic_bytes`` and the ring model
    2(N-1)/N of the allreduce payload (what MPI puts on the wire depends on its algorithm)."""
    ring = ring_share(n)
    sent = [s["ids_bytes"] + s["rows_bytes"] + s["grad_bytes"] + ring * (s["dense_bytes"] + s["control_bytes"])
            for s in steps]
    tables, dense = table_inputs(model), dense_parameters(model)
    exact, analytic = 0, []
    for ids, s in zip(model.recorded, steps):
        an = analytic_bytes(ids, tables, rank, n, dense, model.exchange.wire_dtype.size)
        an_sent = an["alltoall_bytes"] + an["dense_ring_bytes"] + (ring * 4 if n > 1 else 0)
        analytic.append(an_sent)
        exact += all(s[k] == an[k] for k in ("ids_bytes", "rows_bytes", "grad_bytes", "dense_bytes"))
    med = lambda v: float(np.median(v)) if len(v) else 0.0
    return {"sent_bytes_per_step": med(sent), "analytic_sent_bytes_per_step": med(analytic),
            "alltoall_bytes_per_step": med([s["ids_bytes"] + s["rows_bytes"] + s["grad_bytes"] for s in steps]),
            "allreduce_payload_bytes_per_step": med([s["dense_bytes"] + s["control_bytes"] for s in steps]),
            "dense_ring_bytes_per_step": med([ring * (s["dense_bytes"] + s["control_bytes"]) for s in steps]),
            "unique_ids_per_step": med([s["unique_ids"] for s in steps]),
            "remote_ids_per_step": med([s["remote_ids"] for s in steps]),
            "bytes_exact_steps": f"{exact}/{len(analytic)}", **per_destination(steps, rank, n)}


def per_destination(steps: list[dict], rank: int, n: int) -> dict:
    """Bytes per step (mean over steps) handed to all-to-all for each process (``alltoall_sent_to``,
    all kinds together) and received from each (``alltoall_received_from``), measured where the
    collective is called; entry ``rank`` is the self-send, which never leaves the process."""
    def mean(side):
        per_step = [np.sum([s[f"{side}_{k}"] for k in KeyExchange.KINDS], 0) for s in steps]
        return np.mean(per_step, 0) if per_step else np.zeros(n)
    sent, received = mean("sent"), mean("received")
    return {"alltoall_sent_to": sent.tolist(), "alltoall_received_from": received.tolist(),
            "self_bytes_per_step": float(sent[rank]),
            "wire_out_bytes_per_step": float(sent.sum() - sent[rank]),
            "wire_in_bytes_per_step": float(received.sum() - received[rank])}


def aggregate_metrics(model: tf.keras.Model, exchange: KeyExchange) -> dict[str, float]:
    """After ``evaluate`` on each process's slice: sum every metric's state over processes
    (AUC confusion counts, means' totals and counts), so the results are the global ones."""
    out = {}
    for m in model.metrics:
        for v in m.variables:
            v.assign(exchange.sum_across(tf.convert_to_tensor(v), counter="metrics_bytes"))
        r = m.result()
        if isinstance(r, dict):
            out.update({k: float(x) for k, x in r.items()})
        else:
            out[m.name] = float(r)
    return out

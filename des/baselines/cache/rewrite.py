"""The HET embedding-cache mode (``--mode cache``): the PS mode's key-sharded tables, read through a
bounded cache with bounded staleness on every worker (protocol: des.baselines.cache.tables).

    >>> import models
    >>> from models.optim import make_optimizer
    >>> from des.jobs.verify import random_batches, small_spec
    >>> spec = small_spec(n_fields=3, dim=4)
    >>> x, y = random_batches(spec, steps=1, batch=64)[0]
    >>> my_slice = tf.data.Dataset.from_tensor_slices((x, y)).batch(16)   # this process's rows
    >>> exchange = KeyExchange()         # under mpirun: all processes; else a world of one
    >>> model = cache(models.deepfm(spec, hidden=(8,)), exchange, staleness=10, capacity=0.1, spec=spec)
    >>> model.compile(make_optimizer("sgd"), "binary_crossentropy")
    >>> history = model.fit(my_slice, verbose=0)
    >>> model.flush()        # push every pending update (fit does it at each epoch's end)
    >>> [(type(layer).__name__, ids) for layer, ids in model.cached_tables()][:2]
    [('CachedFieldEmbedding', 'f0'), ('CachedFieldEmbedding', 'f1')]

Data parallel like the PS mode: each process trains on its slice of every global batch, the
dense gradients go in one allreduce, and the loss is weighted by n_local / n_global.
"""
from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

from des.baselines.allocate import EVICT, OTHERS
from des.baselines.cache.tables import CacheConfig, CachedFieldEmbedding, CachedFusedTable, new_counters
from des.baselines.ps.rewrite import PSModel, per_destination, shard
from des.baselines.ps.tables import KeyExchange
from des.graph.ir import Graph
from des_ops.keras_internals import plain_sgd_learning_rate
from des_ops.wire import ring_share
from models.optim import LinearAndRestOptimizer, is_linear


class CacheModel(PSModel):
    """A PS model whose training lookups go through the cached tables' fetch/accumulate/push."""

    def find_cached_tables(self) -> None:
        """Note which input feeds which cached table (called once by ``cache``; tuples of names,
        which Keras does not track)."""
        graph = Graph(self)
        cached = []
        for n in graph.nodes:
            if isinstance(n.layer, CachedFusedTable):     # a name, or (ids, weights) names, per member call
                name = lambda t: graph.input_name(id(t))   # noqa: E731
                names = tuple(tuple(map(name, x)) if isinstance(x, (list, tuple)) else name(x)
                              for x in n.call_args[0])
                cached.append((n.layer.name, names))
            elif isinstance(n.layer, CachedFieldEmbedding):
                cached.append((n.layer.name, graph.input_name(n.tensor_operands()[0])))
        self._cached = tuple(cached)

    def cached_tables(self) -> list[tuple[CachedFieldEmbedding | CachedFusedTable, str | tuple]]:
        """(layer, its ids input's name) of every cached table, in graph order; a fused table:
        (layer, per member call the ids input's name or the (ids, weights) inputs' names)."""
        return [(self.get_layer(name), ids) for name, ids in self._cached]

    def _set_local_lr(self) -> None:
        """HET applies plain SGD on the worker too: give SGD's learning rate to the tables it trains."""
        for layer, _ in self.cached_tables():
            opt = self.optimizer
            if isinstance(opt, LinearAndRestOptimizer):
                opt = opt.linear if is_linear(layer.shadow) else opt.rest
            layer.local_lr = plain_sgd_learning_rate(opt)

    def train_step(self, data):
        x, y = dict(data[0]), data[1]
        others = {k[:-len(OTHERS)]: x.pop(k) for k in list(x) if k.endswith(OTHERS)}
        evict = {k[:-len(EVICT)]: x.pop(k) for k in list(x) if k.endswith(EVICT)}    # laia's simulated caches
        self._set_local_lr()
        tables = self.cached_tables()
        n_local = tf.cast(tf.shape(y)[0], tf.float32)
        n_global = self.exchange.sum_across(n_local[None], counter="control_bytes")[0]
        step = self.optimizer.iterations
        planned = []                 # plan pushes: updates other processes read this step reach their owners first
        for layer, ids in tables:
            if layer.config.plan_pushes:
                if layer.local_lr is None:
                    raise ValueError("plan pushes keep updates in the workers' lines: they need plain SGD "
                                     "(--optimizer sgd, no momentum)")
                if ids not in others:
                    raise ValueError(f"plan pushes need the keys other processes use ({ids}{OTHERS})")
                planned.append(layer.apply_pushed(*layer.push(*layer.planned(others[ids]))))
        with tf.control_dependencies(planned):
            feeds = [layer.fetch(tf.nest.map_structure(x.get, ids), step) for layer, ids in tables]
        with tf.GradientTape() as tape:
            tape.watch(feeds)
            for (layer, _), feed in zip(tables, feeds):
                layer.lines.feed = feed
            try:
                pred = self(x, training=True)
            finally:
                for layer, _ in tables:
                    layer.lines.feed = None
            loss = self.compute_loss(x, y, pred) * (n_local / n_global)
        dense = [v for v in self.trainable_variables if not isinstance(v, de.TrainableWrapper)]
        grads = tape.gradient(loss, feeds + dense)
        g_dense = self.allreduce_dense(grads[len(feeds):], dense)
        pushes = [(layer, layer.push(*layer.accumulate(g, evict.get(ids))))
                  for (layer, ids), g in zip(tables, grads[:len(feeds)])]
        marks = []
        for (layer, ids), (_, (keys, _)) in zip(tables, pushes):
            if layer.config.on_demand:      # lines of keys the other processes update this step
                if ids not in others:
                    raise ValueError(f"the on-demand plan needs the keys other processes use ({ids}{OTHERS}): "
                                     f"read the data through des.baselines.allocate.Share(..., others=True)")
                with tf.control_dependencies([keys]):
                    marks.append(layer.mark_updated(others[ids]))
        with tf.control_dependencies(marks):
            self.optimizer.apply_gradients(list(zip(g_dense, dense)) + self._owner_gradients(pushes))
        return self.compute_metrics(x, y, pred, None)

    @staticmethod
    def _owner_gradients(pushes) -> list:
        """The owner applies its optimizer to the pushed sums: d/d(row) of sum(row * pushed) is
        the pushed sum, so the optimizer's own sparse update (and slots) of TFRA does the rest."""
        with tf.GradientTape() as tape:
            terms = [tf.reduce_sum(de.shadow_ops.embedding_lookup(layer.shadow, keys) * tf.stop_gradient(sums))
                     for layer, (keys, sums) in pushes]
            total = tf.add_n(terms)
        shadows = [layer.shadow for layer, _ in pushes]
        return list(zip(tape.gradient(total, shadows), shadows))

    def flush(self, clear: bool = False) -> None:
        """A sync point: every worker pushes every pending update and the owners apply them.
        Collective (every process calls it); not a training step (optimizer steps unchanged).
        ``clear``: the caches are emptied too (a new laia allocator starts with empty caches)."""
        self._set_local_lr()
        if not hasattr(self, "_flush_fns"):
            self._flush_fns = {}
        if clear not in self._flush_fns:
            def run():
                pushes = [(layer, layer.push(*layer.pending(clear))) for layer, _ in self.cached_tables()]
                self.optimizer.apply_gradients(self._owner_gradients(pushes))
            # plain graph code (no Python control flow on tensors): autograph's conversion of the
            # optimizer's apply_gradients cost ~15 s a process at the first flush
            self._flush_fns[clear] = tf.function(run, autograph=False)
        steps = [(v, v.numpy()) for v in _iteration_variables(self.optimizer)]
        self._flush_fns[clear]()
        for v, n in steps:
            v.assign(n)

    def cache_counters(self) -> dict[str, int]:
        tables = self.cached_tables()
        return {k: int(v.numpy()) for k, v in tables[0][0].counters.items()} if tables else {}


def _iteration_variables(optimizer) -> list:
    out = [optimizer.iterations]
    for part in ("linear", "rest"):
        if hasattr(optimizer, part):
            out.append(getattr(optimizer, part).iterations)
    return out


def capacity_rows(capacity: int | float, cardinality: int | None, field: str) -> int:
    """``capacity``: rows (an int) or a fraction in (0, 1] (a float) of the field's cardinality."""
    if isinstance(capacity, int):
        return capacity
    if not cardinality:
        raise ValueError(f"--cache-size {capacity:g} is a fraction of a field's rows, but field {field!r} has no "
                         f"known cardinality (give the cache size in rows)")
    return max(1, int(math.ceil(capacity * cardinality)))


def cache(model: tf.keras.Model, exchange: KeyExchange, staleness: float = 100.0, capacity: int | float = 0.1,
          eviction: str = "lru", spec=None, audit: bool = False, on_demand: bool = False,
          plan_pushes: bool = False, fuse: bool = False) -> CacheModel:
    """The same model with every FieldEmbedding sharded by key and cached on every worker.
    ``fuse``: the cached tables of one width share one TFRA table and one cache per process
    (des.baselines.cache.tables.CachedFusedTable; its capacity is theirs together).
    ``on_demand`` (staleness 0): no queries; the data must come through
    ``des.baselines.allocate.Share(allocator, rank, others=True)``. ``plan_pushes`` (with ``on_demand``,
    plain SGD): an update is pushed only when another process reads its key (Herald's plan)."""
    counters = new_counters()

    def make(old):
        card = spec[old.field].cardinality if spec is not None else None
        cfg = CacheConfig(staleness=float(staleness), capacity=capacity_rows(capacity, card, old.field),
                          eviction=eviction, audit=audit, on_demand=on_demand, plan_pushes=plan_pushes)
        return CachedFieldEmbedding(old.field, old.dim, exchange, cfg, old.seed, old.init_scale,
                                    linear=old.linear, counters=counters)

    out = shard(model, exchange, make_table=make, cls=CacheModel, mode="cache", fuse=fuse)
    out.find_cached_tables()
    return out


def parse_staleness(text: str) -> float:
    """``--staleness``: a count of updates, or ``inf`` (never re-read: asynchronous)."""
    value = float(text)
    if value < 0 or (value != math.inf and value != int(value)):
        raise ValueError(f"--staleness must be a whole number of updates >= 0 or inf, got {text!r}")
    return value


def parse_cache_size(text: str) -> int | float:
    """``--cache-size``: rows per table (an integer, e.g. 5000: an int) or a fraction of each
    field's cardinality (0.1 or 10%: a float in (0, 1]; 100% is every row, not one row)."""
    try:
        if text.endswith("%"):
            value = float(text[:-1]) / 100
            if 0 < value <= 1:
                return value
        elif float(text) >= 1 and float(text) == int(float(text)):
            return int(float(text))
        elif 0 < float(text) < 1:
            return float(text)
    except ValueError:
        pass
    raise ValueError(f"--cache-size must be rows (an integer >= 1), a fraction in (0, 1) or a percentage "
                     f"up to 100%, got {text!r}")


def traffic_summary(steps: list[dict], rank: int, n: int) -> dict:
    """Medians per step of the cache counters (deltas), bytes measured from the tensors handed to
    all-to-all (what leaves this process) vs the analytic count, per destination
    (``ps.per_destination``), hit rates and HET's rows-moved-per-lookup. The dense allreduce's
    wire bytes are the ring model 2(N-1)/N of its measured payload (analytic)."""
    ring = ring_share(n)
    med = lambda v: float(np.median(v)) if len(v) else 0.0
    a2a = [s["query_bytes"] + s["clock_bytes"] + s["fetch_bytes"] + s["push_bytes"] for s in steps]
    exact = sum(s["query_bytes"] + s["clock_bytes"] + s["fetch_bytes"] + s["push_bytes"] == s["analytic_bytes"]
                for s in steps)
    tot = lambda k: sum(s[k] for s in steps)
    return {"alltoall_bytes_per_step": med(a2a),
            "sent_bytes_per_step": med([b + ring * (s.get("dense_bytes", 0) + s.get("control_bytes", 0))
                                        for b, s in zip(a2a, steps)]),
            "analytic_alltoall_bytes_per_step": med([s["analytic_bytes"] for s in steps]),
            "bytes_exact_steps": f"{exact}/{len(steps)}",
            **{f"{k}_per_step": med([s[k] for s in steps]) for k in ("query_bytes", "clock_bytes", "fetch_bytes", "push_bytes")},
            "rows_fetched_per_step": med([s["fetched"] for s in steps]),
            "rows_pushed_per_step": med([s["pushed"] for s in steps]),
            "remote_lookups_per_step": med([s["queried"] for s in steps]),
            "het_rows_per_lookup": (tot("fetched") + tot("pushed")) / max(1, tot("queried")),
            "hit_rate": tot("hits") / max(1, tot("queried")),
            "hit_rate_after_fill": (tot("hits_after_fill") / tot("queried_after_fill")
                                    if tot("queried_after_fill") else None),
            "evicted": tot("evicted"),
            "evicted_unplanned": tot("evicted_unplanned"),
            "allreduce_payload_bytes_per_step": med([s.get("dense_bytes", 0) + s.get("control_bytes", 0) for s in steps]),
            **per_destination(steps, rank, n)}

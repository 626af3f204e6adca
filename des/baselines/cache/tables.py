"""The HET embedding cache (``--mode cache``): key-sharded tables plus, on every worker, a bounded
cache of other processes' rows read while they are at most ``staleness`` updates behind.

HET (Miao et al., VLDB 2022) in this project's terms. The owner of key k (k mod N, as in the
PS mode) keeps the row, its optimizer slots and a clock Ko(k): how many updates (one per worker
and step that touched k) it has applied. A worker's cache line for a key another process owns
holds the row, the clock c of the owner updates the row contains, the gradients it has not
pushed yet (sum and count), and the last step / number of steps it was used (LRU / LFU). Per
training step, per table, with a fixed number of all-to-alls (never one per id):

  1. query: the worker sends every remote id of its slice with c (-1: not cached) to the owner
     (12 B: id + clock); the owner answers Ko (4 B) and, for each id with Ko - c > s or not
     cached, the row (4*dim B). A read therefore never lacks more than s of the owner's updates.
  2. forward/backward on the rows (own keys: read from the own table, never cached);
  3. push: the gradient of a cached row is added to its line; a line is pushed (id, count, sum:
     12 + 4*dim B) when it has max(s, 1) updates, when it is evicted (cache over capacity after
     the step: least recently / least frequently used lines first, or the lines an allocation
     that simulates the caches names - des.baselines.allocate's laia) and at flushes (epoch end,
     evaluation, checkpoint). The owner adds the counts to Ko and applies the optimizer to the
     pushed sums (the slots stay with the owner).

With plain SGD the worker also applies its updates to its cached rows, as HET does (then c
counts its own pushed updates); with other optimizers a cached row is a read replica and the
worker's own updates reach it through the owner. s = 0 pushes every update and re-reads every
row that changed: the PS mode, hence the single-process model, exactly. s = inf never
re-reads a cached row (pushes at eviction and flushes only): the asynchronous limit.

    >>> cfg = CacheConfig(staleness=10, capacity=1000, eviction="lru")
    >>> emb = CachedFieldEmbedding("C1", 8, KeyExchange(), cfg, seed=0)
    >>> emb(tf.constant([12345, 7], tf.int64)).shape        # inference: the owners' rows, as the PS reads
    TensorShape([2, 8])

Clocks and counts are float32 in the tables (exact up to 2^24 updates per key).
"""
from __future__ import annotations

import dataclasses
import math

import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

from des.baselines.ps.tables import KeyExchange, ShardedFieldEmbedding, ShardedFusedTable
from des_ops.fused import FUSED_CLASS
from models.spec import PAD_ID


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """staleness: s (``math.inf``: never re-read); capacity: cached rows per table and worker;
    eviction: ``lru`` or ``lfu``; audit: keep per-key totals of computed and applied gradients;
    on_demand: staleness 0 without queries - the train step says which keys the other processes
    update (``mark_updated``), so only rows lacking or outdated are asked for; plan_pushes (with
    on_demand, plain SGD): Herald's plan - an update stays in its line until another process
    reads the key (``planned``, at the start of that step), or the line is evicted or flushed."""
    staleness: float = 100.0
    capacity: int = 1 << 30
    eviction: str = "lru"
    audit: bool = False
    on_demand: bool = False
    plan_pushes: bool = False

    def __post_init__(self):
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"eviction must be lru or lfu, got {self.eviction!r}")
        if self.staleness < 0 or self.capacity < 0:
            raise ValueError("staleness and capacity must be >= 0")
        if self.on_demand and self.staleness != 0:
            raise ValueError(f"the on-demand plan is exact synchronous training: it needs staleness 0, got {self.staleness:g}")
        if self.plan_pushes and not self.on_demand:
            raise ValueError("plan pushes are part of the on-demand plan: they need on_demand (staleness 0)")

    @property
    def push_after(self) -> float:
        """A line is pushed once it holds this many updates (inf: only at eviction and flush, or,
        with plan pushes, when another process reads the key)."""
        return math.inf if self.plan_pushes else max(self.staleness, 1.0)


CACHE_COUNTERS = ("query_bytes", "clock_bytes", "fetch_bytes", "push_bytes", "analytic_bytes", "queried",
                  "fetched", "pushed", "hits", "queried_after_fill", "hits_after_fill", "evicted", "evicted_unplanned",
                  "over_capacity", "max_read_gap")


def new_counters() -> dict[str, tf.Variable]:
    """The int64 counters every cached table of a model adds to (kept off the Keras model)."""
    return {n: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"cache_{n}") for n in CACHE_COUNTERS}


def _to_f32(keys: tf.Tensor) -> tf.Tensor:
    """int64 [n] -> float32 [n, 2] with the same bits (ids ride in float tensors, exactly)."""
    return tf.reshape(tf.bitcast(keys, tf.float32), [-1, 2])


def _to_i64(bits: tf.Tensor) -> tf.Tensor:
    return tf.bitcast(tf.reshape(bits, [-1, 2]), tf.int64)


def _mask(mask: tf.Tensor, *tensors: tf.Tensor):
    """tf.boolean_mask of several tensors by one mask (one index computation; cheaper to trace)."""
    where = tf.reshape(tf.where(mask), [-1])
    return [tf.gather(t, where) for t in tensors]


def _size(table) -> tf.Tensor:
    """Rows in a TFRA table (de.Variable.size() keeps its op from the first graph it was traced in)."""
    return tf.add_n([t.size() for t in table.tables])


class _Lines:
    """A worker's cache of one table (not tracked by Keras: it is not model state).

    One TFRA table, key -> [row (dim) | clock | pending sum (dim) | pending count | last used | uses]."""

    def __init__(self, name: str, dim: int, audit: bool):
        self.dim = dim
        self.width = 2 * dim + 4
        self.table = de.Variable(key_dtype=tf.int64, value_dtype=tf.float32, dim=self.width,
                                 initializer=0.0, trainable=False, name=f"{name}_cache")
        self.clock = de.Variable(key_dtype=tf.int64, value_dtype=tf.float32, dim=1,
                                 initializer=0.0, trainable=False, name=f"{name}_clock")   # the owner's Ko
        self.audit = audit
        if audit:
            self.computed = de.Variable(key_dtype=tf.int64, value_dtype=tf.float32, dim=dim + 1,
                                        initializer=0.0, trainable=False, name=f"{name}_computed")
            self.applied = de.Variable(key_dtype=tf.int64, value_dtype=tf.float32, dim=dim + 1,
                                       initializer=0.0, trainable=False, name=f"{name}_applied")
        self.filled = tf.Variable(False, trainable=False, name=f"{name}_filled")  # reached capacity once
        self.feed = None          # (rows of the slice's distinct ids) while a train step is traced
        self.step_state = None    # what the forward half of a step hands to its push half

    def parts(self, lines):
        """row [n, dim], clock [n], pending sum [n, dim], pending count [n], last used [n], uses [n]."""
        d = self.dim
        row, clock, pend, count, used, uses = tf.split(tf.reshape(lines, [-1, self.width]), [d, 1, d, 1, 1, 1], 1)
        return row, tf.reshape(clock, [-1]), pend, tf.reshape(count, [-1]), tf.reshape(used, [-1]), tf.reshape(uses, [-1])

    @staticmethod
    def join(row, clock, pend, count, used, uses):
        return tf.concat([row, tf.expand_dims(clock, 1), pend, tf.expand_dims(count, 1), tf.expand_dims(used, 1), tf.expand_dims(uses, 1)], 1)


class CacheProtocol:
    """The cache's side of a sharded table (see the module docstring): a mixin for
    ShardedFieldEmbedding (one field) and ShardedFusedTable (the fields of one width), which
    differ in how a step's keys are made (``fetch``) and whose process owns a key (``owner_of``)."""

    def _start_cache(self, config: CacheConfig, counters: dict | None) -> None:
        self.config = config
        self.lines = _Lines(self.name, self.dim, config.audit)
        self.lines.counters = counters if counters is not None else new_counters()
        self.local_lr = None      # set by the model: plain SGD's learning rate (HET's local update)

    @property
    def counters(self) -> dict:
        return self.lines.counters

    def owner_of(self, keys: tf.Tensor) -> tf.Tensor:
        """The process that owns each key (id mod N)."""
        return self.exchange.owner(keys)

    def distinct_rows(self, uniq, training, multi_valued, counts=None):
        """In a training step, the rows ``fetch`` read (for the same tf.unique of the same ids);
        otherwise the owners' rows, as the PS mode reads them."""
        if self.lines.feed is None:
            return super().distinct_rows(uniq, training, multi_valued, counts)
        return self.lines.feed

    # ---- helpers -------------------------------------------------------------------------------
    def _add(self, name: str, value) -> tf.Operation:
        return self.counters[name].assign_add(tf.cast(value, tf.int64))

    def _max(self, name: str, value) -> tf.Operation:
        v = self.counters[name]
        return v.assign(tf.maximum(v, tf.cast(value, tf.int64)))

    def _alltoall(self, x: tf.Tensor, splits: tf.Tensor, counter: str):
        """all-to-all of ``x`` (rows grouped by destination, ``splits`` per destination), counted by
        the exchange per destination; ``counter`` gets the bytes that leave this process."""
        return self.exchange.alltoall(x, splits, counter.replace("_bytes", ""), add_sent=self.counters[counter],
                                      tag=self.tag)

    def _owner_rows(self, keys: tf.Tensor) -> tf.Tensor:
        """The owner's rows of ``keys`` (distinct), inserting missing ones with their start rows (``new_rows``)."""
        values, exists = self.params.lookup(keys, return_exists=True)
        init = self.new_rows(keys)
        missing = tf.logical_not(exists)
        insert = self.params.upsert(*_mask(missing, keys, init))
        with tf.control_dependencies([insert]):
            return tf.where(tf.expand_dims(exists, 1), values, init)

    # ---- one training step ---------------------------------------------------------------------
    def fetch_keys(self, keys: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """Forward half of a step: the rows [distinct ``keys``, dim] (in the order of their
        tf.unique) this worker trains on (padding: zero), after querying owners and refreshing
        stale or missing cache lines."""
        ex, L = self.exchange, self.lines
        uniq, _ = tf.unique(keys)
        real = tf.where(uniq != PAD_ID)
        keys = tf.gather_nd(uniq, real)
        mine = self.owner_of(keys) == ex.rank
        own_pos, far_pos = tf.where(mine), tf.where(tf.logical_not(mine))
        own, far = tf.gather_nd(keys, own_pos), tf.gather_nd(keys, far_pos)

        lines, cached = L.table.lookup(far, return_exists=True)
        row, clock, pend, count, used, uses = L.parts(lines)
        ask = self._ask_on_demand if self.config.on_demand else self._query
        fresh, got, clock, sent, gap_served = ask(far, cached, clock, tf.shape(row, out_type=tf.int64))
        if self.local_lr is not None:      # the worker's own unpushed SGD updates stay in its row
            got = got - self.local_lr * pend
        row = tf.where(tf.expand_dims(fresh, 1), got, row)
        pend = tf.where(tf.expand_dims(cached, 1), pend, tf.zeros_like(pend))
        count = tf.where(cached, count, tf.zeros_like(count))
        step_f = tf.cast(step, tf.float32)
        used = tf.fill(tf.shape(used), step_f)
        uses = tf.where(cached, uses, tf.zeros_like(uses)) + 1.0
        hits = tf.reduce_sum(tf.cast(tf.logical_and(cached, tf.logical_not(fresh)), tf.int64))
        filled = L.filled
        n_far = tf.size(far, out_type=tf.int64)
        n_fresh = tf.reduce_sum(tf.cast(fresh, tf.int64))
        count_ops = [self._add("analytic_bytes", sent),
                     self._add("queried", n_far), self._add("fetched", n_fresh),
                     self._add("hits", hits), self._max("max_read_gap", gap_served),
                     self._add("queried_after_fill", tf.where(filled, n_far, 0)),
                     self._add("hits_after_fill", tf.where(filled, hits, 0))]
        with tf.control_dependencies(count_ops):
            upsert = L.table.upsert(far, L.join(row, clock, pend, count, used, uses))
        with tf.control_dependencies([upsert]):
            own_rows = self._owner_rows(own)
        n = tf.size(keys, out_type=tf.int64)
        rows = tf.scatter_nd(own_pos, own_rows, tf.stack([n, self.dim])) + \
            tf.scatter_nd(far_pos, row, tf.stack([n, self.dim]))
        L.step_state = dict(real=real, own=own, own_pos=own_pos, far=far, far_pos=far_pos,
                            lines=L.join(row, clock, pend, count, used, uses), step=step_f)
        return tf.scatter_nd(real, rows, tf.stack([tf.size(uniq, tf.int64), self.dim]))

    def _route(self, keys: tf.Tensor):
        """(order grouping ``keys`` by owner, rows per owner)."""
        owner = self.owner_of(keys)
        splits = tf.math.bincount(owner, minlength=self.exchange.world_size, maxlength=self.exchange.world_size,
                                  dtype=tf.int32)
        return tf.argsort(owner, stable=True), splits

    def _query(self, far, cached, clock, shape):
        """HET's read: every remote id goes to its owner with the cached line's clock (-1: not
        cached); the owner answers its clock and, for the ids whose copy lacks more than s
        updates, the row. Returns (fresh: a row came, rows [far, dim] (zero where none came),
        the lines' clocks, bytes this process sent, the largest gap of a copy served from cache)."""
        ex = self.exchange
        clock = tf.where(cached, clock, -tf.ones_like(clock))
        order, splits = self._route(far)
        query = tf.gather(tf.concat([_to_f32(far), tf.expand_dims(clock, 1)], 1), order)
        asked, asked_splits = self._alltoall(query, splits, "query_bytes")
        # the owner: its clock for every asked id, its row for the stale ones
        akey_bits, aclock = tf.split(tf.reshape(asked, [-1, 3]), [2, 1], 1)
        akeys, aclock = _to_i64(akey_bits), tf.reshape(aclock, [-1])
        ukeys, where = tf.unique(akeys)
        urows = tf.reshape(self._owner_rows(ukeys), [-1, self.dim])
        ko = tf.gather(tf.reshape(self.lines.clock.lookup(ukeys), [-1]), where)
        stale = self._stale(ko, aclock)
        gap_served = tf.reduce_max(tf.where(stale, 0.0, ko - aclock))
        source = tf.repeat(tf.range(ex.world_size), asked_splits)
        row_splits = tf.math.unsorted_segment_sum(tf.cast(stale, tf.int32), source, ex.world_size)
        ko_back, _ = self._alltoall(ko, asked_splits, "clock_bytes")
        rows_back, _ = self._alltoall(tf.gather(urows, _mask(stale, where)[0]), row_splits, "fetch_bytes")
        # the worker: the same staleness rule on the clocks it got back; fresh rows in query order
        ko_mine = tf.gather(ko_back, tf.math.invert_permutation(order))
        fresh = self._stale(ko_mine, clock)
        got = tf.scatter_nd(tf.where(tf.gather(fresh, order)), rows_back, shape)
        got = tf.gather(got, tf.math.invert_permutation(order))
        # what this process sends: its queries (12 B), and as owner a clock (4 B) per query and a row
        # (4*dim B) per stale one (it queries no id it owns, so nothing of this is a self-send)
        n_asked, n_stale = tf.size(akeys, out_type=tf.int64), tf.reduce_sum(tf.cast(stale, tf.int64))
        sent = 12 * tf.size(far, out_type=tf.int64) + 4 * n_asked + 4 * self.dim * n_stale
        return fresh, got, tf.where(fresh, ko_mine, clock), sent, gap_served

    def _ask_on_demand(self, far, cached, clock, shape):
        """The on-demand plan (staleness 0 with an allocation every process knows): the worker
        knows which of its lines another process updated (``mark_updated``: clock -1), so it asks
        only for the rows it lacks or holds outdated (8 B per id) and the owner sends just those
        rows; a valid line costs nothing. Returns what ``_query`` returns (gap: always 0)."""
        need = tf.logical_or(tf.logical_not(cached), clock < 0)
        want = _mask(need, far)[0]
        order, splits = self._route(want)
        asked, asked_splits = self._alltoall(tf.gather(_to_f32(want), order), splits, "query_bytes")
        ukeys, where = tf.unique(_to_i64(asked))
        urows = tf.reshape(self._owner_rows(ukeys), [-1, self.dim])
        rows_back, _ = self._alltoall(tf.gather(urows, where), asked_splits, "fetch_bytes")
        got = tf.scatter_nd(tf.where(need), tf.gather(rows_back, tf.math.invert_permutation(order)), shape)
        sent = 8 * tf.size(want, out_type=tf.int64) + 4 * self.dim * tf.size(where, out_type=tf.int64)
        return need, got, tf.zeros_like(clock), sent, tf.constant(0.0)

    def mark_updated(self, keys: tf.Tensor) -> tf.Operation:
        """On-demand plan: the cached lines of ``keys`` (updated by another process this step)
        become outdated (clock -1); the next read fetches them."""
        L = self.lines
        lines, cached = L.table.lookup(keys, return_exists=True)
        k, lines = _mask(cached, keys, lines)
        row, clock, pend, count, used, uses = L.parts(lines)
        return L.table.upsert(k, L.join(row, -tf.ones_like(clock), pend, count, used, uses))

    def _stale(self, ko: tf.Tensor, c: tf.Tensor) -> tf.Tensor:
        s = self.config.staleness
        if math.isinf(s):
            return c < 0
        return tf.logical_or(c < 0, ko - c > s)

    def accumulate(self, grad: tf.Tensor, evict: tf.Tensor | None = None):
        """Backward half: add the gradient of the step's rows [distinct ids, dim] to their lines,
        evict (``evict``: these keys - an allocation's plan -, then any line still over capacity,
        by the eviction rule) and return what to push: (keys, counts, gradient sums)."""
        L, cfg, st = self.lines, self.config, self.lines.step_state
        g = tf.gather_nd(grad, st["real"])
        g_own, g_far = tf.gather_nd(g, st["own_pos"]), tf.gather_nd(g, st["far_pos"])
        row, clock, pend, count, used, uses = L.parts(st["lines"])
        pend, count = pend + g_far, count + 1.0
        if self.local_lr is not None:
            row = row - self.local_lr * g_far
        push = count >= cfg.push_after
        keep = tf.logical_not(push)
        if self.local_lr is not None:      # the owner will hold these updates: the row counts them
            clock = tf.where(push, clock + count, clock)
        elif cfg.on_demand:                # the owner's optimizer changes the row: read it again
            clock = -tf.ones_like(clock)
        push_keys, push_count, push_sum = _mask(push, st["far"], count, pend)
        pend = tf.where(tf.expand_dims(keep, 1), pend, tf.zeros_like(pend))
        count = tf.where(keep, count, tf.zeros_like(count))
        audit = []
        if L.audit:
            audit.append(self._audit_add(L.computed, tf.concat([st["own"], st["far"]], 0),
                                         tf.concat([g_own, g_far], 0)))
        with tf.control_dependencies(audit):
            upsert = L.table.upsert(st["far"], L.join(row, clock, pend, count, used, uses))
        with tf.control_dependencies([upsert]):
            ev_keys, ev_count, ev_sum = self._evict(evict)
        keys = tf.concat([st["own"], push_keys, ev_keys], 0)
        counts = tf.concat([tf.ones_like(st["own"], tf.float32), push_count, ev_count], 0)
        sums = tf.concat([g_own, push_sum, ev_sum], 0)
        L.step_state = None
        return keys, counts, sums

    def _evict(self, planned: tf.Tensor | None = None):
        """Remove the lines of the ``planned`` keys, then the lines still over capacity (LRU:
        oldest use first; LFU: fewest uses, then oldest; counted as ``evicted_unplanned``);
        return the evicted lines' unpushed updates (keys, counts, sums)."""
        L, cfg, d = self.lines, self.config, self.dim
        first = []
        if planned is not None:
            lines, present = L.table.lookup(planned, return_exists=True)
            pk, lines = _mask(present, planned, lines)
            _, _, pend, count, _, _ = L.parts(lines)
            with tf.control_dependencies([L.table.remove(pk), self._add("evicted", tf.size(pk))]):
                first = [tuple(tf.identity(t) for t in _mask(count > 0, pk, count, pend))]
        with tf.control_dependencies([t for out in first for t in out]):
            excess = _size(L.table) - cfg.capacity

        def evict():
            keys, lines = L.table.export()
            _, _, pend, count, used, uses = L.parts(lines)
            used64 = tf.cast(used, tf.float64)
            score = -used64 if cfg.eviction == "lru" else -(tf.cast(uses, tf.float64) * 2.0 ** 32 + used64)
            _, victims = tf.math.top_k(score, k=tf.cast(excess, tf.int32))
            vk, vc, vs = tf.gather(keys, victims), tf.gather(count, victims), tf.gather(pend, victims)
            with tf.control_dependencies([L.table.remove(vk), self._add("evicted", tf.size(vk)),
                                          self._add("evicted_unplanned", tf.size(vk))]):
                return tuple(_mask(vc > 0, vk, vc, vs))

        def none():
            return tf.zeros([0], tf.int64), tf.zeros([0], tf.float32), tf.zeros([0, d], tf.float32)

        out = tf.cond(excess > 0, evict, none)
        if first:
            out = tuple(tf.concat([a, b], 0) for a, b in zip(first[0], out))
        with tf.control_dependencies(list(out)):
            size = _size(L.table)
            check = [self._max("over_capacity", size - cfg.capacity),
                     L.filled.assign(tf.logical_or(L.filled, size >= cfg.capacity))]
        with tf.control_dependencies(check):
            return tuple(tf.identity(t) for t in out)

    def planned(self, keys: tf.Tensor):
        """Plan pushes: the unpushed updates (keys, counts, sums) of this worker's lines of ``keys``
        (the keys other processes read this step), the lines marked pushed. With plain SGD only:
        the owner applies them (``apply_pushed``) before anyone reads."""
        lines, cached = self.lines.table.lookup(keys, return_exists=True)
        return self._drain(*_mask(cached, keys, lines))

    def apply_pushed(self, keys: tf.Tensor, sums: tf.Tensor) -> tf.Operation:
        """The owner's plain SGD step on pushed sums (distinct ``keys``): row -= lr * sum, what the
        optimizer would do at the step's end, done now so this step's reads see it."""
        rows = self._owner_rows(keys)
        return self.params.upsert(keys, rows - self.local_lr * sums)

    def pending(self, clear: bool = False):
        """Every line's unpushed updates (keys, counts, sums), and the lines marked pushed (flush);
        ``clear``: the lines removed instead (the cache starts empty again)."""
        return self._drain(*self.lines.table.export(), clear=clear)

    def _drain(self, keys: tf.Tensor, lines: tf.Tensor, clear: bool = False):
        """The unpushed updates (keys, counts, sums) of these lines (``keys``: distinct), the lines
        marked pushed - their clocks advance by their counts where the row counts them (a local
        update); an outdated line (on-demand: clock < 0) stays outdated - or, ``clear``, all removed."""
        L = self.lines
        row, clock, pend, count, used, uses = L.parts(lines)
        k, row, clock, pend, count, used, uses = _mask(count > 0, keys, row, clock, pend, count, used, uses)
        if self.local_lr is not None:
            clock = tf.where(clock < 0, clock, clock + count)
        if clear:
            done = L.table.remove(keys)
        else:
            done = L.table.upsert(k, L.join(row, clock, tf.zeros_like(pend), tf.zeros_like(count), used, uses))
        with tf.control_dependencies([done]):
            return tf.identity(k), tf.identity(count), tf.identity(pend)

    def push(self, keys: tf.Tensor, counts: tf.Tensor, sums: tf.Tensor):
        """Send pushed updates to their owners (one all-to-all). Returns, on the owner side, the
        distinct received keys and their summed gradients; their clocks advance by the counts."""
        ex, L = self.exchange, self.lines
        owner = self.owner_of(keys)
        order = tf.argsort(owner, stable=True)
        splits = tf.math.bincount(owner, minlength=ex.world_size, maxlength=ex.world_size, dtype=tf.int32)
        msg = tf.gather(tf.concat([_to_f32(keys), tf.expand_dims(counts, 1), sums], 1), order)
        remote = tf.size(keys) - splits[ex.rank]
        with tf.control_dependencies([self._add("pushed", remote),
                                      self._add("analytic_bytes", (12 + 4 * self.dim) * remote)]):
            got, _ = self._alltoall(msg, splits, "push_bytes")
        gbits, gcount, gsum = tf.split(tf.reshape(got, [-1, 3 + self.dim]), [2, 1, self.dim], 1)
        gkeys, gcount = _to_i64(gbits), tf.reshape(gcount, [-1])
        ukeys, where = tf.unique(gkeys)
        n = tf.size(ukeys)
        usum = tf.math.unsorted_segment_sum(gsum, where, n)
        ucount = tf.math.unsorted_segment_sum(gcount, where, n)
        ko = tf.reshape(L.clock.lookup(ukeys), [-1])
        ops = [L.clock.upsert(ukeys, tf.expand_dims((ko + ucount), 1))]
        if L.audit:
            ops.append(self._audit_add(L.applied, ukeys, usum))
        with tf.control_dependencies(ops):
            return tf.identity(ukeys), tf.identity(usum)

    @staticmethod
    def _audit_add(table, keys, sums):
        """table[key] += [sum, 1 per occurrence] (keys may repeat)."""
        ukeys, where = tf.unique(keys)
        n = tf.size(ukeys)
        add = tf.math.unsorted_segment_sum(tf.concat([sums, tf.ones_like(sums[:, :1])], 1), where, n)
        return table.upsert(ukeys, table.lookup(ukeys) + add)


class CachedFieldEmbedding(CacheProtocol, ShardedFieldEmbedding):
    """A ShardedFieldEmbedding whose training reads go through a bounded, stale-tolerant cache
    (see the module docstring); inference reads the owners' rows as the PS mode does."""

    def __init__(self, field: str, dim: int, exchange: KeyExchange, config: CacheConfig, seed: int = 0,
                 init_scale: float = 0.05, name: str | None = None, linear: bool = False,
                 counters: dict | None = None, **kwargs):
        super().__init__(field, dim, exchange, seed, init_scale, name=name or f"cache{dim}_{field}",
                         linear=linear, **kwargs)
        self._start_cache(config, counters)

    def fetch(self, ids: tf.Tensor, step: tf.Tensor) -> tf.Tensor:
        """``fetch_keys`` of the distinct ids of this field's input ``ids``."""
        return self.fetch_keys(tf.reshape(tf.convert_to_tensor(ids, tf.int64), [-1]), step)


class CachedFusedTable(CacheProtocol, ShardedFusedTable):
    """The cached tables of one width in one TFRA table per process, with ONE cache: its lines
    hold rows of every member field (the capacity is the members' together, evicted by one
    LRU/LFU order), and a step does one query, one fetch and one push all-to-all per width
    instead of one per field. A key is ``slot << 55 | id`` (des_ops.fused) and lives with the
    owner of its id (id mod N), as in the members' own tables."""

    joins_linear = False       # its cache lines and plan pushes are one member's rows

    def __init__(self, members: list, calls: list[int], dim: int, name: str, linear: bool = False, **layout):
        super().__init__(members, calls, dim, name, linear, **layout)
        configs = {dataclasses.replace(m.config, capacity=0) for m in members}
        if len(configs) != 1:
            raise ValueError(f"{name}: the cached tables to fuse differ in more than their capacity: {configs}")
        config = dataclasses.replace(members[0].config, capacity=sum(m.config.capacity for m in members))
        if config.on_demand:
            raise ValueError(f"{name}: the on-demand plan names each field's keys: keep the cached tables per field")
        self._start_cache(config, members[0].counters)

    def owner_of(self, keys: tf.Tensor) -> tf.Tensor:
        return self.exchange.owner(self.ids_of(keys))

    def fetch(self, inputs, step: tf.Tensor) -> tf.Tensor:
        """``fetch_keys`` of the packed keys of ``inputs`` (what ``call`` gets: one per member call)."""
        packed, _ = self.packed_keys(list(inputs))
        return self.fetch_keys(tf.concat(packed, axis=0), step)


FUSED_CLASS[CachedFieldEmbedding] = CachedFusedTable

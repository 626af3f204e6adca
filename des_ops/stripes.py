"""Key stripes of one table: process r of N holds the keys k with k mod N == r. For a table that
holds several fields in one key space (ids [B, P] into one table, TFRA's one-table style, or a
TFRA table read through offsets), where no field owns it: every process looks its own keys up
for the whole batch, zeros for the others, and the sum over processes is the whole lookup.

    >>> import numpy as np, tensorflow as tf
    >>> full = np.arange(12, dtype=np.float32).reshape(6, 2)                # 6 keys of width 2
    >>> mine = StripeEmbedding(1, 2, full[1::2], vocabulary=6, name="odd")   # keys 1, 3, 5
    >>> mine(tf.constant([[1, 2], [5, 4]], tf.int64)).numpy()[:, :, 0].tolist()
    [[2.0, 0.0], [10.0, 0.0]]
    >>> mine.keys().tolist(), mine.embeddings.shape.as_list()
    ([1, 3, 5], [3, 2])
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf


def stripe_lookups(lookup: Callable[[tf.Tensor], list], ids: tf.Tensor, stripe: int, count: int,
                   dims: list[int]) -> list[tf.Tensor]:
    """ids.shape + [dims[j]] for each of several tables read with the same ids: ``lookup`` (1-D keys ->
    one [n, dims[j]] per table, e.g. a joined table's members) of the keys of stripe ``stripe`` of
    ``count`` (k mod count == stripe), behind one stripe mask, zeros for every other key, each table's
    rows placed on their own (no concatenation to split again, forward or backward). Only those keys
    are looked up, so only their rows get gradients (a TFRA table creates no row for the others)."""
    flat = tf.reshape(ids, [-1])
    own = tf.where(tf.equal(tf.math.floormod(flat, tf.cast(count, flat.dtype)), tf.cast(stripe, flat.dtype)))
    rows = lookup(tf.gather_nd(flat, own))           # [n, 1] positions: one Where for the lookup and the scatters
    size = tf.size(flat, out_type=tf.int64)
    return [tf.reshape(tf.scatter_nd(own, tf.reshape(r, [-1, d]), tf.stack([size, d])),
                       tf.concat([tf.shape(ids), [d]], axis=0)) for r, d in zip(rows, dims)]


class StripeLookup:
    """The lookup of one or more tables read with the same ids and split by key stripe (a table and
    its linear partner joined in one: ``lookup`` 1-D keys -> one [n, dims[j]] per member): called
    on ids, each member's rows in ids.shape + [dims[j]] (stripe_lookups; the last ids' result is
    kept for the next member); ``at(keys)``: each member's [n, dims[j]] rows of 1-D ``keys``, zeros
    for other stripes' keys, placed nowhere: for an exchange that sends the rows of a slice's
    distinct keys only (des_ops.rows.rows_to_samples ``picked``), not the whole batch's.

        >>> full = tf.constant(np.arange(12, dtype=np.float32).reshape(6, 2))
        >>> odd = StripeLookup(lambda k: [tf.gather(full, k)], 1, 2, [2])
        >>> odd.at(tf.constant([5, 2, 1], tf.int64))[0].numpy()[:, 0].tolist()
        [10.0, 0.0, 2.0]
        >>> odd.member(0)(tf.constant([[5, 2]], tf.int64)).numpy()[..., 0].tolist()
        [[10.0, 0.0]]
    """

    def __init__(self, lookup: Callable[[tf.Tensor], list], stripe: int, count: int, dims: list[int],
                 check: Callable[[tf.Tensor], tf.Operation] | None = None):
        self.lookup, self.stripe, self.count, self.dims = lookup, int(stripe), int(count), [int(d) for d in dims]
        self.check = check      # ids -> an op that stops the step on a bad id (every id, every process)
        self._last: dict = {}
        self._at: dict = {}

    def __call__(self, ids: tf.Tensor) -> list[tf.Tensor]:
        if self._last.get("ids") is not ids:
            with tf.control_dependencies([self.check(ids)] if self.check else []):
                parts = stripe_lookups(self.lookup, ids, self.stripe, self.count, self.dims)
            self._last = {"ids": ids, "parts": parts}
        return self._last["parts"]

    def at(self, keys: tf.Tensor, ids: tf.Tensor | None = None) -> list[tf.Tensor]:
        """Each member's rows of ``keys``; ``ids``: the whole batch's, which ``check`` reads first."""
        if self._at.get("keys") is not keys:          # the members' lanes share their keys: one lookup
            with tf.control_dependencies([self.check(ids)] if self.check and ids is not None else []):
                parts = stripe_lookups(self.lookup, keys, self.stripe, self.count, self.dims)
            self._at = {"keys": keys, "parts": parts}
        return self._at["parts"]

    def member(self, j: int) -> "StripeMember":
        return StripeMember(self, j)


class StripeMember:
    """Member ``j`` of a StripeLookup: ids -> its rows (ids.shape + [dim]), or ``deferred(ids)``:
    that lookup not made yet (Deferred), for a reader that may want only some keys' rows."""

    def __init__(self, lookup: StripeLookup, j: int):
        self.lookup, self.j = lookup, int(j)

    def __call__(self, ids: tf.Tensor) -> tf.Tensor:
        return self.lookup(ids)[self.j]

    def deferred(self, ids: tf.Tensor) -> "Deferred":
        return Deferred(self, ids)


class Deferred:
    """A striped lookup not made yet: ``member`` (StripeMember) of ``ids``; ``dense()`` makes it."""

    def __init__(self, member: StripeMember, ids: tf.Tensor):
        self.member, self.ids = member, ids

    def dense(self) -> tf.Tensor:
        return self.member(self.ids)


class MaskedStripe:
    """Stripe ``stripe`` of ``count`` of tables that pool their ids themselves (des.train's
    FieldEmbedding on [B, L] ids, maybe weighted: ``[ids, weights]``), read with the same inputs:
    ``call`` (the inputs -> one output per table) made on the inputs with every other stripe's id
    (and the padding) as the padding id, whose row is zero and never trained, so each output is
    this stripe's share of the pooled vector and the shares sum to it (the rules that split such a
    field are linear in it, or square it after the sum). ``member(j)``: table j's output; the
    members share one call.

        >>> rows = tf.constant(np.arange(6, dtype=np.float32).reshape(6, 1))
        >>> pooled = lambda x: [tf.reduce_sum(tf.where(x[0][..., None] >= 0, tf.gather(rows, tf.maximum(x[0], 0)), 0.0)
        ...                                   * x[1][..., None], axis=1)]
        >>> odd = MaskedStripe(pooled, 1, 2, pad=-1)
        >>> odd.member(0)([tf.constant([[1, 2, 3]], tf.int64), tf.constant([[1.0, 1.0, 0.5]])]).numpy().tolist()
        [[2.5]]
    """

    def __init__(self, call: Callable[[object], list], stripe: int, count: int, pad: int):
        self.call, self.stripe, self.count, self.pad = call, int(stripe), int(count), int(pad)
        self._last: dict = {}

    def __call__(self, inputs) -> list[tf.Tensor]:
        if self._last.get("inputs") is not inputs:
            ids, rest = (inputs[0], list(inputs[1:])) if isinstance(inputs, (list, tuple)) else (inputs, [])
            wide = tf.cast(ids, tf.int64)
            own = tf.equal(tf.math.floormod(wide, self.count), self.stripe)       # the padding stays padding
            masked = tf.where(own, ids, tf.cast(self.pad, ids.dtype))
            self._last = {"inputs": inputs, "outs": self.call([masked, *rest] if rest else masked)}
        return self._last["outs"]

    def member(self, j: int) -> Callable:
        return lambda inputs: self(inputs)[j]


def held_keys(keys: np.ndarray, stripe: int, count: int) -> np.ndarray:
    """Mask of ``keys`` in stripe ``stripe`` of ``count``."""
    return np.mod(np.asarray(keys, np.int64), count) == stripe


def keep_own_rows(source, table) -> None:
    """Drop the rows of a dynamic table split by key stripe (``table.des_key_stripe``) that are not
    its process's stripe: after rank 0's rows came to every process, or a save gathered them all."""
    keys, values = source.export(table)
    keep = source.held(table, np.asarray(keys, np.int64))
    if not keep.all():
        source.clear_rows(table, table.params)
        source.load(table, np.asarray(keys)[keep], np.asarray(values)[keep])


class StripeEmbedding(tf.keras.layers.Layer):
    """Stripe ``stripe`` of ``count`` of a static Keras ``Embedding(vocabulary, K)``: its keys
    stripe, stripe + count, ... below ``vocabulary``, as rows 0, 1, ... of one variable (``rows``:
    ``full[stripe::count]``). Called on ids of any shape: their rows, zeros for the keys of
    other stripes. Exported and loaded under the table's global keys (des.graph.sources), as a
    RangeEmbedding is. An id outside the vocabulary is an error, as in the untouched table."""

    des_range_table = True

    def __init__(self, stripe: int, count: int, rows: np.ndarray, vocabulary: int, table: str = "",
                 regularizer=None, **kwargs):
        super().__init__(**kwargs)
        self.stripe, self.count, self.vocabulary = int(stripe), int(count), int(vocabulary)
        self.table = table or self.name
        self.dim = int(rows.shape[1])
        # one variable name per table: optimizer slots are found by name (des.runtime.state)
        # ``regularizer``: the table's L1/L2 penalty, a sum over rows: this stripe's share of it
        self.embeddings = self.add_weight(f"{self.name}_rows", shape=rows.shape, dtype=tf.float32,
                                          initializer=tf.keras.initializers.Constant(rows), regularizer=regularizer)
        self._message = (f"des: table {self.table} of {self.vocabulary} rows was given an id outside [0, "
                         f"{self.vocabulary})")

    def keys(self) -> np.ndarray:
        """The global keys of the rows held, in the variable's row order."""
        return np.arange(self.stripe, self.vocabulary, self.count, dtype=np.int64)

    def held(self, keys: np.ndarray) -> np.ndarray:
        keys = np.asarray(keys, np.int64)
        return held_keys(keys, self.stripe, self.count) & (keys >= 0) & (keys < self.vocabulary)

    def local(self, keys: np.ndarray) -> np.ndarray:
        """Row indices of held global ``keys``."""
        return np.asarray(keys, np.int64) // self.count

    def check(self, ids) -> tf.Operation:
        """Stops the step if an id is outside the vocabulary (as the untouched table would)."""
        ids = tf.cast(ids, tf.int64)
        return tf.debugging.Assert(tf.logical_not(tf.reduce_any(tf.logical_or(ids < 0, ids >= self.vocabulary))),
                                   [self._message])

    def rows(self, keys) -> tf.Tensor:
        """The rows of held global ``keys`` (1-D)."""
        return tf.gather(self.embeddings, tf.cast(keys, tf.int64) // self.count)

    def lookup(self) -> "StripeLookup":
        """This stripe as a StripeLookup (each id checked against the vocabulary first)."""
        return StripeLookup(lambda k: [self.rows(k)], self.stripe, self.count, [self.dim], check=self.check)

    def call(self, ids):
        return self.lookup()(tf.cast(ids, tf.int64))[0]

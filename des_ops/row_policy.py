"""Bounded tables (des.RowPolicy): a key gets a row at its C-th occurrence; rows idle for S steps, or beyond R per
table (least recently read first), are removed with their optimizer slots.

    >>> import tensorflow as tf
    >>> from models.layers import FieldEmbedding
    >>> emb = FieldEmbedding("C1", dim=4)
    >>> from des.compiler.options import RowPolicy
    >>> state = attach(emb, RowPolicy(admit_min_count=2))
    >>> _ = emb(tf.constant([7, 7, 8], tf.int64), training=True)   # 7 occurs twice: admitted; 8 once
    >>> emb.params.export()[0].numpy().tolist(), state.counting()
    ([7], 1)
    >>> _ = emb(tf.constant([8], tf.int64), training=True)         # 8's second occurrence
    >>> sorted(emb.params.export()[0].numpy().tolist())
    [7, 8]

What a key reads before it is admitted is what an unseen key reads (its ``key_init`` row), and
its gradient is dropped: it is not among the ids the optimizer updates. Counting is done by the
table that holds the key, on every occurrence in the batches it reads: under DES a field's owner
reads its fields' ids for the whole batch, as one process does, so DES on N and one process admit
the same keys at the same step. The counts live in a second TFRA table (``seen``: key -> [count,
last step read], 16 bytes a key besides the hash table's own) that holds the keys being counted
and the keys held; an idle key leaves it as its row does.

Eviction runs between steps (des.runtime.bounded: after the training step whose number of steps done is
a multiple of ``every``), from ``seen`` alone, so it is the same on any N: a row last read at
step L is removed at step t when t - 1 - L >= ``evict_idle_steps``; then, per table (a fused
table: per member slot), the rows beyond ``max_rows`` read longest ago (ties: the smaller key).
Between two evictions a table can exceed ``max_rows`` by the new keys of ``every`` steps.

The step is the optimizer's ``iterations``, copied into each state before every step, so a
restored checkpoint continues the same cadence. TFRA's own ``restrict`` policies are not used:
their timestamp policy ranks rows by wall-clock time and their frequency policy by update count,
neither of which is the same run after run.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

from models.layers import FieldEmbedding, table_name
from models.spec import ID_BITS


class RowState:
    """The policy's state of one TFRA table layer (a FieldEmbedding or a fused table of them):
    ``seen`` (key -> [count, last step read]), the step, and per member slot the keys admitted
    and rows evicted in this run."""

    def __init__(self, table, policy):
        self.table, self.policy = table, policy
        self.seen = de.get_variable(table_name(f"{table.name}_des_seen"), key_dtype=tf.int64,
                                    value_dtype=tf.int64, dim=2, initializer=0)
        self.fused = hasattr(table, "slot_names")
        self.slots = len(table.slot_names) if self.fused else 1
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False, name="des_row_step")
        self.admitted = tf.Variable(tf.zeros([self.slots], tf.int64), trainable=False, name="des_rows_admitted")
        self.evicted = np.zeros([self.slots], np.int64)
        keys = table.params.export()[0]        # rows held before the policy: read at the current step
        if int(tf.size(keys)):
            self.seen.upsert(keys, tf.stack([tf.fill(tf.shape(keys), tf.constant(policy.threshold, tf.int64)),
                                             tf.zeros_like(keys)], axis=1))

    def slot_of(self, keys):
        """The member slot of each key (a fused table packs it above the id; else 0)."""
        if not self.fused:
            return tf.zeros_like(keys, tf.int32) if isinstance(keys, tf.Tensor) else np.zeros(len(keys), np.int64)
        if isinstance(keys, tf.Tensor):
            return tf.cast(tf.bitwise.right_shift(keys, tf.constant(ID_BITS, tf.int64)), tf.int32)
        return keys >> ID_BITS

    def train_rows(self, uniq: tf.Tensor, counts: tf.Tensor | None, exists: tf.Tensor, rows: tf.Tensor,
                   read_through) -> tf.Tensor:
        """Rows [n, dim] of distinct keys ``uniq`` in training: ``rows`` (held or start rows),
        ``exists`` which are held, ``counts`` their occurrences in the batch (None: once each).
        Admitted keys are inserted and read through ``read_through(keys, rows)`` (the optimizer
        updates them); the others read their start row with no gradient."""
        counts = tf.ones_like(uniq) if counts is None else tf.cast(counts, tf.int64)
        exists = tf.reshape(exists, [-1])                       # TFRA's lookup leaves the shape unknown
        total = tf.reshape(self.seen.lookup(uniq), [-1, 2])[:, 0] + counts
        admitted = exists | (total >= self.policy.threshold)
        new = admitted & tf.logical_not(exists)
        new_keys = tf.boolean_mask(uniq, new)
        step = tf.fill(tf.shape(uniq), self.step.read_value())
        ops = [self.seen.upsert(uniq, tf.stack([total, step], axis=1)),
               self.table.params.upsert(new_keys, tf.boolean_mask(rows, new)),
               self.admitted.assign_add(tf.math.bincount(self.slot_of(new_keys), minlength=self.slots,
                                                         maxlength=self.slots, dtype=tf.int64))]
        take = tf.cast(tf.where(admitted)[:, 0], tf.int32)
        leave = tf.cast(tf.where(tf.logical_not(admitted))[:, 0], tf.int32)
        with tf.control_dependencies(ops):
            trained = read_through(tf.gather(uniq, take), tf.gather(rows, take))
        return tf.dynamic_stitch([take, leave], [trained, tf.stop_gradient(tf.gather(rows, leave))])

    def evict(self, slot_tables: list) -> int:
        """Remove what the policy evicts at the current step from the rows, ``slot_tables`` (the
        optimizer's slot tables of these rows) and ``seen``; returns the rows removed."""
        p = self.policy
        keys, vals = (x.numpy() for x in self.seen.export())
        if not len(keys):
            return 0
        t = int(self.step.numpy())
        idle = (vals[:, 1] <= t - 1 - p.evict_idle_steps) if p.evict_idle_steps else np.zeros(len(keys), bool)
        held = vals[:, 0] >= p.threshold
        gone = [keys[idle]]
        rows_gone = np.bincount(self.slot_of(keys[idle & held]), minlength=self.slots)
        if p.max_rows:
            kept = held & ~idle
            k, last, slot = keys[kept], vals[kept, 1], self.slot_of(keys[kept])
            for s in np.unique(slot):
                mine = slot == s
                over = int(mine.sum()) - p.max_rows
                if over > 0:
                    order = np.lexsort((k[mine], last[mine]))         # read longest ago first; ties: smaller key
                    gone.append(k[mine][order[:over]])
                    rows_gone[s] += over
        gone = tf.constant(np.concatenate(gone), tf.int64)
        if int(tf.size(gone)):
            for table in [self.table.params, self.seen] + slot_tables:
                table.remove(gone)
        self.evicted += rows_gone[:self.slots]
        return int(rows_gone.sum())

    def counting(self) -> int:
        """Keys being counted that have no row yet."""
        vals = self.seen.export()[1].numpy()
        return int((vals[:, 0] < self.policy.threshold).sum())

    # --- checkpoints: one member's counts, keyed by its ids ---------------------------------------
    def member_seen(self, member: int | None) -> tuple[np.ndarray, np.ndarray]:
        """(ids, [count, last step]) of member ``member`` of a fused table (None: the table's own)."""
        if member is None:
            return tuple(x.numpy() for x in self.seen.export())
        empty = (np.zeros([0], np.int64), np.zeros([0, 2], np.int64))
        return self.table.by_slot("seen", self.seen.export).get(int(self.table.slot_of(member)), empty)

    def load_member_seen(self, member: int | None, ids: np.ndarray, vals: np.ndarray) -> None:
        """Make member ``member``'s part of ``seen`` hold exactly ``ids`` -> ``vals``."""
        old = self.member_seen(member)[0]
        keys = np.asarray(ids, np.int64)
        if member is not None:
            old, keys = (self.table.pack(member, x) for x in (old, keys))
        if len(old):
            self.seen.remove(tf.constant(old, tf.int64))
        if len(keys):
            self.seen.upsert(tf.constant(keys, tf.int64), tf.constant(np.asarray(vals, np.int64).reshape(-1, 2)))


def attach(table, policy) -> RowState:
    """Give a TFRA table layer (FieldEmbedding or a fused table) the policy's state."""
    state = RowState(table, policy)
    table.des_row_state = state
    return state


def state_of(layer) -> tuple[RowState, int | None] | None:
    """(state, member) of the table that holds ``layer``'s rows (member: its place in a fused
    table, else None), or None when no policy applies to it."""
    fused = getattr(layer, "des_fused", None)
    table, member = (fused[0], fused[1]) if fused else (layer, None)
    state = getattr(table, "des_row_state", None)
    return (state, member) if state is not None else None


def policy_tables(model: tf.keras.Model) -> list:
    """The TFRA table layers of ``model`` a policy can bound (FieldEmbedding and fused tables that
    hold rows themselves; a table whose rows moved into a fused table is bounded there)."""
    seen, out = set(), []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        if isinstance(layer, FieldEmbedding) and not getattr(layer, "des_fused", None) and id(layer) not in seen:
            seen.add(id(layer))
            out.append(layer)
    return out

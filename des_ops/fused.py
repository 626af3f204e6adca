"""Fused tables: the rows of several fields of one width (and optimizer group) in ONE TFRA table,
so a step does one key lookup, one insert and one optimizer update per table instead of one per field.

    >>> from models.layers import FieldEmbedding
    >>> c1, c2 = FieldEmbedding("C1", dim=4), FieldEmbedding("C2", dim=4)
    >>> fused = FusedTable([c1, c2], calls=[0, 1], dim=4, name="doc_fused4")
    >>> a, b = fused([tf.constant([7, 8], tf.int64), tf.constant([7, 9], tf.int64)], training=True)  # one batch
    >>> bool((a.numpy() == c1(tf.constant([7, 8], tf.int64)).numpy()).all())   # the rows C1's own table starts from
    True
    >>> sorted(fused.field_rows(1)[0].tolist()), fused.params.size().numpy()    # C2 holds ids 7, 9; 4 rows in all
    ([7, 9], 4)

Key rule: the row of id ``i`` of the field in slot ``s`` (its place in ``members``) is stored under
``s << 55 | i``. Ids must lie in [0, 2**55) (the readers' hashed ids do: des.data.hashing) and a table
holds at most 256 fields; an id outside that range stops the step with a message naming the field.
A new row depends on (field, id, seed) only, exactly as in the field's own table, so fusing changes
no result; checkpoints still store (field, id) -> row (des.graph.sources reads a field's rows through
``field_rows``).

Joined rows (``fusion_groups(..., join_linear=True)``): a field's linear weight (width 1) and its
embedding (width k), read with the same ids, share one key and one row of width k + 1 - one
lookup, one exchange and one update for both. Exact for element-wise optimizers (SGD, Adagrad,
Adam, FTRL) when both parts have the same optimizer; models.optim.LinearAndRestOptimizer refuses
such a table.

    >>> e1, l1 = FieldEmbedding("C1", dim=4), FieldEmbedding("C1", dim=1, init_scale=0.0, linear=True)
    >>> joined = FusedTable([e1, l1], calls=[0, 1], dim=5, name="doc_joined", slots=[0, 0], same_as=[0, 0])
    >>> x = tf.constant([7, 8], tf.int64)
    >>> rows, weights = joined([x, x], training=True)      # one key per id, one row [embedding | weight]
    >>> rows.shape, weights.shape, joined.params.size().numpy()
    (TensorShape([2, 4]), TensorShape([2, 1]), 2)
"""
from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf

from des_ops.keras_internals import has_weight_penalties
from models.layers import FieldEmbedding, key_init_rows, only_shapes_wanted, pool
from models.optim import is_linear
from models.spec import ID_BITS, ID_MASK, PAD_ID

MAX_FIELDS = 2 ** (63 - ID_BITS)
_ID_MASK = ID_MASK


def width_of(layer) -> int:
    """A table layer's row width (FieldEmbedding.dim or a TFRA Embedding's embedding_size)."""
    return int(getattr(layer, "dim", None) or layer.embedding_size)


def linear_part(layer) -> bool:
    """A table of the model's linear part (models.optim.is_linear of the variable it trains)."""
    return is_linear(layer.shadow)


def member_rows(layer) -> tuple[int, float, bool] | None:
    """(salt, init scale, pools) of a table layer whose rows can live in a fused table, or None.
    ``pools``: it sums multi-valued ids and skips PAD_ID (FieldEmbedding), or returns ids.shape +
    [dim] (a keyed TFRA Embedding)."""
    if type(layer) in FUSED_CLASS:     # a FieldEmbedding pools; a keyed TFRA table's stand-in returns ids' shape
        return layer.salt, layer.init_scale, not getattr(layer, "des_rows_in_ids_shape", False)
    if getattr(layer, "des_keyed_tfra", False) and not getattr(layer, "des_squashed", False):
        return layer.des_salt, layer.des_scale, False
    return None


class FusedTable(FieldEmbedding):
    """One TFRA table for the rows of ``members`` (table layers, see ``member_rows``).

    ``calls[k]`` is the member read by the k-th input of ``call`` (a table shared by two fields
    is read twice); ``call`` returns one tensor per input, what that member's own call returns.
    ``slots[m]``: the key slot of member m (default: its own); members that share a slot keep
    their rows side by side in one row, in member order (joined rows: the module docstring), and
    every slot has the same column layout, ``dim`` wide in all. ``same_as[k]``: an earlier input
    that is the same tensor read through the same slot (its keys are looked up once)."""
    des_embedding = False          # not a table of the user's graph: des.graph.sources reads its members
    joins_linear = True            # may hold joined rows (the cache's fused table may not)

    def __init__(self, members: list, calls: list[int], dim: int, name: str, linear: bool = False,
                 slots: list[int] | None = None, same_as: list[int] | None = None):
        specs = [member_rows(m) for m in members]
        if any(s is None for s in specs):
            raise ValueError(f"{name}: these tables cannot be fused: "
                             f"{[m.name for m, s in zip(members, specs) if s is None]}")
        slots = list(range(len(members))) if slots is None else list(slots)
        n_slots = max(slots) + 1
        if n_slots > MAX_FIELDS:
            raise ValueError(f"{name}: a fused table holds at most {MAX_FIELDS} tables, got {n_slots}")
        # room for what the members' own tables start with (TFRA's 8192 rows each): a table that
        # starts small rehashes as it fills, a cost the per-field tables do not pay
        super().__init__(field=name, dim=dim, name=name, linear=linear, init_capacity=8192 * n_slots)
        self.member_names = [m.name for m in members]
        self.calls = list(calls)
        self.same_as = list(range(len(calls))) if same_as is None else list(same_as)
        self._slot, self._start, self._width = slots, [0] * len(members), [width_of(m) for m in members]
        layout: dict[int, list[int]] = {}                 # slot -> its members, in member order
        for m, s in enumerate(slots):
            self._start[m] = sum(self._width[o] for o in layout.get(s, []))
            layout.setdefault(s, []).append(m)
        widths = {tuple(self._width[m] for m in layout[s]) for s in range(n_slots) if s in layout}
        if len(widths) != 1 or sum(next(iter(widths))) != dim or len(layout) != n_slots:
            raise ValueError(f"{name}: every slot must hold members of widths adding up to {dim} "
                             f"in the same order; got {sorted(widths)}")
        self.blocks = [(self._start[m], self._width[m]) for m in layout[0]]     # (first column, width)
        self._block = [self.blocks.index((self._start[m], self._width[m])) for m in range(len(members))]
        self.slot_names = ["/".join(self.member_names[m] for m in layout[s]) for s in range(n_slots)]
        self._salts = np.array([[specs[m][0] for m in layout[s]] for s in range(n_slots)], np.int64)
        self._scales = np.array([[specs[m][1] for m in layout[s]] for s in range(n_slots)], np.float64)
        self._pools = [s[2] for s in specs]
        for k, r in enumerate(self.same_as):
            if r > k or slots[calls[r]] != slots[calls[k]]:
                raise ValueError(f"{name}: input {k} cannot read through input {r}")

    def slot_of(self, member: int) -> int:
        """The key slot of member ``member`` (joined members share one)."""
        return self._slot[member]

    @staticmethod
    def single_inputs(inputs) -> list[int]:
        """Which inputs are one-hot (ids [B], no weights): their rows travel as one [B, S, dim] block."""
        return [k for k, x in enumerate(inputs) if not isinstance(x, (list, tuple)) and x.shape.rank == 1]

    def reads(self, inputs) -> tuple[list[int], list[int]]:
        """(the one-hot inputs, the others) among the inputs whose keys are looked up (``same_as``)."""
        single = set(self.single_inputs(inputs))
        first = [k for k in range(len(inputs)) if self.same_as[k] == k]
        return [k for k in first if k in single], [k for k in first if k not in single]

    def block_inputs(self, inputs) -> list[list[int]]:
        """Per column block (one per member width of a slot, see ``blocks``): the one-hot inputs
        whose rows ``call(..., with_block=True)``'s block of that width holds, in its order."""
        single, _ = self.reads(inputs)
        out = []
        for b in range(len(self.blocks)):
            first: dict[int, int] = {}
            for k in range(len(inputs)):
                if self.same_as[k] in single and self._block[self.calls[k]] == b:
                    first.setdefault(self.same_as[k], k)
            out.append([first[r] for r in single if r in first])
        return out

    def row_layout(self, inputs) -> list[int] | None:
        """The inputs whose outputs the columns of ``call(..., with_rows=True)``'s rows hold, in
        order: per one-hot input read (``reads``), per column block, its reader (``block_inputs``);
        None if a block of one of them has no reader (or there is no one-hot input)."""
        single, _ = self.reads(inputs)
        per_block = self.block_inputs(inputs)
        if not single or any(len(ks) != len(single) for ks in per_block):
            return None
        return [ks[s] for s in range(len(single)) for ks in per_block]

    @tf.autograph.experimental.do_not_convert   # plain TF ops: autograph would only slow tracing
    def call(self, inputs, training=None, with_block: bool = False, with_rows: bool = False):
        """One tensor per input; ``with_block``: and, per column block (``block_inputs``), the rows
        of its one-hot inputs as one [B, S, width] tensor (or None), which a stack or concatenation
        of them can read instead; ``with_rows``: and the rows of its one-hot inputs side by side,
        [B, S * dim] (or None): the outputs ``row_layout`` names, in that order, as one tensor."""
        # one-hot inputs travel as one [B, S] block: a few ops whatever S is, since tracing cost
        # grows with the number of ops; the others one by one
        if only_shapes_wanted(self):
            return self._zeros(inputs, with_block) if not with_rows else (self._zeros(inputs, False), None)
        single, other = self.reads(inputs)
        packed, padded = self.packed_keys(inputs, single, other)
        uniq, idx, counts = self.unique_keys(tf.concat(packed, axis=0), training)
        rows = tf.gather(self.distinct_rows(uniq, training, multi_valued=padded, counts=counts), idx)
        parts = tf.split(rows, [tf.size(p) for p in packed]) if len(packed) > 1 else [rows]
        out = [None] * len(inputs)
        rows_side_by_side = tf.reshape(parts[0], [-1, len(single) * self.dim]) if single else None
        if single:
            block = tf.reshape(parts[0], [-1, len(single), self.dim])
            place = {r: s for s, r in enumerate(single)}
            # tf.split, not slices: a slice's gradient is a zero tensor of the whole block per slice
            blocks = [block] if len(self.blocks) == 1 else tf.split(block, [w for _, w in self.blocks], axis=2)
            columns = [tf.unstack(sub, axis=1) for sub in blocks]
            for k in range(len(inputs)):
                if self.same_as[k] in place:
                    out[k] = columns[self._block[self.calls[k]]][place[self.same_as[k]]]
        else:
            blocks = [None] * len(self.blocks)
        flat = {r: [p] if len(self.blocks) == 1 else tf.split(p, [w for _, w in self.blocks], axis=1)
                for r, p in zip(other, parts[1 if single else 0:])}
        for k in range(len(inputs)):
            r = self.same_as[k]
            if r not in flat:
                continue
            m = self.calls[k]
            w = self._width[m]
            part = flat[r][self._block[m]]
            ids, weights = self._ids_and_weights(inputs[k])
            if self._pools[m]:
                out[k] = pool(part, ids, weights, w)
            else:
                out[k] = tf.reshape(part, tf.concat([tf.shape(ids), [w]], 0))
        if with_rows:
            return out, rows_side_by_side
        return (out, blocks) if with_block else out

    def packed_keys(self, inputs, single: list[int] | None = None, other: list[int] | None = None):
        """(the keys of the inputs read (``reads``), packed as ``slot << 55 | id`` - one-hot inputs
        first, as one tensor -, whether multi-valued padding is among them); stops the step on an id
        that breaks the key rule. ``call`` reads the rows of ``tf.unique`` of their concatenation."""
        if single is None:
            single, other = self.reads(inputs)
        slot_of = lambda k: self._slot[self.calls[k]]  # noqa: E731
        packed, checked, padded = [], [], False     # checked: (ids, padding, key slots) of every input
        if single:
            ids = tf.stack([tf.cast(inputs[k], tf.int64) for k in single], axis=1)
            checked.append((tf.reshape(ids, [-1]), None, [slot_of(k) for k in single]))
            slots = tf.constant([slot_of(k) << ID_BITS for k in single], tf.int64)
            packed.append(tf.reshape(tf.bitwise.bitwise_or(ids, slots[None, :]), [-1]))
        for k in other:
            ids, _ = self._ids_and_weights(inputs[k])
            flat, slot = tf.reshape(ids, [-1]), slot_of(k)
            multi = self._pools[self.calls[k]] and ids.shape.rank == 2
            padded |= multi
            pad = (flat == PAD_ID) if multi else None
            checked.append((flat, pad, [slot]))
            key = tf.bitwise.bitwise_or(flat, tf.constant(slot << ID_BITS, tf.int64))
            packed.append(tf.where(pad, flat, key) if multi else key)
        self._check(checked)
        return packed, padded

    def _zeros(self, inputs, with_block: bool):
        """What ``call`` returns, as zeros: all Keras wants when it builds a functional model."""
        out = []
        for k, x in enumerate(inputs):
            ids, _ = self._ids_and_weights(x)
            m = self.calls[k]
            pools, w = self._pools[m], self._width[m]
            shape = tf.TensorShape([ids.shape[0], w]) if pools else ids.shape.concatenate([w])
            zeros = tf.zeros(tf.stack([tf.shape(ids)[0], w]) if pools else tf.concat([tf.shape(ids), [w]], 0))
            zeros.set_shape(shape)
            out.append(zeros)
        if not with_block:
            return out
        return out, [tf.stack([out[k] for k in ks], axis=1) if ks else None for ks in self.block_inputs(inputs)]

    @staticmethod
    def _ids_and_weights(x):
        ids, weights = (x[0], x[1]) if isinstance(x, (list, tuple)) else (x, None)
        return tf.cast(tf.convert_to_tensor(ids), tf.int64), weights

    def _check(self, checked: list[tuple]) -> None:
        """Stop the step if an id breaks the key rule, with ONE assertion for all inputs (one per
        input made tracing a 46-input table take seconds). ``checked``: per input (ids [n] flattened
        from [B, S], padding [n] or None, the member slot of each of its S columns)."""
        ids = tf.concat([c[0] for c in checked], 0)
        fits = (ids >= 0) & (ids <= _ID_MASK)
        if any(c[1] is not None for c in checked):
            fits |= tf.concat([tf.zeros_like(c[0], tf.bool) if c[1] is None else c[1] for c in checked], 0)
        bad = tf.where(tf.logical_not(fits))[:1, 0]                         # the first bad id, if any
        sizes = tf.stack([tf.size(c[0], tf.int64) for c in checked])
        starts = tf.cumsum(sizes, exclusive=True)
        which = tf.searchsorted(starts + sizes, bad, side="right")           # its input
        widths = [len(c[2]) for c in checked]                               # its column in that input:
        column = (bad - tf.gather(starts, which)) % tf.gather(tf.constant(widths, tf.int64), which)
        first = tf.gather(tf.constant(np.cumsum([0] + widths[:-1]), tf.int64), which)
        slot = tf.gather(tf.constant([s for c in checked for s in c[2]], tf.int64), first + column)
        tf.debugging.Assert(tf.reduce_all(fits), [
            "an id outside [0, 2**55) cannot be stored in fused table", self.name,
            "(key = field slot << 55 | id); hash ids into that range or pass fuse_tables=False. Table:",
            tf.gather(tf.constant(self.slot_names), slot), "id:", tf.gather(ids, bad)], summarize=3)

    def new_rows(self, uniq: tf.Tensor) -> tf.Tensor:
        slots = tf.bitwise.right_shift(uniq, tf.constant(ID_BITS, tf.int64))
        ids = tf.bitwise.bitwise_and(uniq, tf.constant(_ID_MASK, tf.int64))
        parts = [key_init_rows(ids, tf.gather(self._salts[:, b], slots), w, tf.gather(self._scales[:, b], slots))
                 for b, (_, w) in enumerate(self.blocks)]
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)

    # --- one member's rows, for des.graph.sources (checkpoints, snapshots, the rank-0 broadcast) --------
    def pack(self, member: int, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        bad = (ids < 0) | (ids > _ID_MASK)
        if bad.any():
            raise ValueError(f"{self.member_names[member]}: id {int(ids[bad][0])} is outside [0, 2**{ID_BITS}) and "
                             f"cannot be stored in fused table {self.name}; restore into a model built with "
                             f"fuse_tables=False")
        return ids | np.int64(self._slot[member] << ID_BITS)

    _held: dict | None = None     # within ``loading``: {id(params): {slot: keys held}}
    _pending: dict | None = None  # within ``loading``: {(id(params), slot): (params, rows, [(member, keys, values)])}

    @contextlib.contextmanager
    def loading(self):
        """Within it, ``load_member`` only records what each member's part should hold; at the end
        each slot of each table (rows or optimizer slot) is written once: one export of what the
        table holds, start rows only for the columns no member wrote, one upsert. Restoring F
        members was F exports of the whole table, and a lookup and an upsert per member of a joined
        slot. Nothing else may write the table meanwhile (des.checkpoint.restore holds it around
        its loads)."""
        self._held, self._pending = {}, {}
        try:
            yield self
            for params, rows, ops in self._pending.values():
                self._write_slot(params, rows, ops)
        finally:
            self._held = self._pending = None

    def _keys_of(self, params, member: int) -> np.ndarray:
        held = self._held
        if held is None:
            keys = params.export()[0].numpy()
            return keys[(keys >= 0) & ((keys >> ID_BITS) == self._slot[member])]
        if id(params) not in held:
            keys = params.export()[0].numpy()
            keys = keys[keys >= 0]
            slots = keys >> ID_BITS
            held[id(params)] = {int(slot): keys[slots == slot] for slot in np.unique(slots)}
        return held[id(params)].get(int(self._slot[member]), np.zeros([0], np.int64))

    def _columns(self, member: int) -> slice:
        return slice(self._start[member], self._start[member] + self._width[member])

    _exported: dict | None = None  # within ``exporting``: {what: {slot: (ids, rows)}}, each table read once

    @contextlib.contextmanager
    def exporting(self):
        """Within it, the table (and the policy's ``seen`` table, des_ops.row_policy) is exported
        once and split by slot, instead of once per member: a save of F members was F exports of the
        whole table (time F x rows, and a whole copy at a time on top of what was gathered). Nothing
        may write the table meanwhile (des.checkpoint.save holds it around its export)."""
        self._exported = {}
        try:
            yield self
        finally:
            self._exported = None

    def by_slot(self, what: str, export) -> dict:
        """{slot: (ids, rows)} of ``export()`` ((keys, values) tensors of packed keys); kept
        within ``exporting`` under ``what``, computed anew outside it."""
        if self._exported is not None and what in self._exported:
            return self._exported[what]
        keys, values = (x.numpy() for x in export())
        keep = keys >= 0
        keys, values = keys[keep], values[keep]
        order = np.argsort(keys >> ID_BITS, kind="stable")
        keys, values = keys[order], values[order]
        slots, starts = np.unique(keys >> ID_BITS, return_index=True)
        ends = list(starts[1:]) + [len(keys)]
        out = {int(slot): (keys[a:b] & _ID_MASK, values[a:b]) for slot, a, b in zip(slots, starts, ends)}
        if self._exported is not None:
            self._exported[what] = out
        return out

    def field_rows(self, member: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of member ``member``."""
        ids, rows = self.by_slot("rows", self.params.export).get(
            int(self._slot[member]), (np.zeros([0], np.int64), np.zeros([0, self.dim], np.float32)))
        return ids, rows[:, self._columns(member)]

    def member_slot_rows(self, member: int, params, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, exists) of member ``member``'s ``ids`` in ``params``, one of this table's
        optimizer slots (a missing key reads the slot's start value)."""
        found, exists = params.lookup(tf.constant(self.pack(member, ids)), return_exists=True)
        return found.numpy()[:, self._columns(member)], exists.numpy()

    def load_member(self, member: int, params, ids: np.ndarray, values: np.ndarray, rows: bool = True) -> None:
        """Make member ``member``'s part of ``params`` (this table's rows when ``rows``, else one of
        its optimizer slots) hold exactly ``ids`` -> ``values``. Members that share its slot keep their
        columns; a key new to the slot starts their columns as a lookup would (``new_rows``, or the
        slot's start value). A slot's first member decides which keys the slot holds. Within
        ``loading`` the write happens at its end, with the slot's other members' loads."""
        keys = self.pack(member, ids) if len(ids) else np.zeros([0], np.int64)
        values = np.asarray(values, np.float32).reshape(len(keys), self._width[member])
        if self._pending is not None:
            entry = self._pending.setdefault((id(params), int(self._slot[member])), (params, rows, []))
            entry[2].append((member, keys, values))
            return
        self._write_slot(params, rows, [(member, keys, values)])

    def _write_slot(self, params, rows: bool, ops: list[tuple]) -> None:
        """Apply ``load_member``'s (member, packed keys, values) ``ops`` of one slot of ``params``, in
        order, as one write: the keys the slot keeps, their rows (held, written, or where neither,
        the columns' start value), one upsert; keys it no longer holds are removed."""
        held = self._keys_of(params, ops[0][0])
        keys = held
        vals = params.lookup(tf.constant(held, tf.int64)).numpy().copy() if len(held) else \
            np.zeros([0, self.dim], np.float32)
        start = np.zeros(vals.shape, bool)                  # columns that read their start value
        for member, new_keys, new_vals in ops:
            cols = self._columns(member)
            if len(keys) == 0 and self._start[member] == 0:   # an empty slot takes the keys as they come
                keys, vals = new_keys, np.zeros([len(new_keys), self.dim], np.float32)
                start = np.ones(vals.shape, bool)
            if not np.array_equal(keys, new_keys):   # (a restore: a slot's members come with the same keys)
                if self._start[member] == 0:                # the first member: the slot holds its keys
                    kept = np.isin(keys, new_keys)
                    keys, vals, start = keys[kept], vals[kept], start[kept]
                else:                                       # the others: their columns start again
                    start[~np.isin(keys, new_keys), cols] = True
                fresh = new_keys[~np.isin(new_keys, keys)]
                keys = np.concatenate([keys, fresh])
                vals = np.concatenate([vals, np.zeros([len(fresh), self.dim], np.float32)])
                start = np.concatenate([start, np.ones([len(fresh), self.dim], bool)])
                order = np.argsort(keys, kind="stable")
                keys, vals, start = keys[order], vals[order], start[order]
                at = np.searchsorted(keys, new_keys)
            else:
                at = slice(None)
            vals[at, cols], start[at, cols] = new_vals, False
        gone = np.setdiff1d(held, keys)
        if len(gone):
            params.remove(tf.constant(gone, tf.int64))
        need = start.any(axis=1)
        if need.any() and rows:
            vals[need] = np.where(start[need], self.new_rows(tf.constant(keys[need], tf.int64)).numpy(), vals[need])
        elif need.any():              # the slot's start value: what a key never written reads
            first = params.lookup(tf.constant([np.iinfo(np.int64).min], tf.int64)).numpy()[0]
            vals[need] = np.where(start[need], first, vals[need])
        if len(keys):
            params.upsert(tf.constant(keys, tf.int64), tf.constant(vals, params.value_dtype))
        if self._held is not None:
            self._held[id(params)][int(self._slot[ops[0][0]])] = keys

    def clear_field(self, params, member: int) -> None:
        """Remove member ``member``'s rows from ``params`` (this table's rows or one of its optimizer
        slots; a joined row keeps its other members' columns)."""
        self.load_member(member, params, np.zeros([0], np.int64), np.zeros([0, self._width[member]], np.float32),
                         rows=params is self.params)

    def load_field(self, member: int, ids: np.ndarray, values: np.ndarray) -> None:
        self.load_member(member, self.params, ids, values, rows=True)

    def get_config(self):
        raise NotImplementedError("a FusedTable is built by des.transform, not from a config")


# table class -> the class of the fused table that holds its rows (des.baselines.ps.tables adds the PS's)
FUSED_CLASS: dict[type, type] = {FieldEmbedding: FusedTable}


def fusion_groups(nodes: list, join_linear: bool = False) -> dict[tuple, list]:
    """The table nodes among ``nodes`` whose rows can share one TFRA table (this project's
    FieldEmbedding and keyed TFRA Embeddings; trainable, without weight penalties, called on one
    input), grouped by (member widths of a slot, linear part or not, fused class); in graph order.
    ``join_linear``: a linear-part table and an embedding table read with exactly the same inputs
    share their keys' rows (widths (k, 1): see the module docstring), when the fused class allows."""
    fusable = []
    for n in sorted(nodes, key=lambda n: n.index):
        layer = n.layer
        if (n.kind != "table" or member_rows(layer) is None or not layer.trainable or has_weight_penalties(layer)
                or len(n.call_args) != 1 or set(n.call_kwargs) - {"training"}):
            continue
        fusable.append(n)
    partner = linear_partners(fusable) if join_linear else {}
    groups: dict[tuple, list] = {}
    for n in fusable:
        cls = FUSED_CLASS.get(type(n.layer), FusedTable)
        if id(n.layer) in partner:
            emb = partner[id(n.layer)] if linear_part(n.layer) else n.layer
            key = ((width_of(emb), width_of(partner[id(emb)])), False, cls)
        else:
            key = ((n.attrs["dim"],), linear_part(n.layer), cls)
        groups.setdefault(key, []).append(n)
    return groups


def linear_partners(nodes: list) -> dict[int, object]:
    """id(layer) -> its partner for joined rows: each linear-part table layer among ``nodes``'s
    layers and the first unpaired embedding table layer of the same kind whose calls read exactly
    the same inputs, both ways."""
    reads: dict[int, list] = {}                # id(layer) -> the operands of each of its calls
    for n in nodes:
        reads.setdefault(id(n.layer), []).append(tuple(n.tensor_operands()))
    layers = list(dict.fromkeys(n.layer for n in nodes))
    # a keyed TFRA layer's class is made per layer (des.graph.sources): compare the class it was keyed from
    cls = lambda l: type(l).__mro__[1] if getattr(type(l), "des_keyed_tfra", False) else type(l)  # noqa: E731
    kind = lambda l: (sorted(reads[id(l)]), cls(l), member_rows(l)[2])  # noqa: E731
    partner: dict[int, object] = {}
    for lin in filter(linear_part, layers):
        for emb in layers:
            if (id(emb) not in partner and not linear_part(emb) and kind(emb) == kind(lin)
                    and getattr(FUSED_CLASS.get(type(emb), FusedTable), "joins_linear", False)):
                partner[id(lin)], partner[id(emb)] = emb, lin
                break
    return partner


def tables_after_fusing(nodes: list, join_linear: bool = False) -> int:
    """How many TFRA tables the table nodes among ``nodes`` become when fused (``fuse_nodes``): one per
    fusion group, and each table layer that fuses with none."""
    groups = fusion_groups(nodes, join_linear)
    tables = {id(n.layer) for n in nodes if n.kind == "table"}
    fused = {id(n.layer) for members in groups.values() for n in members}
    return len(groups) + len(tables - fused)


def fuse_nodes(graph, nodes: list, suffix: str, join_linear: bool = False) -> tuple[list[tuple], list[str]]:
    """Move the rows of each ``fusion_groups`` group of ``nodes`` (des.graph.ir nodes of ``graph``)
    into one FusedTable per group, named ``des_fused<width>[_linear|_joined]_<suffix>``. Every member
    layer then reads and writes its rows through the fused table (des.graph.sources). Returns
    ([(table, its nodes in graph order)], one report line per table)."""
    fused, lines = [], []
    for (widths, linear, cls), members in fusion_groups(nodes, join_linear).items():
        layers = list(dict.fromkeys(m.layer for m in members))
        dim = sum(widths)
        if len(widths) > 1:             # joined: (embedding, linear weight) per slot, in that order
            partner = linear_partners(members)
            layers = [l for e in layers if not linear_part(e) for l in (e, partner[id(e)])]
            slots = [i // 2 for i in range(len(layers))]
        else:
            slots = list(range(len(layers)))
        calls = [layers.index(m.layer) for m in members]
        first: dict[tuple, int] = {}
        same_as = [first.setdefault((slots[c], tuple(m.tensor_operands())), k)
                   for k, (c, m) in enumerate(zip(calls, members))]
        kind = "_joined" if len(widths) > 1 else "_linear" if linear else ""
        table = cls(layers, calls, dim, name=f"des_fused{dim}{kind}_{suffix}", linear=linear,
                    slots=slots, same_as=same_as)
        if len(widths) > 1:
            table.shadow.des_joins_linear = True       # models.optim.LinearAndRestOptimizer refuses it
        with table.loading():                          # the new table's keys exported once, not per member
            for member, layer in enumerate(layers):
                source = next(m.attrs["source"] for m in members if m.layer is layer)
                keys, values = source.export(layer)
                source.release(layer)
                layer.des_fused = (table, member)
                source.load(layer, keys, values)       # into the fused table, under packed keys
        fused.append((table, members))
        names = [l.name for l in layers]
        what = (f"the rows of {len(layers)} table(s) of width {dim}" if len(widths) == 1 else
                f"the rows of {len(layers) // 2} field(s), embedding (width {widths[0]}) and linear weight "
                f"(width {widths[1]}) side by side")
        lines.append(f"fused table {table.name}: {what} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) "
                     f"in one TFRA table")
    return fused, lines


def fused_tables(model: tf.keras.Model) -> list[FusedTable]:
    """The fused tables among ``model``'s layers (of a model fuse_model made: one per width)."""
    return [layer for layer in model.layers if isinstance(layer, FusedTable)]

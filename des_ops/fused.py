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
no result; checkpoints still store (field, id) -> row (des.sources reads a field's rows through
``field_rows``).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from des_ops.keras_internals import has_weight_penalties
from models.layers import FieldEmbedding, key_init_rows, only_shapes_wanted, pool
from models.spec import ID_BITS, ID_MASK, PAD_ID

MAX_FIELDS = 2 ** (63 - ID_BITS)
_ID_MASK = ID_MASK


def member_rows(layer) -> tuple[int, float, bool] | None:
    """(salt, init scale, pools) of a table layer whose rows can live in a fused table, or None.
    ``pools``: it sums multi-valued ids and skips PAD_ID (FieldEmbedding), or returns ids.shape +
    [dim] (a keyed TFRA Embedding)."""
    if type(layer) in FUSED_CLASS:
        return layer.salt, layer.init_scale, True
    if getattr(layer, "des_keyed_tfra", False) and not getattr(layer, "des_squashed", False):
        return layer.des_salt, layer.des_scale, False
    return None


class FusedTable(FieldEmbedding):
    """One TFRA table for the rows of ``members`` (table layers of one width, see ``member_rows``).

    ``calls[k]`` is the member read by the k-th input of ``call`` (a table shared by two fields
    is read twice); ``call`` returns one tensor per input, what that member's own call returns."""
    des_embedding = False          # not a table of the user's graph: des.sources reads its members

    def __init__(self, members: list, calls: list[int], dim: int, name: str, linear: bool = False):
        specs = [member_rows(m) for m in members]
        if any(s is None for s in specs):
            raise ValueError(f"{name}: these tables cannot be fused: "
                             f"{[m.name for m, s in zip(members, specs) if s is None]}")
        if len(members) > MAX_FIELDS:
            raise ValueError(f"{name}: a fused table holds at most {MAX_FIELDS} tables, got {len(members)}")
        # room for what the members' own tables start with (TFRA's 8192 rows each): a table that
        # starts small rehashes as it fills, a cost the per-field tables do not pay
        super().__init__(field=name, dim=dim, name=name, linear=linear, init_capacity=8192 * len(members))
        self.member_names = [m.name for m in members]
        self.calls = list(calls)
        self._salts = np.array([s[0] for s in specs], np.int64)
        self._scales = np.array([s[1] for s in specs], np.float64)
        self._pools = [s[2] for s in specs]

    @staticmethod
    def single_inputs(inputs) -> list[int]:
        """Which inputs are one-hot (ids [B], no weights): their rows travel as one [B, S, dim] block."""
        return [k for k, x in enumerate(inputs) if not isinstance(x, (list, tuple)) and x.shape.rank == 1]

    @tf.autograph.experimental.do_not_convert   # plain TF ops: autograph would only slow tracing
    def call(self, inputs, training=None, with_block: bool = False):
        """One tensor per input; ``with_block``: and the rows of the one-hot inputs (``single_inputs``)
        as one [B, S, dim] tensor, which a stack or concatenation of them can read instead."""
        # one-hot inputs travel as one [B, S] block: a few ops whatever S is, since tracing cost
        # grows with the number of ops; the others one by one
        single = self.single_inputs(inputs)
        if only_shapes_wanted(self):
            return self._zeros(inputs, single, with_block)
        other = [k for k in range(len(inputs)) if k not in single]
        packed, padded = self.packed_keys(inputs, single, other)
        uniq, idx = tf.unique(tf.concat(packed, axis=0))
        rows = tf.gather(self.distinct_rows(uniq, training, multi_valued=padded), idx)
        parts = tf.split(rows, [tf.size(p) for p in packed])
        out, block = [None] * len(inputs), None
        if single:
            block = tf.reshape(parts[0], [-1, len(single), self.dim])
            for k, v in zip(single, tf.unstack(block, axis=1)):
                out[k] = v
        for k, part in zip(other, parts[1 if single else 0:]):
            ids, weights = self._ids_and_weights(inputs[k])
            if self._pools[self.calls[k]]:
                out[k] = pool(part, ids, weights, self.dim)
            else:
                out[k] = tf.reshape(part, tf.concat([tf.shape(ids), [self.dim]], 0))
        return (out, block) if with_block else out

    def packed_keys(self, inputs, single: list[int] | None = None, other: list[int] | None = None):
        """(the keys of every input, packed as ``slot << 55 | id`` - one-hot inputs first, as one
        tensor -, whether multi-valued padding is among them); stops the step on an id that breaks
        the key rule. ``call`` reads the rows of ``tf.unique`` of their concatenation."""
        if single is None:
            single = self.single_inputs(inputs)
            other = [k for k in range(len(inputs)) if k not in single]
        packed, checked, padded = [], [], False     # checked: (ids, padding, member slots) of every input
        if single:
            ids = tf.stack([tf.cast(inputs[k], tf.int64) for k in single], axis=1)
            checked.append((tf.reshape(ids, [-1]), None, [self.calls[k] for k in single]))
            slots = tf.constant([self.calls[k] << ID_BITS for k in single], tf.int64)
            packed.append(tf.reshape(tf.bitwise.bitwise_or(ids, slots[None, :]), [-1]))
        for k in other:
            ids, _ = self._ids_and_weights(inputs[k])
            flat, slot = tf.reshape(ids, [-1]), self.calls[k]
            multi = self._pools[slot] and ids.shape.rank == 2
            padded |= multi
            pad = (flat == PAD_ID) if multi else None
            checked.append((flat, pad, [slot]))
            key = tf.bitwise.bitwise_or(flat, tf.constant(slot << ID_BITS, tf.int64))
            packed.append(tf.where(pad, flat, key) if multi else key)
        self._check(checked)
        return packed, padded

    def _zeros(self, inputs, single: list[int], with_block: bool):
        """What ``call`` returns, as zeros: all Keras wants when it builds a functional model."""
        out = []
        for k, x in enumerate(inputs):
            ids, _ = self._ids_and_weights(x)
            pools = self._pools[self.calls[k]]
            shape = tf.TensorShape([ids.shape[0], self.dim]) if pools else ids.shape.concatenate([self.dim])
            zeros = tf.zeros(tf.stack([tf.shape(ids)[0], self.dim]) if pools else
                             tf.concat([tf.shape(ids), [self.dim]], 0))
            zeros.set_shape(shape)
            out.append(zeros)
        if not with_block:
            return out
        return out, (tf.stack([out[k] for k in single], axis=1) if single else None)

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
            tf.gather(tf.constant(self.member_names), slot), "id:", tf.gather(ids, bad)], summarize=3)

    def new_rows(self, uniq: tf.Tensor) -> tf.Tensor:
        slots = tf.bitwise.right_shift(uniq, tf.constant(ID_BITS, tf.int64))
        return key_init_rows(tf.bitwise.bitwise_and(uniq, tf.constant(_ID_MASK, tf.int64)),
                             tf.gather(self._salts, slots), self.dim, tf.gather(self._scales, slots))

    # --- one member's rows, for des.sources (checkpoints, snapshots, the rank-0 broadcast) --------
    def pack(self, slot: int, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        bad = (ids < 0) | (ids > _ID_MASK)
        if bad.any():
            raise ValueError(f"{self.member_names[slot]}: id {int(ids[bad][0])} is outside [0, 2**{ID_BITS}) and "
                             f"cannot be stored in fused table {self.name}; restore into a model built with "
                             f"fuse_tables=False")
        return ids | np.int64(slot << ID_BITS)

    def _keys_of(self, params, slot: int) -> np.ndarray:
        keys = params.export()[0].numpy()
        return keys[(keys >= 0) & ((keys >> ID_BITS) == slot)]

    def field_rows(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(ids, rows) of member ``slot``."""
        keys, values = self.params.export()
        keys, values = keys.numpy(), values.numpy()
        mine = (keys >= 0) & ((keys >> ID_BITS) == slot)
        return keys[mine] & _ID_MASK, values[mine]

    def clear_field(self, params, slot: int) -> None:
        """Remove member ``slot``'s keys from ``params`` (this table's rows or one of its optimizer slots)."""
        keys = self._keys_of(params, slot)
        if len(keys):
            params.remove(tf.constant(keys, tf.int64))

    def load_field(self, slot: int, ids: np.ndarray, values: np.ndarray) -> None:
        self.clear_field(self.params, slot)
        if len(ids):
            self.params.upsert(tf.constant(self.pack(slot, ids)), tf.constant(values, self.params.value_dtype))

    def get_config(self):
        raise NotImplementedError("a FusedTable is built by des.transform, not from a config")


# table class -> the class of the fused table that holds its rows (des.baselines.ps.tables adds the PS's)
FUSED_CLASS: dict[type, type] = {FieldEmbedding: FusedTable}


def fusion_groups(nodes: list) -> dict[tuple, list]:
    """The table nodes among ``nodes`` whose rows can share one TFRA table (this project's
    FieldEmbedding and keyed TFRA Embeddings; trainable, without weight penalties, called on one
    input), grouped by (width, linear part or not, fused class); in graph order."""
    groups: dict[tuple, list] = {}
    for n in sorted(nodes, key=lambda n: n.index):
        layer = n.layer
        if (n.kind != "table" or member_rows(layer) is None or not layer.trainable or has_weight_penalties(layer)
                or len(n.call_args) != 1 or set(n.call_kwargs) - {"training"}):
            continue
        linear = bool(getattr(layer.shadow, "des_linear_part", False))
        groups.setdefault((n.attrs["dim"], linear, FUSED_CLASS.get(type(layer), FusedTable)), []).append(n)
    return groups


def tables_after_fusing(nodes: list) -> int:
    """How many TFRA tables the table nodes among ``nodes`` become when fused (``fuse_nodes``): one per
    fusion group, and each table layer that fuses with none."""
    groups = fusion_groups(nodes)
    tables = {id(n.layer) for n in nodes if n.kind == "table"}
    fused = {id(n.layer) for members in groups.values() for n in members}
    return len(groups) + len(tables - fused)


def fuse_nodes(graph, nodes: list, suffix: str) -> tuple[list[tuple], list[str]]:
    """Move the rows of each ``fusion_groups`` group of ``nodes`` (des.ir nodes of ``graph``)
    into one FusedTable per group, named ``des_fused<width>[_linear]_<suffix>``. Every member layer
    then reads and writes its rows through the fused table (des.sources). Returns
    ([(table, its nodes in graph order)], one report line per table)."""
    fused, lines = [], []
    for (dim, linear, cls), members in fusion_groups(nodes).items():
        layers = list(dict.fromkeys(m.layer for m in members))
        table = cls(layers, [layers.index(m.layer) for m in members], dim,
                    name=f"des_fused{dim}{'_linear' if linear else ''}_{suffix}", linear=linear)
        for slot, layer in enumerate(layers):
            source = next(m.attrs["source"] for m in members if m.layer is layer)
            keys, values = source.export(layer)
            source.release(layer)
            layer.des_fused = (table, slot)
            source.load(layer, keys, values)           # into the fused table, under packed keys
        fused.append((table, members))
        names = [l.name for l in layers]
        lines.append(f"fused table {table.name}: the rows of {len(layers)} table(s) of width {dim} "
                     f"({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) in one TFRA table")
    return fused, lines


def fused_tables(model: tf.keras.Model) -> list[FusedTable]:
    """The fused tables among ``model``'s layers (of a model fuse_model made: one per width)."""
    return [layer for layer in model.layers if isinstance(layer, FusedTable)]

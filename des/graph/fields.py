"""Field vectors and their layouts: what the rules read instead of the user's spelling.

A **field vector** is a tensor that depends on exactly one table and whose per-sample value
is one K-vector ([B, K], [B, 1, K], [B] for K = 1, ...). Everything computing it from the
model inputs is its ``chain``: preprocessing of ids (Hashing, StringLookup, tf ops), the
lookup, a pooling of multi-valued ids (reduce_sum / reduce_mean / GlobalAveragePooling1D
with the layer's mask), reshapes. The owner of the field replays the chain; nobody else
computes it.

A **layout** says how field vectors (and other tensors) are arranged in a tensor:

- ``stack``:  [B, F, K], one field per row: tf.stack(v, 1), Concatenate(axis=1) of [B,1,K];
- ``concat``: fields side by side on the last axis: Concatenate(), tf.concat(v, -1),
  Flatten / Reshape of a stack, concat of concats, with unit axes anywhere else.

    >>> import models
    >>> from des.data import FeatureSpec, Field
    >>> from des.graph.ir import Graph
    >>> graph = Graph(models.deepfm(FeatureSpec(tuple(Field(f"C{i}", dim=4) for i in range(1, 6)))))
    >>> t = next(n.output for n in graph.nodes if n.kind == "stack")     # the FM's [B, F, K] input
    >>> fa = FieldAnalysis(graph)
    >>> fa.layout(t).form, [v.field for v in fa.layout(t).vectors]
    ('stack', ['C1', 'C2', ...])
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import numpy as np
import tensorflow as tf

from des.graph.ir import Graph, Node, TensorId, all_keras_tensors
from des_ops.keras_internals import SEPARABLE_PENALTIES

GLUE = {"stack", "concat", "reshape", "flatten", "squeeze", "expand_dims", "identity"}


@dataclasses.dataclass(eq=False)
class FieldVector:
    tensor: int                 # the vector's tensor id
    table: Node                 # the table node it reads
    field: str                  # ownership unit: the ids input the table reads (or the layer's field)
    width: int                  # K: floats per sample
    chain: frozenset            # node indices computing it from the model inputs (table included)
    key_range: tuple | None = None   # (start, stop): one position of a table split by key range, its keys
    key_stripe: tuple | None = None  # (r, N): the keys k mod N == r of a table split by key stripe, every position

    @property
    def key(self) -> str:
        return self.table.layer.name

    @property
    def unstriped_field(self) -> str:
        """The field a key stripe's vector ``<field>%r`` belongs to (else its own)."""
        return self.field.rsplit("%", 1)[0] if self.key_stripe is not None else self.field


@dataclasses.dataclass(eq=False)
class Part:
    """One block of a layout: a field vector, or another tensor (``vector`` None)."""
    vector: FieldVector | None
    tensor: int
    width: int                  # concat: its width on the last axis; stack: rows (1 per field)


@dataclasses.dataclass(eq=False)
class Layout:
    form: str                   # "vec", "stack" or "concat"
    parts: list[Part]
    glue: set[int]              # node indices of the stack/concat/reshape nodes

    @property
    def vectors(self) -> list[FieldVector]:
        return [p.vector for p in self.parts if p.vector is not None]

    @property
    def others(self) -> list[Part]:
        return [p for p in self.parts if p.vector is None]


def per_sample(graph: Graph, t: int) -> tuple | None:
    dims = tuple(graph.shape(t)[1:])
    return None if any(d is None for d in dims) else dims


def _several_rows(dims: tuple) -> bool:
    """A per-sample shape holding several looked-up rows ([P, K] with P > 1), not one vector."""
    return len(dims) > 1 and any(d > 1 for d in dims[:-1])


def _row(dims: tuple) -> bool:
    """A per-sample shape that is one row vector: every axis but the last is 1."""
    return all(d == 1 for d in dims[:-1])


def _stochastic_or_batchwise(layer) -> bool:
    """A layer whose output for a sample may differ between two samples with the same input."""
    kinds = (tf.keras.layers.Dropout, tf.keras.layers.GaussianNoise, tf.keras.layers.GaussianDropout,
             tf.keras.layers.AlphaDropout, tf.keras.layers.BatchNormalization)
    inner = [m for m in getattr(layer, "submodules", ()) if isinstance(m, tf.keras.layers.Layer)]
    return any(isinstance(x, kinds) for x in [layer, *inner])


class FieldAnalysis:
    """Memoised questions about a Graph's tables: cones, field vectors, layouts."""

    def __init__(self, graph: Graph):
        self.graph = graph
        self.cone = lru_cache(maxsize=None)(self._cone)
        self.vector = lru_cache(maxsize=None)(self._vector)
        self.layout = lru_cache(maxsize=None)(self._layout)
        self._groups = lru_cache(maxsize=None)(self._groups)

    def _cone(self, t: int) -> frozenset:
        """Node indices computing tensor t (inputs included)."""
        n = self.graph.producer.get(t)
        if n is None:
            return frozenset()
        out = {n.index}
        for o in self._inputs_of(n):
            out |= self.cone(o)
        return frozenset(out)

    def _inputs_of(self, n: Node) -> list[int]:
        return list(dict.fromkeys([*n.tensor_operands(), *(TensorId(id(x)) for x in
                                                            all_keras_tensors((n.call_args, n.call_kwargs)))]))

    def tables(self, t: int) -> list[Node]:
        return [self.graph.nodes[i] for i in sorted(self.cone(t)) if self.graph.nodes[i].kind == "table"]

    def _vector(self, t: int) -> FieldVector | None:
        g = self.graph
        n = g.producer.get(t)
        if n is None or n.kind == "input" or not isinstance(t, int):
            return None
        tables = self.tables(t)
        dims = per_sample(g, t)
        if len(tables) != 1 or dims is None or (dims and not _row(dims)):
            return None
        chain = frozenset(i for i in self.cone(t) if g.nodes[i].kind != "input")
        if self.unpooled_positions(chain) is not None or self.offset_fields(tables[0]):
            return None
        for i in chain:                  # a weight shared with anything else cannot move to an owner
            node = g.nodes[i]
            if node.layer.weights and g.layer_calls(node.layer) != 1 and node.kind != "table":
                return None
        table = tables[0]
        return FieldVector(t, table, self.field_of(table), dims[-1] if dims else 1, chain)

    def field_of(self, table: Node) -> str:
        """The ownership unit of a table node: its field (the layer's declared field, or the ids
        input it reads); where a table is shared by several fields (user_id and target_user_id
        read one Embedding), the group of every field that reads it, e.g. 'user_id+target_user_id':
        one process must own every row of a table, so it owns every field that reads it."""
        base = self._base_field(table)
        return self._groups().get(base, base)

    def _base_field(self, table: Node) -> str:
        return table.attrs.get("field") or self.ids_input(table)

    def _groups(self) -> dict[str, str]:
        """Field -> its group's name, for fields that share a table with another field."""
        parent: dict[str, str] = {}

        def root(f: str) -> str:
            while parent.get(f, f) != f:
                f = parent[f]
            return f
        by_layer: dict[int, list[str]] = {}
        order: list[str] = []
        for n in self.graph.nodes:
            if n.kind == "table":
                f = self._base_field(n)
                by_layer.setdefault(id(n.layer), []).append(f)
                order += [f] if f not in order else []
        for fs in by_layer.values():
            for f in fs[1:]:
                a, b = root(fs[0]), root(f)
                if a != b:
                    parent[b] = a
        members: dict[str, list[str]] = {}
        for f in order:
            members.setdefault(root(f), []).append(f)
        return {f: "+".join(fs) for fs in members.values() if len(fs) > 1 for f in fs}

    def unpooled_positions(self, chain) -> Node | None:
        """The reshape/flatten in ``chain`` that lays several looked-up rows of one table side by
        side ([B, P, K] -> [B, P*K]), or None. Such a tensor is P fields of one table (ids plus
        per-field offsets, as in DLRM ports), not one field's vector."""
        for i in sorted(chain):
            node = self.graph.nodes[i]
            if node.kind not in ("reshape", "flatten") or not node.tensor_operands():
                continue
            before, after = per_sample(self.graph, node.tensor_operands()[0]), per_sample(self.graph, node.output)
            if before and after and _several_rows(before) and after[-1] > before[-1]:
                return node
        return None

    def offset_fields(self, table: Node) -> int:
        """P > 1 when the table's ids are ``ids + offsets`` with a constant offset per position
        (one table holding P fields as P key ranges: DLRM / pytorch-fm ports), else 0."""
        ops = table.tensor_operands()
        for i in sorted(self.cone(ops[0])) if ops else []:
            node = self.graph.nodes[i]
            if node.kind != "add":
                continue
            for o in node.operands:
                if isinstance(o, TensorId) or not hasattr(o, "shape"):
                    continue
                c = np.asarray(o)
                if c.ndim >= 1 and c.shape[-1] > 1 and len(np.unique(c.reshape(-1, c.shape[-1]), axis=1)[0]) > 1:
                    return int(c.shape[-1])
        return 0

    def offset_ranges(self, table: Node) -> tuple[tuple[int, int], ...] | str:
        """The key range [start, stop) of each position of a table read as ``table(ids + offsets)``
        (DLRM / pytorch-fm ports: ids [B, P], one constant offset per position, P > 1), in position
        order: the table holds P fields as P disjoint key ranges, so each range can live with its
        own owner. A static Keras Embedding of ``input_dim`` V: position f holds the keys from its
        offset to the next larger offset (the largest: to V). Or why the table cannot be split so."""
        name = table.layer.name
        if self.graph.layer_calls(table.layer) != 1:
            return f"{name!r} is called more than once"
        if self.graph.dtype(table.output) != tf.float32:
            return f"{name!r} gives {self.graph.dtype(table.output).name} rows, not float32"
        ops = table.tensor_operands()
        add = self.graph.producer.get(ops[0]) if len(ops) == 1 else None
        if add is None or add.kind != "add":
            return f"{name!r} does not read ids + offsets directly"
        consts = [np.asarray(o) for o in add.operands if not isinstance(o, TensorId) and hasattr(o, "shape")]
        if len(consts) != 1 or len(add.tensor_operands()) != 1:
            return f"{add.layer.name!r} is not ids + one constant"
        offsets = consts[0].reshape(-1) if consts[0].ndim <= 2 and consts[0].shape[:-1] in ((), (1,)) else None
        dims = per_sample(self.graph, ops[0])
        if offsets is None or dims != (len(offsets),) or per_sample(self.graph, table.output) != (len(offsets), table.attrs["dim"]):
            return f"{name!r} reads ids of per-sample shape {dims} plus offsets of shape {consts[0].shape}, not [P] + [P]"
        source = table.attrs["source"]
        if source.dynamic or not isinstance(table.layer, tf.keras.layers.Embedding):
            return f"{name!r} is a {source.name}: only a Keras Embedding is split by key range"
        layer = table.layer
        if (layer.embeddings_regularizer is not None or layer.embeddings_constraint is not None or layer.mask_zero
                or layer.activity_regularizer is not None or not layer.trainable):
            return f"{name!r} has a regularizer, a constraint, a mask or frozen rows"
        rows = int(layer.input_dim)
        starts = sorted(set(int(o) for o in offsets))
        if len(starts) != len(offsets) or starts[0] < 0 or starts[-1] >= rows:
            return f"{name!r}: offsets {offsets.tolist()} are not distinct keys of its {rows} rows"
        stop = dict(zip(starts, starts[1:] + [rows]))
        return tuple((int(o), stop[int(o)]) for o in offsets)

    def stripe_positions(self, table: Node) -> int | str:
        """P > 1 when one call of ``table`` looks up P ids a sample in one key space that no field
        owns - ids [B, P] read straight into it, or ``ids + offsets`` into a TFRA table (a Keras one
        goes by key range) - so it can be split by key stripe (des_ops.stripes): every process
        holds the keys k mod N == its rank. Or why it cannot."""
        name, g = table.layer.name, self.graph
        if g.layer_calls(table.layer) != 1:
            return f"{name!r} is called more than once"
        if g.dtype(table.output) != tf.float32:
            return f"{name!r} gives {g.dtype(table.output).name} rows, not float32"
        ops = table.tensor_operands()
        dims = per_sample(g, ops[0]) if len(ops) == 1 else None
        if dims is None or len(dims) != 1 or dims[0] < 2 or not g.tensors[ops[0]].dtype.is_integer:
            return f"{name!r} does not look up a fixed number (> 1) of integer ids a sample"
        if per_sample(g, table.output) != (dims[0], table.attrs["dim"]):
            return f"{name!r} gives rows of per-sample shape {per_sample(g, table.output)}"
        return self.stripe_kind(table) or int(dims[0])

    @staticmethod
    def stripe_kind(table: Node, penalty: bool = False) -> str | None:
        """Why the layer of ``table`` cannot be split by key stripe (des_ops.stripes), or None: a TFRA
        Embedding, or a Keras Embedding without a regularizer, constraint, mask or frozen rows
        (``penalty``: an L1/L2 regularizer allowed, a sum over rows each stripe holds its share of)."""
        name, source, layer = table.layer.name, table.attrs["source"], table.layer
        if source.name == "TFRA Embedding" and type(layer).__name__ != "SquashedEmbedding" and \
                not any(c.__name__ == "SquashedEmbedding" for c in type(layer).__mro__):
            return None
        if source.name == "FieldEmbedding":     # des.train's tables (models.layers): TFRA ones with keyed new rows
            return None
        if not isinstance(layer, tf.keras.layers.Embedding) or source.dynamic:
            return f"{name!r} is a {source.name}: only a Keras or TFRA Embedding is split by key stripe"
        regularized = layer.embeddings_regularizer is not None and not (
            penalty and isinstance(layer.embeddings_regularizer, SEPARABLE_PENALTIES))
        if (regularized or layer.embeddings_constraint is not None or layer.mask_zero
                or layer.activity_regularizer is not None or not layer.trainable):
            return f"{name!r} has a regularizer, a constraint, a mask or frozen rows"
        return None

    def position_keys(self, table: Node) -> list[str | None] | None:
        """Each position's key of a table that looks up P ids a sample, for des_ops.rows.key_ids: when
        its ids (``ids`` or ``ids + offsets``) come straight from model inputs, ``<input>[f]`` (one [B, P]
        integer input) or ``<input f>`` (a tf.stack of one-id integer inputs; None for a part that is
        not one), with ``+<offset>`` for ids + offsets; None when they come from neither."""
        g = self.graph
        ids = table.tensor_operands()[0]
        node, offsets = g.producer.get(ids), None
        if node is not None and node.kind == "add" and len(node.tensor_operands()) == 1:
            consts = [np.asarray(o) for o in node.operands if not isinstance(o, TensorId) and hasattr(o, "shape")]
            if len(consts) != 1 or not np.issubdtype(consts[0].dtype, np.integer):
                return None
            ids = node.tensor_operands()[0]
            node, offsets = g.producer.get(ids), np.broadcast_to(consts[0].reshape(-1), per_sample(g, ids) or ())
        plus = (lambda f: f"+{int(offsets[f])}") if offsets is not None else (lambda f: "")
        if node is not None and node.kind == "stack" and node.attrs.get("axis") in (1, -1):
            def one_id(o) -> bool:
                part = g.producer.get(o)
                return part is not None and part.kind == "input" and g.tensors[o].dtype.is_integer and \
                    per_sample(g, o) == ()
            return [g.input_name(o) + plus(f) if one_id(o) else None for f, o in enumerate(node.tensor_operands())]
        dims = per_sample(g, ids)
        if node is None or node.kind != "input" or not g.tensors[ids].dtype.is_integer or dims is None or len(dims) != 1:
            return None
        return [f"{g.input_name(ids)}[{f}]" + plus(f) for f in range(dims[0])]

    def stripe_keys(self, table: Node) -> list[str] | None:
        """Each position's key of a table split by key stripe when every position has one
        (position_keys), else None."""
        keys = self.position_keys(table)
        return keys if keys and all(keys) else None

    def row_key(self, v: FieldVector) -> str | None:
        """The model input whose value alone decides vector ``v``'s value in a sample - one id per
        sample (integer or string), the only input its chain reads, through layers that neither
        draw random numbers nor look at other samples - or None. Samples with the same id have
        the same vector, so a rows exchange sends it once (des_ops.rows.Block). A position of a
        table split by key range: _position_key."""
        if v.key_range is not None:
            return self._position_key(v)
        g = self.graph
        if v.key_stripe is not None:
            # a field too big for one owner, its one id a sample looked up as it comes (des.compiler.big_tables):
            # its own keys' rows once per distinct id, one zero row for the others (des_ops.rows.key_ids).
            # After any preprocessing (ids * 4, a hashing) the ids' stripe is not the keys': no key, the rows
            # go once per sample. A table of several positions: keyed per position (stripe_keys)
            ops = v.table.tensor_operands()
            if len(ops) != 1 or ops[0] not in g.input_ids or per_sample(g, ops[0]) not in ((), (1,)) or \
                    not g.tensors[ops[0]].dtype.is_integer:
                return None
            return f"{g.input_name(ops[0])}@{v.key_stripe[0]}/{v.key_stripe[1]}"
        inputs = [i for i in self.cone(v.tensor) if g.nodes[i].kind == "input"]
        if len(inputs) != 1:
            return None
        t = g.nodes[inputs[0]].output
        dtype = g.tensors[t].dtype
        if per_sample(g, t) not in ((), (1,)) or not (dtype.is_integer or dtype == "string"):
            return None
        if any(_stochastic_or_batchwise(g.nodes[i].layer) for i in v.chain):
            return None
        return g.input_name(t)

    def _position_key(self, v: FieldVector) -> str | None:
        """A position f of ``table(ids + offsets)``: its row is decided by the ids at f alone, so when
        those come straight from a model input, its position key (position_keys) without the offset:
        ``<input>[f]`` or ``<input f>``; else None."""
        ranges = self.offset_ranges(v.table)
        if isinstance(ranges, str) or v.key_range not in ranges:
            return None
        keys = self.position_keys(v.table)
        if keys is None or len(keys) != len(ranges):
            return None
        key = keys[ranges.index(v.key_range)]
        return key.split("+")[0] if key is not None else None

    def ids_input(self, table: Node) -> str:
        """The model input a table's ids come from (the first, if several)."""
        first = table.tensor_operands()[0] if table.tensor_operands() else None
        names = [self.graph.nodes[i].layer.name for i in sorted(self.cone(first)) if
                 self.graph.nodes[i].kind == "input"] if first is not None else []
        return names[0] if names else table.layer.name

    def _layout(self, t: int) -> Layout | None:
        g = self.graph
        v = self.vector(t)
        if v is not None:
            return Layout("vec", [Part(v, t, v.width)], set())
        n = g.producer.get(t)
        dims = per_sample(g, t)
        if n is None or n.kind not in GLUE or dims is None:
            return None
        ops = n.tensor_operands()
        if n.kind == "stack" and n.attrs.get("axis") == 1 and len(dims) == 2:
            return self._join("stack", n, [self._stack_part(o, as_rows=False) for o in ops])
        if n.kind == "concat" and len(dims) == 2 and n.attrs.get("axis") == 1:
            return self._join("stack", n, [self._stack_part(o, as_rows=True) for o in ops])
        if n.kind == "concat" and n.attrs.get("axis") == len(dims) and _row(dims):
            parts = []
            for o in ops:
                inner = self.layout(o)
                od = per_sample(g, o)
                if inner is not None and inner.form in ("vec", "concat"):
                    parts.append(inner)
                elif od is not None and _row(od):
                    parts.append(Layout("other", [Part(None, o, od[-1])], set()))
                else:
                    return None
            merged = Layout("concat", [p for x in parts for p in x.parts], {n.index}.union(*(x.glue for x in parts)))
            return merged if merged.vectors else None
        if n.kind == "identity" and len(ops) == 1:
            inner = self.layout(ops[0])
            return None if inner is None else Layout(inner.form, inner.parts, inner.glue | {n.index})
        if n.kind in ("reshape", "flatten", "squeeze", "expand_dims") and len(ops) == 1 and _row(dims):
            inner = self.layout(ops[0])
            if inner is None:
                return None
            if inner.form == "concat":
                return Layout("concat", inner.parts, inner.glue | {n.index})
            if inner.form == "stack" and len(inner.others) == 0:
                k = {p.vector.width for p in inner.parts}
                if len(k) == 1 and dims[-1] == len(inner.parts) * k.pop():
                    return Layout("concat", [Part(p.vector, p.tensor, p.vector.width) for p in inner.parts],
                                  inner.glue | {n.index})
        return None

    def _stack_part(self, o: int, as_rows: bool) -> Layout:
        od = per_sample(self.graph, o)
        v = self.vector(o)
        if v is not None and od is not None and (len(od) == 2 if as_rows else len(od) == 1):
            return Layout("vec", [Part(v, o, 1)], set())
        inner = self.layout(o) if as_rows else None
        if inner is not None and inner.form == "stack":
            return inner
        return Layout("other", [Part(None, o, od[0] if od else 1)], set())

    def _join(self, form: str, n: Node, parts: list[Layout]) -> Layout | None:
        merged = Layout(form, [p for x in parts for p in x.parts], {n.index}.union(*(x.glue for x in parts)))
        return merged if merged.vectors else None

    def why_not(self, t: int) -> str:
        """Why tensor t is not a layout of field vectors (for reports)."""
        g = self.graph
        n = g.producer.get(t)
        if n is None:
            return "it is not computed by a layer"
        tables = self.tables(t)
        if not tables:
            return f"{n.layer.name!r} reads no table"
        if n.kind not in GLUE and len(tables) > 1:
            return (f"{n.layer.name!r} ({n.kind}) mixes {len(tables)} tables before the operator; "
                    f"only stack/concat/reshape may sit between field vectors and the operator")
        dims = per_sample(g, t)
        if len(tables) == 1:
            table = tables[0]
            looked = per_sample(g, table.output) or ()
            if _several_rows(looked) and (
                    self.unpooled_positions(self.cone(t)) is not None or n is table or dims == looked):
                return (f"table {table.layer.name!r} looks up {int(np.prod(looked[:-1]))} ids per sample and "
                        f"{n.layer.name!r} uses them unpooled: one table holding several fields (ids + per-field "
                        f"offsets, as in DLRM ports) is split by key range and its rows sent (field_rows), not "
                        f"split into partials; give each field its own table for that")
            return f"{n.layer.name!r} has per-sample shape {dims}, not one vector per sample"
        return f"{n.layer.name!r} ({n.kind}, per-sample shape {dims}) is not a stack or concatenation of field vectors"

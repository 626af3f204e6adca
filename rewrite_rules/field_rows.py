"""Field rows: every table no other rule splits is still sharded by field. For a table whose
vectors feed a layer no rule splits (DCN's Cross, xDeepFM's CIN, AutoInt's attention, PNN's
products, MMoE's gates, ...), the table's owner computes the field vector on the whole batch
and the fused allreduce hands it to every process (the other processes add zeros: exact); the
reader and everything after it run replicated on it, and the identity gradient gives the owner
its rows' gradient. Moves B x K floats a step per field.

It is a fallback, not tried node by node: search.find_substitutions runs it after the other
rules, on the tables left whole. One match per field vector, rooted at the node that makes it.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from des.graph.fields import FieldAnalysis, FieldVector, per_sample
from des.graph.ir import Graph, Node
from des_ops.suboperators import FieldRowsSubOp, KeyRangeRowsSubOp, StripeRowsSubOp
from rewrite_rules.base import Match, Rejection, Reshaped, Rule, check_vectors, register

NAME = "field_rows"


def widest_vector(graph: Graph, fields: FieldAnalysis, table: Node) -> FieldVector | str:
    """What the readers of one call of a table see, as one block of the field's rows: the lookup
    followed through what keeps it this table's alone (reshapes, a pooling of multi-valued ids)
    as long as one node reads it. A field vector, or the unpooled rows of a sequence ([B, L, K],
    DIN's behaviour history) or of a table holding several fields through offsets ([B, F, K],
    DLRM): one owner computes them all. Or why there is none."""
    def alone(t) -> bool:
        return [n.index for n in fields.tables(t)] == [table.index]

    t = table.output
    while True:
        users = graph.consumers.get(t, [])
        if len(users) != 1 or t in graph.output_ids or len(users[0].outputs) != 1 or not alone(users[0].output):
            break
        if fields.vector(t) is not None and fields.vector(users[0].output) is None:
            break                          # a vector stays a vector until its reader
        t = users[0].output
    v = fields.vector(t)
    return v if v is not None else _rows_block(graph, fields, table, t)


def _rows_block(graph: Graph, fields: FieldAnalysis, table: Node, t) -> FieldVector | str:
    """Tensor t of one table's rows, more than one vector a sample, as a block its owner sends."""
    dims = per_sample(graph, t)
    if dims is None:
        return f"{graph.producer[t].layer.name!r} has no static per-sample shape {tuple(graph.shape(t))}"
    if getattr(graph.tensors[t], "_keras_mask", None) is not None and masking_ids(graph, table, t) is None:
        return f"{graph.producer[t].layer.name!r} carries a Keras mask that is not its table's of a model input"
    chain = frozenset(i for i in fields.cone(t) if graph.nodes[i].kind != "input")
    for i in chain:                        # a weight shared with anything else cannot move to an owner
        node = graph.nodes[i]
        if node.layer.weights and graph.layer_calls(node.layer) != 1 and node.kind != "table":
            return f"{node.layer.name!r} in its chain is also called elsewhere"
    return FieldVector(t, table, fields.field_of(table), int(np.prod(dims)), chain)


def masking_ids(graph: Graph, table: Node, t) -> int | None:
    """The model input whose ids make the Keras mask of tensor t (an Embedding with mask_zero
    looking up a model input directly), or None. The finish remakes the mask from it."""
    ops = table.tensor_operands()
    if t != table.output or len(ops) != 1 or ops[0] not in graph.input_ids:
        return None
    return ops[0]


class MaskedRows(tf.keras.layers.Layer):
    """The combined rows with the Keras mask their table makes of the ids (``table.compute_mask``),
    as the table's own output carries it for the layers that read it."""

    def __init__(self, table, **kwargs):
        super().__init__(**kwargs)
        self._mask_of = table.compute_mask     # a method, not the layer: its weights stay the owner's

    def call(self, inputs):
        return inputs[0]

    def compute_mask(self, inputs, mask=None):
        return self._mask_of(inputs[1])


@register(priority=0)
class FieldRowsRule(Rule):
    name = NAME
    stripes_exact = True
    fallback = True                     # not tried at every node: see gather_left

    def match(self, graph, fields, node):
        return None

    def finish(self, match: Match, combined, look):
        """The vector in its own shape; named by the call when the table is called several times."""
        out = Reshaped(match.out_shape, name=f"des_{NAME}_{match.data['name']}_out")(combined)
        if match.data.get("mask_ids") is not None:
            out = MaskedRows(match.vectors[0].table.layer, name=f"des_{NAME}_{match.data['name']}_mask")(
                [out, look(match.data["mask_ids"])])
        return out

    def sub_operator(self, match: Match, owned: list[FieldVector], name: str):
        if "stripes" in match.data:
            stripe = owned[0].key_stripe[0] if owned else -1
            count, width = match.data.get("stripe_shape", match.out_shape)    # a big field's: one row (big_tables)
            return StripeRowsSubOp([v.field for v in owned], stripe=stripe, stripes=match.data["stripes"],
                                   count=count, width=width, name=name, source=match.root.layer.name,
                                   table=f"table{match.vectors[0].table.index}")
        if "ranges" in match.data:
            return KeyRangeRowsSubOp([v.field for v in owned], positions=[match.vectors.index(v) for v in owned],
                                     count=len(match.vectors), width=match.vectors[0].width, name=name,
                                     source=match.root.layer.name)
        return FieldRowsSubOp([v.field for v in owned], width=match.vectors[0].width, name=name,
                              source=match.root.layer.name)


def gather_left(graph: Graph, fields: FieldAnalysis, matches: list[Match],
                stripes: int = 1) -> tuple[list[Match], list[Rejection]]:
    """A field_rows match for every call of a table that ``matches`` leave whole, or a rejection
    saying why it cannot be one (then the table stays whole on every process). With ``stripes``
    N > 1 processes, a table that holds several fields in one key space is split by key stripe."""
    inside = set().union(*(m.nodes for m in matches))
    found, rejected = [], []
    for n in graph.nodes:
        if n.kind != "table" or n.index in inside:
            continue
        ranges = fields.offset_ranges(n)
        if not isinstance(ranges, str):
            found.append(_by_key_range(graph, fields, n, ranges))
            continue
        positions = fields.stripe_positions(n) if stripes > 1 else "one process"
        if not isinstance(positions, str):
            found.append(_by_stripes(graph, fields, n, positions, stripes))
            continue
        v = widest_vector(graph, fields, n)
        root = graph.producer.get(v.tensor) if isinstance(v, FieldVector) else n
        why = v if isinstance(v, str) else check_vectors(graph, [v])
        if why:
            rejected.append(Rejection(NAME, n, why))
            continue
        name = root.layer.name if graph.layer_calls(root.layer) == 1 else f"{root.layer.name}_{root.index}"
        masked = getattr(graph.tensors[v.tensor], "_keras_mask", None) is not None
        found.append(Match(NAME, root, [v], {root.index}, out_shape=tuple(graph.shape(root.output)[1:]),
                           data={"name": name, "mask_ids": masking_ids(graph, n, v.tensor) if masked else None}))
    return found, rejected


def _by_key_range(graph: Graph, fields: FieldAnalysis, table: Node, ranges: tuple) -> Match:
    """A table holding P fields as key ranges (ids + offsets, DLRM ports; FieldAnalysis.offset_ranges):
    its [B, P, K] lookup as P field vectors, position f named ``<ids input>[f]`` and owned by the
    owner of that field, who keeps the rows of its range only (des_ops.ranges.RangeEmbedding) and
    sends its positions' rows; the sum over processes is the whole [B, P, K] lookup."""
    t, dim = table.output, int(table.attrs["dim"])
    chain = frozenset(i for i in fields.cone(t) if graph.nodes[i].kind != "input")
    names = _position_names(graph, fields, table, len(ranges))
    vectors = [FieldVector(t, table, name, dim, chain, key_range=r) for name, r in zip(names, ranges)]
    return Match(NAME, table, vectors, {table.index}, out_shape=(len(ranges), dim),
                 data={"name": table.layer.name, "mask_ids": None, "ranges": ranges})


def _by_stripes(graph: Graph, fields: FieldAnalysis, table: Node, count: int, stripes: int) -> Match:
    """A table that holds several fields in one key space (des.graph.fields.stripe_positions): its
    [B, P, K] lookup as one vector per process, field ``<ids input>%r`` (rank r's keys: k mod N == r), each
    the lookup of that process's keys, zeros elsewhere (des_ops.stripes); their sum is the lookup."""
    t, dim = table.output, int(table.attrs["dim"])
    chain = frozenset(i for i in fields.cone(t) if graph.nodes[i].kind != "input")
    base = fields.field_of(table)
    vectors = [FieldVector(t, table, f"{base}%{r}", count * dim, chain, key_stripe=(r, stripes))
               for r in range(stripes)]
    return Match(NAME, table, vectors, {table.index}, out_shape=(count, dim),
                 data={"name": table.layer.name, "mask_ids": None, "stripes": stripes,
                       "stripe_keys": fields.stripe_keys(table)})


def _position_names(graph: Graph, fields: FieldAnalysis, table: Node, count: int) -> list[str]:
    """The field name of each position of ids + offsets: the model input it comes from where the
    ids are a tf.stack of one input per position (so a field's other tables go with it), else
    ``<ids input>[f]``."""
    add = graph.producer[table.tensor_operands()[0]]
    ids = graph.producer.get(add.tensor_operands()[0])
    if ids is not None and ids.kind == "stack" and ids.attrs.get("axis") in (1, -1) and \
            len(ids.tensor_operands()) == count:
        names = []
        for o in ids.tensor_operands():
            inputs = [graph.nodes[i].layer.name for i in sorted(fields.cone(o)) if graph.nodes[i].kind == "input"]
            names.append(inputs[0] if len(inputs) == 1 else None)
        if all(names) and len(set(names)) == count:
            return names
    base = fields.field_of(table)
    return [f"{base}[{f}]" for f in range(count)]

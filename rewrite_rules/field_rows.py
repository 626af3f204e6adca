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

from des.graph.fields import FieldAnalysis, FieldVector
from des.graph.ir import Graph, Node
from des_ops.suboperators import FieldRowsSubOp
from rewrite_rules.base import Match, Rejection, Reshaped, Rule, check_vectors, register

NAME = "field_rows"


def widest_vector(graph: Graph, fields: FieldAnalysis, table: Node) -> FieldVector | str:
    """The field vector of one call of a table that its readers see: the lookup followed
    through what keeps it one table's vector (reshapes, a pooling of multi-valued ids) as long
    as one node reads it; or why there is none."""
    t = table.output
    while True:
        users = graph.consumers.get(t, [])
        if len(users) == 1 and t not in graph.output_ids and len(users[0].outputs) == 1:
            nxt = users[0].output
            if [n.index for n in fields.tables(nxt)] == [table.index] and fields.vector(nxt) is not None:
                t = nxt
                continue
            if fields.vector(t) is None and [n.index for n in fields.tables(nxt)] == [table.index]:
                t = nxt                    # [B, L, K] rows on the way to a pooling
                continue
        v = fields.vector(t)
        return v if v is not None else f"its lookup is not one vector per sample: {fields.why_not(t)}"


@register(priority=0)
class FieldRowsRule(Rule):
    name = NAME
    fallback = True                     # not tried at every node: see gather_left

    def match(self, graph, fields, node):
        return None

    def finish(self, match: Match, combined, look):
        """The vector in its own shape; named by the call when the table is called several times."""
        return Reshaped(match.out_shape, name=f"des_{NAME}_{match.data['name']}_out")(combined)

    def sub_operator(self, match: Match, owned: list[FieldVector], name: str):
        return FieldRowsSubOp([v.field for v in owned], width=match.vectors[0].width, name=name,
                              source=match.root.layer.name)


def gather_left(graph: Graph, fields: FieldAnalysis, matches: list[Match]) -> tuple[list[Match], list[Rejection]]:
    """A field_rows match for every call of a table that ``matches`` leave whole, or a rejection
    saying why it cannot be one (then the table stays whole on every process)."""
    inside = set()
    for m in matches:
        inside |= m.internal
        for v in m.vectors:
            inside |= v.chain
    found, rejected = [], []
    for n in graph.nodes:
        if n.kind != "table" or n.index in inside:
            continue
        v = widest_vector(graph, fields, n)
        root = graph.producer.get(v.tensor) if isinstance(v, FieldVector) else n
        why = v if isinstance(v, str) else check_vectors(graph, [v])
        if why:
            rejected.append(Rejection(NAME, n, why))
            continue
        name = root.layer.name if graph.layer_calls(root.layer) == 1 else f"{root.layer.name}_{root.index}"
        found.append(Match(NAME, root, [v], {root.index}, out_shape=tuple(graph.shape(root.output)[1:]),
                           data={"name": name}))
    return found, rejected

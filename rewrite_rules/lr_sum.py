"""Sparse linear sum (LR, the wide part): the sum of per-field 1-wide lookups,

    sum_f w_f(x_f)     as Add([...]), tf.add_n([...]) or reduce_sum(concat(..., 1), 1, keepdims=True)

The global bias and the sigmoid stay in the replicated tail.
"""
from __future__ import annotations

from des.pattern import Op, V
from rewrite_rules.base import Match, Rejection, Rule, check_embeddings, embed_node, register

_CONCAT_SUM = Op("reduce_sum", V("C"), axis=(1, -1), keepdims=True)


@register
class LinearSum(Rule):
    name = "lr_sum"

    def match(self, graph, node):
        glue = {node.index}
        if node.kind == "add":
            operands = node.operands
        else:
            state = _CONCAT_SUM.match(graph, node.output)
            inner = graph.producer.get(state.bindings["C"]) if state else None
            if inner is None or inner.kind != "concat" or inner.attrs.get("axis") not in (1, -1):
                return None
            operands, glue = inner.operands, glue | {inner.index}
        embeds = [embed_node(graph, o) for o in operands]
        if len(embeds) < 1 or not all(embeds) or any(e.attrs["dim"] != 1 for e in embeds):
            return None
        why = check_embeddings(graph, embeds)
        if why:
            return Rejection(self.name, node, why)
        return Match(self.name, node, embeds, glue)

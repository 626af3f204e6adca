"""FM second-order interaction over field embeddings E = stack(v_1..v_F, axis=1):

    0.5 * reduce_sum( square(reduce_sum(E, 1)) - reduce_sum(square(E), 1), -1 )

written with tf ops (TFOpLambda), with 0.5 inside or outside the outer sum, or as a
user layer that declares ``des_substitute = "fm_interaction"`` and takes E.
"""
from __future__ import annotations

from des.pattern import Alt, Op, V
from rewrite_rules.base import Match, Rejection, Rule, check_embeddings, register, stacked_embeddings

E = V("E")
_DIFF = Op("sub", Op("square", Op("reduce_sum", E, axis=1, keepdims=False)),
           Op("reduce_sum", Op("square", E), axis=1, keepdims=False))
_K = (1, -1)
PATTERN = Alt(
    Op("fm_interaction", E),
    Op("mul", 0.5, Op("reduce_sum", _DIFF, axis=_K)),
    Op("reduce_sum", Op("mul", 0.5, _DIFF), axis=_K),
)


@register
class FMInteraction(Rule):
    name = "fm_interaction"

    def match(self, graph, node):
        state = PATTERN.match(graph, node.output) if len(node.outputs) == 1 else None
        if state is None:
            return None
        stacked = stacked_embeddings(graph, state.bindings["E"])
        if stacked is None:
            return Rejection(self.name, node, "the interaction input is not a stack of field embeddings")
        embeds, glue = stacked
        if len({e.attrs["dim"] for e in embeds}) != 1:
            return Rejection(self.name, node, "field embeddings of different widths")
        out_shape = graph.shape(node.output)
        if out_shape.rank not in (1, 2) or (out_shape.rank == 2 and out_shape[1] != 1):
            return Rejection(self.name, node, f"unexpected output shape {out_shape}")
        why = check_embeddings(graph, embeds)
        if why:
            return Rejection(self.name, node, why)
        return Match(self.name, node, embeds, state.nodes | glue)

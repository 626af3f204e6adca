"""NFM's bi-interaction pooling over a stack of field vectors E [B, F, K], a [B, K] vector:

    0.5 * ( (sum_f E)^2 - sum_f E^2 )                   -> partials S_p [B, K], Q_p [B, K]

as tf ops, DeepCTR's ``BiInteractionPooling`` or a layer declaring
``des_substitute = "bi_interaction"``. Tried after the FM rule, which contains it.
"""
from __future__ import annotations

from des.graph.pattern import Alt, Op
from des_ops.suboperators import BiInteractionSubOp
from rewrite_rules.base import Rule, register
from rewrite_rules.fm_interaction import DIFF, E, half, interaction_match, summed_slots

PATTERN = Alt(Op("bi_interaction", E), half(DIFF))


@register(priority=20)
class BiInteractionRule(Rule):
    name = "bi_interaction"
    stripes_exact = True
    sums_stripes_first = True

    def match(self, graph, fields, node):
        return interaction_match(self.name, PATTERN, graph, fields, node, lambda k: k)

    def sub_operator(self, match, owned, name):
        return BiInteractionSubOp([v.field for v in owned], k=match.data["k"], **summed_slots(match, owned),
                                  source=match.root.layer.name, name=name)

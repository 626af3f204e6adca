"""FM second-order interaction over a stack of field vectors E [B, F, K]:

    0.5 * sum_k( (sum_f E)^2 - sum_f E^2 )              -> partials S_p [B, K], Q_p [B, 1]

however spelled: tf.square or x * x, keepdims or not, 0.5 inside or outside the outer sum,
DeepCTR's ``FM`` layer, or a user layer declaring ``des_substitute = "fm_interaction"``.
"""
from __future__ import annotations

from des.graph.pattern import Alt, Op, V, axes, last_axis
from des_ops.suboperators import FMSubOp
from rewrite_rules.base import Match, Rejection, Rule, check_vectors, register, stack_of_fields

E = V("E")


def sum_over_fields(x):
    return Op("reduce_sum", x, axis=axes(1))


def half(x):
    return Op("mul", 0.5, x)


DIFF = Op("sub", Op("square", sum_over_fields(E)), sum_over_fields(Op("square", E)))
PATTERN = Alt(
    Op("fm_interaction", E),
    half(Op("reduce_sum", DIFF, axis=last_axis)),
    Op("reduce_sum", half(DIFF), axis=last_axis),
)


def summed_slots(match: Match, owned: list) -> dict:
    """FMSubOp's / BiInteractionSubOp's ``slots`` and ``summed``: per owned vector, the place of its
    field among ``match.data["summed"]`` (fields squared after the sum over processes) when it is a
    key stripe of one, else None; and how many there are."""
    summed = match.data.get("summed", [])
    return {"slots": [summed.index(v.unstriped_field) if v.key_stripe is not None and v.unstriped_field in summed
                      else None for v in owned], "summed": len(summed)}


def interaction_match(rule: str, pattern, graph, fields, node, per_sample_size):
    """Shared by the FM and bi-interaction rules: the pattern, a stack of equal-width field
    vectors, both sums over fields of the same shape, and the output size per sample."""
    state = pattern.match(graph, node.output) if len(node.outputs) == 1 else None
    if state is None:
        return None
    sub = next((graph.nodes[i] for i in state.nodes if graph.nodes[i].kind == "sub"), None)
    if sub is not None and graph.shape(sub.operands[0]) != graph.shape(sub.operands[1]):
        return None                        # (sum E)^2 and sum E^2 broadcast: not the FM math
    lay = stack_of_fields(fields, state.bindings["E"], rule, node)
    if isinstance(lay, Rejection):
        return lay
    k = lay.vectors[0].width
    size = 1
    for d in graph.shape(node.output)[1:]:
        size *= d or 0
    if size != per_sample_size(k):
        return Rejection(rule, node, f"unexpected output shape {graph.shape(node.output)}")
    why = check_vectors(graph, lay.vectors)
    if why:
        return Rejection(rule, node, why)
    return Match(rule, node, lay.vectors, state.nodes | lay.glue, data={"k": k})


@register(priority=30)
class FMInteractionRule(Rule):
    name = "fm_interaction"
    stripes_exact = True
    sums_stripes_first = True

    def match(self, graph, fields, node):
        return interaction_match(self.name, PATTERN, graph, fields, node, lambda k: 1)

    def sub_operator(self, match, owned, name):
        return FMSubOp([v.field for v in owned], k=match.data["k"], **summed_slots(match, owned),
                       source=match.root.layer.name, name=name)

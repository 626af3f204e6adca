"""First Dense layer over concatenated field embeddings:

    act(concat(v_1..v_F) @ W + b) = act(sum_p E_p @ W_p + b)

where W_p is the row block of W that multiplies the fields of process p.
"""
from __future__ import annotations

from rewrite_rules.base import (Match, Rejection, Rule, check_embeddings, concatenated_embeddings,
                                register)


@register
class EmbedConcatDense(Rule):
    name = "embed_concat_dense"

    def match(self, graph, node):
        if node.kind != "dense" or len(node.tensor_operands()) != 1:
            return None
        found = concatenated_embeddings(graph, node.tensor_operands()[0])
        if found is None:
            return None
        embeds, glue, others = found
        if not embeds:
            return None
        if others:
            return Rejection(self.name, node, "the Dense input mixes field embeddings with other tensors")
        if graph.shape(node.tensor_operands()[0]).rank != 2:
            return Rejection(self.name, node, "the Dense input is not 2-D")
        why = check_embeddings(graph, embeds)
        if why:
            return Rejection(self.name, node, why)
        return Match(self.name, node, embeds, glue | {node.index})

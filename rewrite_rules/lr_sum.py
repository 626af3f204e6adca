"""Sparse linear sum (LR, the wide part): the sum over fields of 1-wide field vectors,

    sum_f w_f  (+ terms that are not field vectors, added after the combine)   -> partial [B, 1]

spelled as Add / + / tf.add_n trees, a reduce_sum over the fields axis of their stack
([B, F, 1]) or concatenation ([B, F], [B, 1, F]), or DeepCTR's ``Linear`` (whose bias and
dense-feature part stay replicated). The global bias and the sigmoid stay in the tail.
"""
from __future__ import annotations

import tensorflow as tf

from des_ops.suboperators import LinearSumSubOp
from rewrite_rules.base import Match, Rejection, Rule, check_vectors, register


def _size(shape) -> int:
    n = 1
    for d in shape[1:]:
        n *= d or 0
    return n


@register(priority=10)
class LinearSumRule(Rule):
    name = "lr_sum"
    stripes_exact = True
    stripes_linear = True

    def match(self, graph, fields, node):
        if node.kind == "add":
            return self._add_tree(graph, fields, node)
        if node.kind == "reduce_sum" and len(node.tensor_operands()) == 1:
            found = self._reduce(graph, fields, node, node.tensor_operands()[0], node.attrs.get("axis") or ())
            return found
        if node.kind == "linear":                       # DeepCTR Linear (des.graph.adapters)
            found = self._reduce(graph, fields, node, node.operands[0], None)
            if isinstance(found, Match):
                found.data.update(bias=node.attrs.get("bias"), dense=node.attrs.get("dense"),
                                  kernel_regularizer=node.attrs.get("kernel_regularizer"))
                if node.attrs.get("dense") is not None:
                    found.others = [node.operands[1]]
            return found
        return None

    def _add_tree(self, graph, fields, node):
        root_shape = graph.shape(node.output)
        leaves, glue, stack = [], {node.index}, list(node.operands)
        while stack:
            t = stack.pop(0)
            n = graph.producer.get(t) if isinstance(t, int) else None
            if n is not None and n.kind == "add" and fields.vector(t) is None and \
                    len(graph.consumers.get(t, [])) == 1 and graph.shape(t) == root_shape:
                glue.add(n.index)
                stack = list(n.operands) + stack
            else:
                leaves.append(t)
        if not all(isinstance(t, int) for t in leaves):     # a constant operand (ids + offsets): not a sum of fields
            return None
        vectors, others = [], []
        for t in leaves:
            v = fields.vector(t)
            if v is not None and v.width == 1:
                vectors.append(v)
            else:
                others.append(t)
        if not vectors or any(graph.shape(t) != root_shape for t in leaves):
            return None
        why = check_vectors(graph, vectors)
        if why:
            return Rejection(self.name, node, why)
        return Match(self.name, node, vectors, glue, others=others)

    def _reduce(self, graph, fields, node, t, axes):
        lay = fields.layout(t)
        if lay is None or lay.form not in ("stack", "concat") or _size(graph.shape(node.output)) != 1:
            return None
        if any(v.width != 1 for v in lay.vectors):
            return None
        rank = graph.shape(t).rank
        field_axis = 1 if lay.form == "stack" else rank - 1
        if axes is not None and field_axis not in axes:
            return None
        if lay.others:
            return Rejection(self.name, node, "the sum mixes 1-wide field vectors with other tensors")
        why = check_vectors(graph, lay.vectors)
        if why:
            return Rejection(self.name, node, why)
        return Match(self.name, node, lay.vectors, lay.glue | {node.index})

    def sub_operator(self, match, owned, name):
        return LinearSumSubOp([v.field for v in owned], source=match.root.layer.name, name=name)

    def finish(self, match, combined, look):
        tail = LinearTail(match.out_shape, match.data.get("bias"), match.data.get("dense"),
                          match.data.get("kernel_regularizer"), name=f"des_lr_sum_{match.root.layer.name}_out")
        return tail([combined, *[look(t) for t in match.others]])


class LinearTail(tf.keras.layers.Layer):
    """Replicated part of a linear sum: total (+ other terms) (+ bias) (+ dense @ kernel)."""

    def __init__(self, shape, bias=None, dense=None, kernel_regularizer=None, **kwargs):
        super().__init__(**kwargs)
        self.shape = tuple(shape)
        self.bias = bias                       # the original layer's variable (kept, trained)
        self.kernel = dense                    # DeepCTR Linear mode 2: dense features' kernel
        if dense is not None and kernel_regularizer is not None:
            self.add_loss(lambda: kernel_regularizer(self.kernel))

    @tf.autograph.experimental.do_not_convert   # plain TF ops: autograph would only slow tracing
    def call(self, inputs, training=None):   # ``training``: Keras passes it through the decorator
        total, others = inputs[0], list(inputs[1:])
        y = tf.reshape(total, tf.concat([tf.shape(total)[:1], tf.constant(self.shape, tf.int32)], 0))
        if self.kernel is not None:
            y = y + tf.tensordot(others.pop(0), self.kernel, axes=(-1, 0))
        for o in others:
            y = y + o
        if self.bias is not None:
            y = y + self.bias
        return y

"""First Dense layer over concatenated field vectors (and other features):

    act(concat(v_1..v_F, x) @ W + b) = act(sum_p E_p @ W_p  +  x @ W_x + b)

W_p is the row block of W that multiplies the fields of process p; W_x (rows of features
that are not field vectors, e.g. numeric inputs) and b stay replicated and are applied
after the combine, with the activation. Matches Keras ``Dense`` (also inside a Sequential)
and DeepCTR's ``DNN`` (its first kernel; the rest of the DNN stays replicated).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from des_ops.keras_internals import SEPARABLE_PENALTIES
from des_ops.suboperators import DenseBlockSubOp
from rewrite_rules.base import Match, Rejection, Rule, check_vectors, register



@register(priority=40)
class EmbedConcatDenseRule(Rule):
    name = "embed_concat_dense"
    # a striped field's kernel rows: shared by every process, gradients summed; a kernel penalty
    # counts them on the process of the field's stripe 0 only
    stripes_exact = True
    stripes_linear = True

    def match(self, graph, fields, node):
        if node.kind != "dense" or len(node.tensor_operands()) != 1:
            return None
        lay = fields.layout(node.tensor_operands()[0])
        if lay is None or not lay.vectors:
            return None
        if lay.form == "stack":
            return Rejection(self.name, node, "the Dense input is a [B, F, K] stack (Dense acts per field "
                                              "row there, not on the concatenation)")
        why = check_vectors(graph, lay.vectors)
        if why:
            return Rejection(self.name, node, why)
        kernel = node.attrs["kernel"]
        if int(kernel.shape[0]) != sum(p.width for p in lay.parts):
            return Rejection(self.name, node, "the kernel rows do not line up with the concatenated inputs")
        if node.attrs.get("kernel_constraint") is not None:
            return Rejection(self.name, node, f"its kernel_constraint {type(node.attrs['kernel_constraint']).__name__} "
                                              f"acts on whole columns, which span processes")
        reg = node.attrs.get("kernel_regularizer")
        if reg is not None and not isinstance(reg, SEPARABLE_PENALTIES):
            return Rejection(self.name, node, f"its kernel_regularizer {type(reg).__name__} is not a sum over "
                                              f"entries (L1/L2), so it cannot be split by field")
        return Match(self.name, node, lay.vectors, lay.glue | {node.index}, others=[p.tensor for p in lay.others],
                     data={"parts": lay.parts, "kernel": kernel, "bias": node.attrs["bias"],
                           "activation": node.attrs["activation"], "rest": node.attrs.get("rest"),
                           "kernel_regularizer": reg, "bias_regularizer": node.attrs.get("bias_regularizer"),
                           "trainable": node.attrs.get("trainable", True), "key": graph.layer_key(node.layer)},
                     dense_parameters=int(np.prod(kernel.shape)) + (int(np.prod(node.attrs["bias"].shape))
                                                                   if node.attrs["bias"] is not None else 0))

    def rows(self, match) -> list[tuple[object, np.ndarray]]:
        """(part, kernel rows) for every part of the concatenation, in order."""
        kernel, out, start = match.data["kernel"].numpy(), [], 0
        for p in match.data["parts"]:
            out.append((p, kernel[start:start + p.width]))
            start += p.width
        return out

    def sub_operator(self, match, owned, name):
        mine = {id(v) for v in owned}
        striped = {v.tensor for v in owned if v.key_stripe is not None}   # a field too big for one owner: shared rows
        first = {v.tensor for v in owned if v.key_stripe is not None and v.key_stripe[0] == 0}   # penalized here
        fields = [(p.vector, rows) for p, rows in self.rows(match) if p.vector is not None]
        blocks = [rows for v, rows in fields if id(v) in mine]
        shared = [rows for v, rows in fields if v.tensor in striped]
        penalized = [np.full(len(rows), v.tensor in first) for v, rows in fields if v.tensor in striped]
        units = int(match.data["kernel"].shape[1])
        block = np.concatenate(blocks) if blocks else np.zeros((0, units), np.float32)
        return DenseBlockSubOp([v.field for v in owned], block, [v.width for v in owned],
                               regularizer=match.data["kernel_regularizer"], trainable_block=match.data["trainable"],
                               shared_block=np.concatenate(shared) if shared else None,
                               shared=[v.key_stripe is not None for v in owned],
                               penalized_shared=np.concatenate(penalized) if penalized else None,
                               source=match.root.layer.name, name=name)

    def finish(self, match, combined, look):
        others = [rows for p, rows in self.rows(match) if p.vector is None]
        d = match.data
        tail = DenseTail(match.out_shape, d["bias"], d["activation"], np.concatenate(others) if others else None,
                         d.get("rest"), kernel_regularizer=d["kernel_regularizer"],
                         bias_regularizer=d["bias_regularizer"], name=f"des_dense_{match.root.layer.name}_out")
        if tail.other_kernel is not None:
            tail.other_kernel.des_key = f"{d['key']}/others"          # des.runtime.state: the replicated rows of W
        tail.trainable = d["trainable"]
        return tail([combined, *[look(t) for t in match.others]])


class DenseTail(tf.keras.layers.Layer):
    """Replicated end of a substituted Dense: total + others @ W_x + b, activation, shape,
    then ``rest`` (e.g. the remaining layers of DeepCTR's DNN)."""

    def __init__(self, shape, bias, activation, other_rows: np.ndarray | None, rest=None,
                 kernel_regularizer=None, bias_regularizer=None, **kwargs):
        super().__init__(**kwargs)
        self.shape = tuple(shape)
        self.bias = bias                                  # the original Dense's variable (kept, trained)
        self.activation = tf.keras.activations.get(activation) if activation is not None else None
        self.rest = rest
        self.other_kernel = None if other_rows is None else self.add_weight(
            "other_kernel", shape=other_rows.shape, initializer=tf.keras.initializers.Constant(other_rows),
            regularizer=kernel_regularizer)               # the replicated rows' share of the penalty
        if bias is not None and bias_regularizer is not None:
            self.add_loss(lambda: bias_regularizer(self.bias))

    def call(self, inputs, training=None):
        y = self._dense(inputs)
        if self.rest is not None:                         # [B, units] into the rest of the layer
            return self.rest(y, training=training)        # (a user's layer: Keras converts it with autograph)
        return tf.reshape(y, tf.concat([tf.shape(y)[:1], tf.constant(self.shape, tf.int32)], 0))

    @tf.autograph.experimental.do_not_convert   # plain TF ops, as Keras's Dense: autograph only slowed tracing
    def _dense(self, inputs):
        total, others = inputs[0], inputs[1:]
        y = total
        if self.other_kernel is not None:
            b = tf.shape(total)[0]
            x = tf.concat([tf.reshape(o, tf.stack([b, -1])) for o in others], axis=1)
            y = y + tf.matmul(x, self.other_kernel)
        if self.bias is not None:
            y = y + self.bias
        if self.activation is not None:
            y = self.activation(y)
        return y

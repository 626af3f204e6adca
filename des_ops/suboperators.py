"""Keras layers of the DES sub-operators and the fused first layer that runs them.

    >>> layer = DESFirstLayer(tables, ops, comm)       # built by des.transform
    >>> outputs = layer({field: ids, ...})             # one tensor per substituted operator

Input dist -> compute -> output dist: every process gets the whole batch, looks up its own
fields in its own tables, computes each operator's partial, and ONE fused allreduce
(identity gradient) gives every process the sum, from which each operator's output is
combined. Math in des_ops.partials.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from des_ops import partials as dm
from des_ops.comm import Communicator, allreduce_sum


class SubOperator(tf.keras.layers.Layer):
    """One substituted operator on one process: ``partial`` of owned tables, ``combine`` of the sum."""
    rule = ""

    def __init__(self, tables: list[str], out_shape: tuple, fields: list[str] | None = None,
                 source: str = "", **kwargs):
        super().__init__(**kwargs)
        self.source = source                # name of the original layer whose output this replaces
        self.tables = list(tables)          # names of the owned tables this operator reads, in order
        self.fields = list(fields or [])    # their fields, in the same order
        self.out_shape = tuple(out_shape)   # the original operator's output shape without batch

    width = 0

    def partial(self, embs: dict[str, tf.Tensor], batch: tf.Tensor) -> tf.Tensor:
        raise NotImplementedError

    def combine(self, total: tf.Tensor) -> tf.Tensor:
        raise NotImplementedError

    def _shape(self, y: tf.Tensor) -> tf.Tensor:
        return tf.reshape(y, tf.concat([tf.shape(y)[:1], self.out_shape], 0)) if \
            tuple(y.shape[1:]) != self.out_shape else y


class LinearSum(SubOperator):
    rule = "lr_sum"
    width = 1

    def partial(self, embs, batch):
        return dm.linear_partial([embs[t] for t in self.tables], batch)

    def combine(self, total):
        return self._shape(total)


class FMInteraction(SubOperator):
    rule = "fm_interaction"

    def __init__(self, tables, out_shape, fields=None, *, k: int, **kwargs):
        super().__init__(tables, out_shape, fields, **kwargs)
        self.k = k
        self.width = k + 1

    def partial(self, embs, batch):
        return dm.fm_partial([embs[t] for t in self.tables], batch, self.k)

    def combine(self, total):
        return self._shape(dm.fm_combine(total, self.k))


class DenseBlock(SubOperator):
    """act(sum_p E_p W_p + b): holds W_p (this process's kernel rows) and the replicated b."""
    rule = "embed_concat_dense"

    def __init__(self, tables, out_shape, kernel_block: np.ndarray, bias: np.ndarray | None,
                 activation, **kwargs):
        super().__init__(tables, out_shape, **kwargs)
        self.width = int(kernel_block.shape[1])
        self.activation = tf.keras.activations.get(activation)
        self.kernel_block = None if kernel_block.shape[0] == 0 else self.add_weight(
            "kernel_block", shape=kernel_block.shape, trainable=True,
            initializer=tf.keras.initializers.Constant(kernel_block))
        self.bias = None if bias is None else self.add_weight(
            "bias", shape=bias.shape, trainable=True, initializer=tf.keras.initializers.Constant(bias))

    def partial(self, embs, batch):
        if self.kernel_block is None:          # this process owns none of the fields
            return dm.zeros(batch, self.width)
        return dm.dense_partial([embs[t] for t in self.tables], self.kernel_block)

    def combine(self, total):
        y = total if self.bias is None else total + self.bias
        return self._shape(self.activation(y))

    def rows_by_field(self, dims: dict[str, int]) -> dict[str, np.ndarray]:
        """This process's kernel rows, split per owned field (dims: table name -> width)."""
        if self.kernel_block is None:
            return {}
        out, start, kernel = {}, 0, self.kernel_block.numpy()
        for t, f in zip(self.tables, self.fields):
            out[f] = kernel[start:start + dims[t]]
            start += dims[t]
        return out


class DESFirstLayer(tf.keras.layers.Layer):
    """Owned tables + sub-operators + one fused allreduce. Input: {input name: tensor}; output: a list.

    ``table_inputs`` names what each table reads: [ids input] or [ids input, weights input]."""

    def __init__(self, tables: dict[str, tf.keras.layers.Layer], table_inputs: dict[str, list[str]],
                 ops: list[SubOperator], comm: Communicator, **kwargs):
        super().__init__(**kwargs)
        self.owned = [tables[n] for n in sorted(tables)]    # tracked: tables, slots, checkpoints
        self.table_inputs = {t: list(names) for t, names in table_inputs.items()}
        self.ops = list(ops)
        self.comm = comm
        self.widths = [op.width for op in self.ops]

    def call(self, inputs: dict, training=None):
        batch = tf.shape(next(iter(inputs.values())))[0]
        embs = {t.name: t(self._lookup_input(inputs, t.name), training=training) for t in self.owned}
        fused = tf.concat([op.partial(embs, batch) for op in self.ops], axis=1)
        total = allreduce_sum(self.comm, fused)
        return [op.combine(part) for op, part in zip(self.ops, tf.split(total, self.widths, axis=1))]

    def _lookup_input(self, inputs: dict, table: str):
        names = self.table_inputs[table]
        return inputs[names[0]] if len(names) == 1 else [inputs[n] for n in names]

    def floats_per_sample(self) -> int:
        return int(sum(self.widths))

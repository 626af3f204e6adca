"""Keras layers of the DES sub-operators and the fused first layer that runs them.

    >>> import des, models
    >>> from des.data import FeatureSpec, Field
    >>> model, _ = des.transform(models.fm(FeatureSpec((Field("C1", dim=4), Field("C2", dim=4)))))
    >>> layer = des.distributed(model).layer   # DESFirstLayer(owned_layers, field_vectors, ops, op_inputs, comm)
    >>> combined = layer({"C1": tf.constant([1, 2], tf.int64), "C2": tf.constant([3, 4], tf.int64)})     # one tensor per substituted operator
    >>> [type(op).__name__ for op in layer.ops], [c.shape for c in combined]
    (['LinearSumSubOp', 'FMSubOp'], [TensorShape([2, 1]), TensorShape([2, 1])])

Input dist -> compute -> output dist: every process gets the whole batch, computes the field
vectors of the fields it owns (``field_vectors``: lookups in its own tables), each operator's
partial of them, and ONE fused allreduce (identity gradient) gives every process the sums,
from which each operator's output is combined. Math in des_ops.partials.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import tensorflow as tf

from des_ops import partials as dm
from des_ops.comm import Communicator, allreduce_sum, variable_zero
from des_ops.rows import Block, rows_dense, rows_to_samples, wire_order
from des_ops.stripes import Deferred
from des_ops.tail import reduce_scatter_sum
from models.layers import only_shapes_wanted


class SubOperator(tf.keras.layers.Layer):
    """One substituted operator on one process: ``partial`` of the owned field vectors
    ([B, K_f] each, in the operator's order), ``combine`` of the sum over processes."""
    width = 0

    def __init__(self, fields: list[str], source: str = "", **kwargs):
        super().__init__(**kwargs)
        self.source = source                # name of the original layer whose output this replaces
        self.fields = list(fields)          # the owned fields, in the order of the vectors

    def partial(self, vectors: list[tf.Tensor], batch: tf.Tensor) -> tf.Tensor:  # pragma: no cover
        raise NotImplementedError

    def combine(self, total: tf.Tensor) -> tf.Tensor:
        return total

    def regularization(self):
        """This process's share of a separable weight penalty of the operator (a scalar), or None."""
        return None


class LinearSumSubOp(SubOperator):
    """sum_f w_f: partial [B, 1]."""
    width = 1

    def partial(self, vectors, batch):
        return dm.linear_partial(vectors, batch)


class FMSubOp(SubOperator):
    """0.5 * sum_k((sum_f v)^2 - sum_f v^2): partial [S_p, Q_p], [B, k + 1]; with ``summed`` fields
    (split by key stripe, several ids a sample: des.compiler.big_tables) each one's stripe T_p beside
    them, [B, k + 1 + k * summed], squared after the sum (des_ops.partials). ``slots``: per owned
    vector, its field's place among them, or None."""

    def __init__(self, fields, *, k: int, slots=None, summed: int = 0, **kwargs):
        super().__init__(fields, **kwargs)
        self.k, self.slots, self.summed = k, slots, int(summed)
        self.width = k + 1 + k * self.summed

    def partial(self, vectors, batch):
        return dm.fm_partial(vectors, batch, self.k, self.slots, self.summed)

    def combine(self, total):
        return dm.fm_combine(total, self.k, self.summed)


class BiInteractionSubOp(SubOperator):
    """NFM's bi-interaction 0.5 * ((sum_f v)^2 - sum_f v^2), a [B, k] vector: partial [S_p, Q_p], [B, 2k];
    ``slots``, ``summed``: as FMSubOp's, [B, 2k + k * summed]."""

    def __init__(self, fields, *, k: int, slots=None, summed: int = 0, **kwargs):
        super().__init__(fields, **kwargs)
        self.k, self.slots, self.summed = k, slots, int(summed)
        self.width = (2 + self.summed) * k

    def partial(self, vectors, batch):
        return dm.bi_partial(vectors, batch, self.k, self.slots, self.summed)

    def combine(self, total):
        return dm.bi_combine(total, self.k, self.summed)


class FieldRowsSubOp(SubOperator):
    """One field vector for a reader no rule splits (Cross, CIN, attention, gates, ...): its
    owner's partial is the vector itself, every other process's zeros, so the sum over processes
    is the vector, exactly (x + 0 = x), on every process; the identity gradient hands its owner
    the vector's gradient. [B, width].

    ``exchange`` "samples" (the data-parallel tail; set by des.transform with ``owner``, the
    field's process): instead of partials in the reduce-scatter, the owner sends each process its
    samples' rows by one all-to-all shared by every such vector (des_ops.rows.rows_to_samples)."""
    exchange = "partials"
    owner = -1
    block: Block | None = None        # by samples: its width and the input that decides it (des_ops.rows)

    def __init__(self, fields, *, width: int, **kwargs):
        super().__init__(fields, **kwargs)
        self.width = int(width)

    def partial(self, vectors, batch):
        return vectors[0] if vectors else dm.zeros(batch, self.width)

    # by samples (des_ops.rows.rows_to_samples): what each process sends, and the receiver's assembly
    def samples_blocks(self, world_size: int) -> list[list[Block]]:
        """Per process, the blocks of this vector it sends: its owner one, the others none."""
        return [[self.block or Block(self.width)] if p == self.owner else [] for p in range(world_size)]

    def sent_rows(self, vectors, batch) -> tf.Tensor:
        """This process's block (on the owner): [B, width], the vector."""
        return self.partial(vectors, batch)

    def from_pieces(self, pieces: list[tf.Tensor]) -> tf.Tensor:
        """The vector's rows of this process's samples from what its senders' blocks (in rank order) hold."""
        return pieces[0]


class KeyRangeRowsSubOp(FieldRowsSubOp):
    """The [B, count, width] lookup of a table split by key range (des_ops.ranges), flattened to
    [B, count * width]: this process's owned ``positions`` (its lookup gives them flattened, [B,
    len * width], in that order) in their places, zeros elsewhere; the sum over processes is the
    whole lookup.

    By samples (``exchange`` "samples", set by des.transform with ``rank_positions``, the positions
    each process owns): every owner sends each process its samples' rows of its own positions, one
    block of len * width floats a sample, and the receiver puts the positions of all blocks in order.

        >>> op = KeyRangeRowsSubOp(["a[0]", "a[2]"], positions=[0, 2], count=3, width=1)
        >>> op.rank_positions = [[0, 2], [1]]           # process 0 owns positions 0 and 2, process 1 position 1
        >>> [[b.width for b in bl] for bl in op.samples_blocks(2)]
        [[2], [1]]
        >>> op.from_pieces([tf.constant([[10.0, 12.0]]), tf.constant([[11.0]])]).numpy().tolist()
        [[10.0, 11.0, 12.0]]
    """
    rank_positions: list[list[int]] = []
    position_keys: list = []      # by samples: each position's key (des_ops.rows.Block), when all have one

    def __init__(self, fields, *, positions: list[int], count: int, width: int, **kwargs):
        super().__init__(fields, width=count * width, **kwargs)
        self.positions, self.count, self.row_width = list(positions), int(count), int(width)

    def samples_blocks(self, world_size: int) -> list[list[Block]]:
        """Per owner, its positions' rows: one keyed block per position when every position has a
        key (its rows then travel once per distinct id), else one block of them all."""
        if self.position_keys and all(k is not None for k in self.position_keys):
            return [[Block(self.row_width, self.position_keys[f]) for f in fs] for fs in self.rank_positions]
        return [[Block(len(fs) * self.row_width)] if fs else [] for fs in self.rank_positions]

    def sent_rows(self, vectors, batch) -> tf.Tensor:
        return vectors[0]            # the lookup of this process's positions, [B, len * width]

    def from_pieces(self, pieces: list[tf.Tensor]) -> tf.Tensor:
        order = [f for fs in self.rank_positions for f in fs]          # the positions as the blocks hold them
        x = pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=1)
        if order == sorted(order):
            return x
        where = {f: k for k, f in enumerate(order)}
        x = tf.gather(tf.reshape(x, [-1, self.count, self.row_width]), [where[f] for f in range(self.count)], axis=1)
        return tf.reshape(x, [-1, self.count * self.row_width])

    def partial(self, vectors, batch):
        if not self.positions:
            return dm.zeros(batch, self.width)
        mine, k = vectors[0], self.row_width
        zero = dm.zeros(batch, k)
        at = {f: i for i, f in enumerate(self.positions)}
        return tf.concat([mine[:, at[f] * k:(at[f] + 1) * k] if f in at else zero for f in range(self.count)], axis=1)


class StripeRowsSubOp(FieldRowsSubOp):
    """The [B, count, width] lookup of a table split by key stripe (des_ops.stripes), flattened to
    [B, count * width]: every process looks up its own keys for the whole batch, zeros for the
    others, so the sum over processes is the lookup (x + 0 + ... = x, exactly).

    By samples (``exchange`` "samples"): every process sends each process its samples' rows,
    one block per position keyed by ``stripe_keys`` (``<key>@r/N``: its own keys' rows once per
    distinct id, the others' zeros once) when every position has a key, else one block; the
    receiver adds the senders' blocks in rank order. Of a TFRA table, a process looks up only the
    keys it sends, each slice's distinct ones, not the whole batch's (DESFirstLayer._picked): the
    same rows on the wire.

        >>> op = StripeRowsSubOp(["t%0"], stripe=0, stripes=2, count=2, width=1, table="t3")
        >>> op.stripe_keys = ["ids[0]", "ids[1]"]
        >>> [[b.key for b in bl] for bl in op.samples_blocks(2)]
        [['ids[0]@0/2', 'ids[1]@0/2'], ['ids[0]@1/2', 'ids[1]@1/2']]
        >>> pieces = [tf.constant([[1.0]]), tf.constant([[0.0]]), tf.constant([[0.0]]), tf.constant([[4.0]])]
        >>> op.from_pieces(pieces).numpy().tolist()
        [[1.0, 4.0]]
    """
    stripe_keys: list | None = None     # by samples: each position's key, when all have one

    def __init__(self, fields, *, stripe: int, stripes: int, count: int, width: int, table: str = "", **kwargs):
        super().__init__(fields, width=count * width, **kwargs)
        self.stripe, self.stripes, self.count, self.row_width = int(stripe), int(stripes), int(count), int(width)
        self.table = table        # the same on every process (its graph position): its blocks travel apart

    def samples_blocks(self, world_size: int) -> list[list[Block]]:
        if self.stripe_keys and all(k is not None for k in self.stripe_keys):
            return [[Block(self.row_width, f"{k}@{p}/{world_size}", apart=self.table) for k in self.stripe_keys]
                    for p in range(world_size)]
        return [[Block(self.width)] for _ in range(world_size)]

    def sent_rows(self, vectors, batch) -> tf.Tensor:
        return self.partial(vectors, batch)

    def from_pieces(self, pieces: list[tf.Tensor]) -> tf.Tensor:
        per = len(pieces) // self.stripes          # each sender's blocks, senders in rank order
        sums = None
        for p in range(self.stripes):
            part = pieces[p * per] if per == 1 else tf.concat(pieces[p * per:(p + 1) * per], axis=1)
            sums = part if sums is None else sums + part
        return sums


class DenseBlockSubOp(SubOperator):
    """sum_p E_p W_p: holds W_p, the rows of the Dense kernel that multiply this process's
    fields (bias, replicated rows and activation are applied after the combine).

    ``exchange``: "partials" (E_p W_p summed over processes) or, with the data-parallel tail,
    "rows" (``rank_widths``: w_p of every process; des_ops.rows): the rows of each process's
    samples travel to it instead, and it multiplies them by the all-gathered kernel.

    ``shared_block``: the kernel rows of fields split by key stripe (des.compiler.big_tables), which
    every process holds; ``shared`` marks, per owned vector, those it multiplies (its stripe's vector,
    zeros where another process holds the key). Their gradients are summed over processes before the
    update (des.compiler.functional gives them to des_ops.tail.sum_tail_gradients), so the copies stay
    equal. Its own fields' rows come first, then the striped ones' (``ordered``), in partials and by
    rows alike: by rows, each process's stripe is a block of its own, multiplied by its own copy of
    the rows, and the sum over the blocks is the field's product. A kernel penalty (L1/L2, a sum over
    entries) counts the shared rows once: on the process of each field's stripe 0 only
    (``penalized_shared``: a mask of the shared rows it penalizes), whose penalty gradient the sum
    of the copies' gradients then holds once."""
    exchange = "partials"
    rank_widths: list[int] = []
    rank_blocks: list = []          # by rows: each process's field vectors (des_ops.rows.Block)

    def __init__(self, fields, kernel_block: np.ndarray, widths: list[int], regularizer=None,
                 trainable_block: bool = True, shared_block: np.ndarray | None = None,
                 shared: list[bool] | None = None, penalized_shared: np.ndarray | None = None, **kwargs):
        super().__init__(fields, **kwargs)
        self.width = int(kernel_block.shape[1])
        self.field_widths = list(widths)
        shared = list(shared) if shared is not None else [False] * len(widths)
        # the owned vectors in its kernel's row order: its own fields' first, then the striped ones'
        self.order = [i for i, s in enumerate(shared) if not s] + [i for i, s in enumerate(shared) if s]
        self.regularizer = regularizer          # elementwise (L1/L2): the penalty of W is the sum over blocks
        self.kernel_block = None if kernel_block.shape[0] == 0 else self.add_weight(
            "kernel_block", shape=kernel_block.shape, trainable=trainable_block,
            initializer=tf.keras.initializers.Constant(kernel_block))
        self.shared_block = None if shared_block is None else self.add_weight(
            "shared_block", shape=shared_block.shape, trainable=trainable_block,
            initializer=tf.keras.initializers.Constant(shared_block))
        self.penalized_shared = None if penalized_shared is None or not np.any(penalized_shared) else \
            np.flatnonzero(penalized_shared)

    def regularization(self):
        if self.regularizer is None:
            return None
        terms = [] if self.kernel_block is None else [self.regularizer(self.kernel_block)]
        if self.shared_block is not None and self.penalized_shared is not None:
            terms.append(self.regularizer(tf.gather(self.shared_block, self.penalized_shared)))
        return dm.ordered_sum(terms) if terms else None

    def ordered(self, vectors: list) -> tuple[list, tf.Tensor | None]:
        """(the owned vectors in ``order``; their kernel rows, or None)."""
        vectors = [vectors[i] for i in self.order]
        if self.shared_block is None:
            return vectors, self.kernel_block
        return vectors, (self.shared_block if self.kernel_block is None else
                         tf.concat([self.kernel_block, self.shared_block], axis=0))

    def partial(self, vectors, batch):
        vectors, kernel = self.ordered(vectors)
        if kernel is None:                     # this process owns none of the fields
            return dm.zeros(batch, self.width)
        return dm.dense_partial(vectors, kernel)

    def rows_output(self, vectors, batch, comm: Communicator, anchor, name: str, keys: dict | None = None) -> tf.Tensor:
        """This process's rows of sum_p E_p W_p by moving rows (``exchange == "rows"``); ``keys``:
        the whole batch's inputs, whose ids the keyed blocks travel by (once per distinct id)."""
        widths = [self.field_widths[i] for i in self.order]
        vectors, kernel = self.ordered(vectors)
        e = tf.concat([tf.reshape(v, [-1, w]) for v, w in zip(vectors, widths)], axis=1) \
            if vectors else dm.zeros(batch, 0)
        kernel = tf.zeros([0, self.width]) if kernel is None else tf.convert_to_tensor(kernel)
        return rows_dense(comm, e, kernel, self.rank_widths, anchor, name, self.rank_blocks or None, keys)

    def rows_by_part(self) -> list[np.ndarray]:
        """This process's kernel rows, one block per owned field vector."""
        if self.kernel_block is None:
            return []
        kernel, starts = self.kernel_block.numpy(), np.cumsum([0] + self.field_widths)
        return [kernel[a:b] for a, b in zip(starts[:-1], starts[1:])]


def _runs(names: list[str]) -> list[str]:
    """Consecutive equal names once, with their count: [a, b, b, b] -> [a, b x3] (``bx3``)."""
    out: list[list] = []
    for name in names:
        if out and out[-1][0] == name:
            out[-1][1] += 1
        else:
            out.append([name, 1])
    return [name if k == 1 else f"{name}x{k}" for name, k in out]


class DESFirstLayer(tf.keras.layers.Layer):
    """Owned tables + sub-operators + one fused allreduce. Input: {input name: tensor};
    output: a list, one combined tensor per operator.

    ``field_vectors(inputs)`` computes {vector id: [B, ...] tensor} for the owned fields by
    calling ``owned_layers`` (tracked here: tables, slots and checkpoints follow them);
    ``op_inputs[i]`` lists the vector ids operator i reads, in its order.

    Weight penalties (regularizers) of owned layers and kernel blocks are owned too: with
    ``penalty_column``, each process puts its share r_p in the first row of one more column
    of the fused allreduce, and the layer adds sum_p r_p as a loss. Every process then
    reports the whole model's loss, and the identity gradient gives each owner the gradient
    of its own share, as on one process. ``scope`` goes into the allreduce's name when one
    model holds several DES layers (towers transformed one by one), so that each is its own
    collective.

    ``micro_batches`` K > 1: the batch's rows are cut into K consecutive slices (sizes differ by
    at most one; a slice may be empty when B < K) after the lookups, and each slice's partials
    are computed and allreduced on their own (collectives ``<name>_mb<k>of<K>``, the same on every
    process), so that the allreduce of slice k runs while slice k+1's partials are computed; the
    sums are concatenated in order: the same results as K = 1 up to float32 summation order
    within a slice (none: the sums are row by row). ``wire_dtype`` "float16": the partials are
    handed to the allreduce in 16 bits (half the bytes) and summed in 16 bits by the collective
    (Horovod's MPI float16 sum; the simulated world's numpy float16 sum), back to float32 after;
    the gradient stays the identity in float32. Opt-in and inexact; "float32" (the default) is exact."""

    def __init__(self, owned_layers: list, field_vectors: Callable[[dict], dict], ops: list[SubOperator],
                 op_inputs: list[list[int]], comm: Communicator, owned_penalties: list[Callable] = (),
                 penalty_column: bool = False, shard_rows: bool = False, scope: str = "", micro_batches: int = 1,
                 wire_dtype: str = "float32", **kwargs):
        super().__init__(**kwargs)
        self.micro_batches, self.wire_dtype = micro_batches, wire_dtype    # checked by des.transform
        self.shard_rows = shard_rows      # data-parallel tail: reduce-scatter, each process its rows
        self.owned = list(owned_layers)
        self._field_vectors = field_vectors
        self.ops = list(ops)
        self._op_inputs = [list(v) for v in op_inputs]
        self.comm = comm
        self._penalties = list(owned_penalties)
        self.penalty_column = penalty_column
        self.widths = [op.width for op in self.ops]
        self.sends_fused_rows = False     # by samples: sends one fused table's rows as its lookup made them
        self.picks_stripe_rows = False    # by samples: looks up the distinct keys it sends only (_picked)
        # operators whose output is not reduce-scattered: the first Dense by moving rows (des_ops.rows)
        self.by_rows = [getattr(op, "exchange", "partials") == "rows" for op in self.ops]
        # field vectors whose rows go to their samples' processes (one all-to-all for all of them)
        self.to_samples = [getattr(op, "exchange", "partials") == "samples" for op in self.ops]
        if (any(self.by_rows) or any(self.to_samples)) and not shard_rows:
            raise ValueError("the first Dense by moving rows and field rows by samples need the data-parallel tail")
        # the fused allreduce's identity on every rank: from the operators' kinds and widths (the
        # graph), never from the fields a process owns or the op feeding it (see des_ops.comm)
        self.collective = (f"des_partials_{scope}" if scope else "des_partials") + "__" + "__".join(
            _runs([f"{type(op).__name__.removesuffix('SubOp').lower()}{op.width}" for op in self.ops])
            + (["penalty1"] if penalty_column else []) + (["rows"] if shard_rows else [])
            + [f"op{i}_by_rows" for i, rows in enumerate(self.by_rows) if rows]
            + ([f"samples{sum(w for w, s in zip(self.widths, self.to_samples) if s)}"] if any(self.to_samples) else [])
            + ([f"wire{wire_dtype}"] if wire_dtype != "float32" else []))
        # of the last training batch taken while ``fingerprint_armed``: the replica check arms it for the
        # steps it checks (des.runtime.callbacks.ReplicaCheck) and compares it across processes; other
        # steps skip it (over a user's 39 inputs, a [B, 39] stack and its casts a step for nothing).
        # Over the inputs named in ``fingerprint_inputs`` (None: all), e.g. the ones every process reads
        self.fingerprint_inputs = None
        self.batch_fingerprint = self.add_weight("batch_fingerprint", shape=(), dtype=tf.float64,
                                                 trainable=False, initializer="zeros")
        # a switch, not state: untracked (no checkpoint, saved model or weight list holds it)
        object.__setattr__(self, "fingerprint_armed", tf.Variable(False, trainable=False, name="fingerprint_armed"))
        if shard_rows:
            # a trainable zero that the partials depend on (with factor 0): its gradient needs the
            # backward all-gather, so a process that owns no field still joins it (des_ops.tail)
            self.rows_anchor = self.add_weight("rows_anchor", shape=(), initializer="zeros", trainable=True)

    @tf.autograph.experimental.do_not_convert   # plain TF ops (the chains' user layers are still converted)
    def call(self, inputs: dict, training=None):
        batch = tf.shape(next(iter(inputs.values())))[0]
        if only_shapes_wanted(self):   # Keras builds the model: the outputs' shapes, not the lookups
            return [op.combine(part) for op, part in
                    zip(self.ops, tf.split(tf.zeros(tf.stack([batch, sum(self.widths)])), self.widths, axis=1))]
        keys = sorted(inputs) if self.fingerprint_inputs is None else sorted(self.fingerprint_inputs)
        if isinstance(training, tf.Tensor) or training:   # a tensor flag: what autograph made of an ``if``
            armed = tf.convert_to_tensor(self.fingerprint_armed)
            if isinstance(training, tf.Tensor):
                armed = tf.logical_and(armed, tf.cast(training, tf.bool))
            tf.cond(armed, lambda: self.batch_fingerprint.assign(dm.fingerprint([inputs[k] for k in keys])).read_value(),
                    lambda: self.batch_fingerprint.read_value())
        defer = self._deferrable()
        vectors = self._field_vectors(inputs, defer) if defer else self._field_vectors(inputs)
        flat = {t: tf.reshape(v, tf.stack([batch, -1])) for t, v in vectors.items() if not isinstance(v, Deferred)}
        if self.shard_rows:
            return self._own_rows(flat, batch, inputs, vectors)
        total = self._sum_in_slices(flat, batch)
        return [op.combine(part) for op, part in zip(self.ops, tf.split(total, self.widths, axis=1))]

    def _own_rows(self, flat: dict, batch: tf.Tensor, inputs: dict, vectors: dict) -> list[tf.Tensor]:
        """The data-parallel tail's outputs: this process's rows of every operator's output, by a
        reduce-scatter of the partials and, for a first Dense by rows, by des_ops.rows."""
        summed = [i for i, (rows, sampled) in enumerate(zip(self.by_rows, self.to_samples)) if not (rows or sampled)]
        # the penalties (one number per process, not a row) are summed by their own allreduce with
        # an identity gradient
        if self.penalty_column:
            self.add_loss(tf.reduce_sum(allreduce_sum(self.comm, tf.reshape(self._owned_penalty(), [1, 1]),
                                                      self.collective + "_penalty")))
        anchor = self.rows_anchor * variable_zero(self.comm)
        out = {}
        if summed:
            parts = [self.ops[i].partial([flat[t] for t in self._op_inputs[i]], batch) for i in summed]
            total = reduce_scatter_sum(self.comm, tf.concat(parts, axis=1) + anchor, self.collective)
            for i, part in zip(summed, tf.split(total, [self.widths[i] for i in summed], axis=1)):
                out[i] = self.ops[i].combine(part)
        for i, rows in enumerate(self.by_rows):
            if rows:
                out[i] = self.ops[i].rows_output([flat[t] for t in self._op_inputs[i]], batch, self.comm,
                                                 self.rows_anchor, f"{self.collective}_{i}", inputs)
        if any(self.to_samples):
            out.update(self._samples_rows(flat, batch, inputs, vectors))
        return [out[i] for i in range(len(self.ops))]

    def _deferrable(self) -> frozenset:
        """The field vectors whose lookups wait for the rows exchange (des_ops.stripes.StripeLookup.at):
        a table split by key stripe whose blocks travel by samples, keyed (StripeRowsSubOp), looks up
        the distinct keys of each slice it sends only, not the whole batch's keys to place them in
        [B, P, width] zeros and pick them out again. Vectors read by no other operator."""
        if not self.shard_rows or not any(self.to_samples) or not getattr(self._field_vectors, "defers", False):
            return frozenset()
        n, r = self.comm.world_size, self.comm.rank
        picks = [i for i, s in enumerate(self.to_samples) if s and isinstance(self.ops[i], StripeRowsSubOp)
                 and len(self._op_inputs[i]) == 1 and self.ops[i].samples_blocks(n)[r]
                 and all(b.key is not None for b in self.ops[i].samples_blocks(n)[r])]
        others = {t for i, ts in enumerate(self._op_inputs) if i not in picks for t in ts}
        return frozenset(self._op_inputs[i][0] for i in picks) - others

    def _picked(self, mine: list[tuple], vectors: dict) -> dict:
        """For rows_to_samples: {an operator's table: keys -> its rows}, for this process's blocks
        whose vectors are Deferred (a StripeLookup's members; two of one lookup share it)."""
        out = {}
        for i in sorted({i for i, _, _ in mine}):
            d = vectors[self._op_inputs[i][0]]
            if isinstance(d, Deferred):
                out[self.ops[i].table] = lambda keys, d=d: d.member.lookup.at(tf.cast(keys, d.ids.dtype),
                                                                              d.ids)[d.member.j]
        return out

    def _samples_rows(self, flat: dict, batch: tf.Tensor, inputs: dict, vectors: dict) -> dict[int, tf.Tensor]:
        """The field vectors by samples: this process's rows of each, from one all-to-all in which
        every owner sends its blocks' rows side by side (des_ops.rows.rows_to_samples): a vector's
        owner one block, each owner of positions of a table split by key range one block of them."""
        n = self.comm.world_size
        sampled = [i for i, s in enumerate(self.to_samples) if s]
        # (operator, its block's index on that process, block)
        sent = [[(i, k, b) for i in sampled for k, b in enumerate(self.ops[i].samples_blocks(n)[p])] for p in range(n)]
        # each process's blocks in wire order (the same on every process): a lane of des_ops.rows
        # (its fields' embedding and linear weight, row after row) is one slice of ``e``
        sent = [[bl[j] for j in wire_order([b for _, _, b in bl])] for bl in sent]
        mine = sent[self.comm.rank]
        blocks = [[b for _, _, b in bl] for bl in sent]
        widths = [sum(b.width for b in bl) for bl in blocks]
        picked = self._picked(mine, vectors)
        self.picks_stripe_rows = bool(picked)
        e = None
        if not picked or len(picked) < len({i for i, _, _ in mine}):    # some rows come from the whole batch's
            width = {ts[0]: op.width for op, ts in zip(self.ops, self._op_inputs) if len(ts) == 1}
            for t, v in vectors.items():       # a deferred vector's columns are not read: zeros hold their place
                if isinstance(v, Deferred):
                    flat[t] = dm.zeros(batch, width[t])
            e = self._fused_rows_sent(mine, vectors)
            if e is None:
                e = self._sent_in_order(mine, flat, batch)
        x = rows_to_samples(self.comm, e, widths, self.rows_anchor, f"{self.collective}_samples", blocks, inputs,
                            picked=picked, batch=batch)
        # as x holds them, ranks in order; consecutive blocks of one operator and sender as one piece
        runs: list[list] = []
        for p, bl in enumerate(sent):
            for i, _, b in bl:
                if runs and runs[-1][:2] == [p, i]:
                    runs[-1][2] += b.width
                else:
                    runs.append([p, i, b.width])
        pieces: dict[int, list] = {}
        parts = tf.split(x, [w for _, _, w in runs], axis=1) if len(runs) > 1 else [x]
        for (_, i, _), part in zip(runs, parts):
            pieces.setdefault(i, []).append(part)
        return {i: self.ops[i].combine(self.ops[i].from_pieces(pieces[i])) for i in sampled}

    def _sent_in_order(self, mine: list[tuple], flat: dict, batch: tf.Tensor) -> tf.Tensor:
        """This process's rows of its blocks ``mine`` ((operator, block index, block)) side by side in
        that order: an operator whose blocks all come in a row, in its order, as it made them (no
        split and join, forward or backward); the others block by block."""
        if not mine:
            return dm.zeros(batch, 0)
        runs: list[list] = []
        for i, k, _ in mine:
            if runs and runs[-1][0] == i and runs[-1][-1] == k - 1:
                runs[-1].append(k)
            else:
                runs.append([i, k])
        count = {i: len(self.ops[i].samples_blocks(self.comm.world_size)[self.comm.rank]) for i, _, _ in mine}
        split: dict = {}
        parts = []
        for i, *ks in runs:
            if ks == list(range(count[i])):
                parts.append(self._sent_rows(i, flat, batch))
                continue
            if i not in split:
                split[i] = self._sent_by_block(i, flat, batch)
            parts += [split[i][k] for k in ks]
        return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)

    def _sent_rows(self, i: int, flat: dict, batch: tf.Tensor) -> tf.Tensor:
        """What operator ``i`` sends from this process, [B, its blocks' width]."""
        blocks = self.ops[i].samples_blocks(self.comm.world_size)[self.comm.rank]
        return tf.reshape(self.ops[i].sent_rows([flat[t] for t in self._op_inputs[i]], batch),
                          [-1, sum(b.width for b in blocks)])

    def _sent_by_block(self, i: int, flat: dict, batch: tf.Tensor) -> list[tf.Tensor]:
        """What operator ``i`` sends from this process, [B, width] per block (a key-range table's
        one block per position: its columns of the positions' rows)."""
        blocks = self.ops[i].samples_blocks(self.comm.world_size)[self.comm.rank]
        rows = self._sent_rows(i, flat, batch)
        if len(blocks) == 1:
            return [rows]
        # one split, not a slice per block: a slice's gradient is a whole [B, width] of zeros around
        # its block, and summing those is quadratic in the blocks (a one-table model: 2 x 39 of them)
        return tf.split(rows, [b.width for b in blocks], axis=1)

    def _fused_rows_sent(self, mine: list[tuple], vectors: dict) -> tf.Tensor | None:
        """What this process sends by samples when it is one fused table's one-hot rows side by side
        in the table's order (FieldChains.fused_rows: a process's joined tables whose vectors all go
        by samples): that [B, S * dim] tensor as the table's lookup made it, not split into its
        fields' vectors and joined again (forward and backward). Else None."""
        if not mine or any(type(self.ops[i]) is not FieldRowsSubOp or len(self._op_inputs[i]) != 1 for i, _, _ in mine):
            return None
        sent = [vectors[self._op_inputs[i][0]] for i, _, _ in mine]
        for rows, outputs in getattr(self._field_vectors, "fused_rows", []):
            if len(outputs) == len(sent) and all(a is b for a, b in zip(outputs, sent)):
                self.sends_fused_rows = True
                return rows
        return None

    def _sum_in_slices(self, flat: dict, batch: tf.Tensor) -> tf.Tensor:
        """The replicated tail's sum: each slice's partials (and, in the last slice's first row, the
        penalty share) summed by their own collective, the slices' sums in order (one slice: the
        whole batch, one fused allreduce)."""
        k_total = self.micro_batches
        bounds = [batch * k // k_total for k in range(k_total + 1)] if k_total > 1 else None
        totals = []
        for k in range(k_total):
            rows = batch if k_total == 1 else bounds[k + 1] - bounds[k]
            part = flat if k_total == 1 else {t: v[bounds[k]:bounds[k + 1]] for t, v in flat.items()}
            parts = [op.partial([part[t] for t in ids], rows) for op, ids in zip(self.ops, self._op_inputs)]
            if self.penalty_column:       # the last slice has >= 1 row whenever the batch has one
                parts.append(dm.first_row(self._owned_penalty(), rows) if k == k_total - 1 else dm.zeros(rows, 1))
            name = self.collective + (f"_mb{k}of{k_total}" if k_total > 1 else "")
            x = tf.concat(parts, axis=1)
            if self.comm.blocking and totals:     # blocking collectives: one after another, in order
                with tf.control_dependencies([totals[-1]]):
                    x = tf.identity(x)
            totals.append(allreduce_sum(self.comm, x, name, wire_dtype=self.wire_dtype))
        total = tf.concat(totals, axis=0) if k_total > 1 else totals[0]
        if self.penalty_column:
            self.add_loss(tf.reduce_sum(total[:, -1]))
            total = total[:, :-1]
        return total

    def _owned_penalty(self) -> tf.Tensor:
        terms = [fn() for fn in self._penalties] + [op.regularization() for op in self.ops]
        terms = [tf.cast(t, tf.float32) for t in terms if t is not None]
        return dm.ordered_sum(terms) if terms else tf.constant(0.0)

    def floats_per_sample(self) -> int:
        """Floats per sample of the fused allreduce (or reduce-scatter): the operators' partials
        (not those of a first Dense by rows nor field rows by samples) and the penalty column."""
        return int(sum(w for w, rows, sampled in zip(self.widths, self.by_rows, self.to_samples)
                       if not (rows or sampled))) + int(self.penalty_column)

"""The math of each substitution as plain functions: partial (per process) and combine.

For embeddings v_f of the fields F_p that process p owns:

    linear:  a_p = sum_f w_f                                   -> combine: sum_p a_p
    fm:      S_p = sum_f v_f,  Q_p = sum_f sum_k v_fk^2        -> combine: 0.5 * (sum_k (sum_p S_p)_k^2 - sum_p Q_p)
    bi:      S_p = sum_f v_f,  Q_p = sum_f v_f^2 (per k)        -> combine: 0.5 * ((sum_p S_p)^2 - sum_p Q_p)
    dense:   E_p W_p  (W_p = rows of W for F_p)                -> combine: act(sum_p E_p W_p + b)

A field split by key stripe with several ids a sample (des.compiler.big_tables) has several
non-zero stripes v_f^p in a sample, and sum_p |v_f^p|^2 is not |v_f|^2. FM and bi carry such a
field's stripe as T_p = v_f^p beside S_p, not in Q_p, and square it after the sum:

    fm:      ... -> combine: 0.5 * (sum_k (sum_p S_p)_k^2 - (sum_p Q_p + sum_k (sum_p T_p)_k^2))
"""
from __future__ import annotations

import tensorflow as tf


def zeros(batch: tf.Tensor, width: int) -> tf.Tensor:
    return tf.zeros(tf.stack([batch, width]), tf.float32)


def fingerprint(tensors: list[tf.Tensor]) -> tf.Tensor:
    """An order-sensitive float64 digest of a batch: sum over rows b of (b + 1) * sum of the
    row's values (ids mod 65521, strings hashed into 65521 buckets, floats as they are). Equal
    batches give equal digests on every process; other data or another row order, almost never."""
    total = tf.constant(0.0, tf.float64)
    # one-id-a-sample integer inputs as one [B, F] tensor: a few ops for all of them, not five each
    # (the digest sums integers below 2**53 in float64, so grouping changes no bit of it)
    ids = [x for x in tensors if x.dtype.is_integer and x.shape.rank == 1]
    if len(ids) > 1:
        tensors = [tf.stack([tf.cast(x, tf.int64) for x in ids], axis=1)] + [x for x in tensors if
                                                                            not any(x is i for i in ids)]
    for x in tensors:
        if x.dtype == tf.string:
            v = tf.cast(tf.strings.to_hash_bucket_fast(x, 65521), tf.float64)
        elif x.dtype.is_integer:
            v = tf.cast(tf.math.floormod(tf.cast(x, tf.int64), 65521), tf.float64)
        else:
            v = tf.cast(x, tf.float64)
        rows = tf.reduce_sum(tf.reshape(v, tf.stack([tf.shape(v)[0], -1])), axis=1)
        total += tf.reduce_sum(rows * tf.cast(tf.range(1, tf.shape(v)[0] + 1), tf.float64))
    return total


def first_row(value: tf.Tensor, batch: tf.Tensor) -> tf.Tensor:
    """[B, 1]: the scalar ``value`` in row 0, zeros below (a scalar riding in a [B, .] allreduce)."""
    return tf.pad(tf.reshape(value, [1, 1]), tf.stack([tf.stack([0, batch - 1]), [0, 0]]))


def ordered_sum(xs: list[tf.Tensor]) -> tf.Tensor:
    """``xs[0] + xs[1] + ...``, added left to right. Not ``tf.add_n``: AddN adds into whichever
    input buffer it may reuse in place, first, so the order of its float sum (and the bits) would
    follow the execution order, which a collective in flight makes vary from launch to launch.

        >>> float(ordered_sum([tf.constant(1.0), tf.constant(2.0), tf.constant(3.0)]))
        6.0
    """
    total = xs[0]
    for x in xs[1:]:
        total = total + x
    return total


def linear_partial(embs: list[tf.Tensor], batch: tf.Tensor) -> tf.Tensor:
    """[B, 1]: the sum of this process's 1-wide lookups."""
    return ordered_sum(embs) if embs else zeros(batch, 1)


def fm_partial(embs: list[tf.Tensor], batch: tf.Tensor, k: int, slots: list[int | None] | None = None,
               summed: int = 0) -> tf.Tensor:
    """[B, k + 1 + summed * k]: S_p, Q_p and the ``summed`` fields' T_p side by side. ``slots``: per
    vector, its place among the fields squared after the sum (a stripe of a field of several ids a
    sample), or None (squared here, into Q_p)."""
    return _sums_and_squares(embs, batch, k, lambda e: tf.reduce_sum(tf.square(e), axis=1, keepdims=True), 1,
                             slots, summed)


def fm_combine(total: tf.Tensor, k: int, summed: int = 0) -> tf.Tensor:
    """[B, 1] from the summed [B, k + 1 + summed * k]."""
    s, q = total[:, :k], total[:, k:k + 1]
    if summed:
        q = q + tf.reduce_sum(tf.square(total[:, k + 1:]), axis=1, keepdims=True)
    return 0.5 * (tf.reduce_sum(tf.square(s), axis=1, keepdims=True) - q)


def _sums_and_squares(embs: list[tf.Tensor], batch: tf.Tensor, k: int, square, q_width: int,
                      slots: list[int | None] | None, summed: int) -> tf.Tensor:
    """[S_p, Q_p, T_p]: the sum of ``embs``, the sum of ``square`` of those not in a slot ([B,
    ``q_width``]), and per field squared after the sum this process's vector of it (its stripe) or zeros."""
    if not embs:
        return zeros(batch, k + q_width + summed * k)
    slots = slots or [None] * len(embs)
    squares = [square(e) for e, j in zip(embs, slots) if j is None]
    parts = [None] * summed
    for e, j in zip(embs, slots):
        if j is not None:
            parts[j] = e if parts[j] is None else parts[j] + e
    return tf.concat([ordered_sum(embs), ordered_sum(squares) if squares else zeros(batch, q_width),
                      *[zeros(batch, k) if p is None else p for p in parts]], axis=1)


def dense_partial(embs: list[tf.Tensor], kernel_block: tf.Tensor) -> tf.Tensor:
    """[B, H]: this process's embeddings times its row block of the Dense kernel."""
    return tf.matmul(tf.concat(embs, axis=1), kernel_block)


def bi_partial(embs: list[tf.Tensor], batch: tf.Tensor, k: int, slots: list[int | None] | None = None,
               summed: int = 0) -> tf.Tensor:
    """[B, 2k + summed * k]: S_p = sum_f v_f, per k Q_p = sum_f v_f^2 (not summed over k), and the
    ``summed`` fields' T_p (``slots``: as in ``fm_partial``)."""
    return _sums_and_squares(embs, batch, k, tf.square, k, slots, summed)


def bi_combine(total: tf.Tensor, k: int, summed: int = 0) -> tf.Tensor:
    """[B, k] bi-interaction from the summed [B, 2k + summed * k]."""
    q = total[:, k:2 * k]
    if summed:
        squares = tf.reshape(tf.square(total[:, 2 * k:]), tf.stack([tf.shape(total)[0], summed, k]))
        q = q + tf.reduce_sum(squares, axis=1)
    return 0.5 * (tf.square(total[:, :k]) - q)

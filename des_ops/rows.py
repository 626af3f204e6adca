"""The first Dense layer by moving rows (``des.transform(first_dense="rows")``, data-parallel tail).

With partials, process p multiplies its fields' rows E_p [B, w_p] by its kernel rows W_p for the
whole batch and the [B, H] sums are reduce-scattered: 2 B H floats per step on the wire, whatever
N. With rows, p sends each process q the rows of q's samples, E_p[rows_q] (an all-to-all), the
kernel rows are all-gathered, and q multiplies its samples' whole input row by the whole kernel:

    Y_q = [E_0[rows_q] | E_1[rows_q] | ... ] @ [W_0; W_1; ...]        (ranks' blocks in rank order)

Backward: dE = dY_q W^T goes back to the fields' owners (the reverse all-to-all), and each owner
receives every process's share of dW_p = sum_q E_p[rows_q]^T dY_q (an all-to-all of kernel
blocks, summed in rank order), so the kernel rows stay where they were: owned, checkpointed and
updated by their owner only. Per process and step about 2 (B w/N + w H)(N-1)/N floats against
2 B H (N-1)/N (w: the width of all the fields' rows): fewer when w (B/N + H) < B H, i.e. for
wide layers and many processes. Exact: the same products, summed in another order.

    >>> from des_ops.comm import LocalCommunicator
    >>> comm = LocalCommunicator()
    >>> e, w = tf.constant([[1.0, 2.0], [3.0, 4.0]]), tf.constant([[1.0], [10.0]])
    >>> with tf.GradientTape() as tape:
    ...     tape.watch([e, w])
    ...     y = rows_dense(comm, e, w, [2], tf.zeros([]), "demo")
    >>> y.numpy().ravel().tolist(), [g.numpy().ravel().tolist() for g in tape.gradient(y, [e, w])]
    ([21.0, 43.0], [[1.0, 10.0, 1.0, 10.0], [4.0, 6.0]])
"""
from __future__ import annotations

import tensorflow as tf

from des_ops.comm import Communicator, nbytes, not_folded, shard_rows, variable_zero


def _shard_sizes(batch: tf.Tensor, n: int) -> tf.Tensor:
    """[n] int32: rows of a batch of ``batch`` rows on each process (des_ops.comm.shard_rows)."""
    return tf.stack([tf.cast(hi - lo, tf.int32) for lo, hi in (shard_rows(batch, r, n) for r in range(n))])


def rows_dense(comm: Communicator, e: tf.Tensor, kernel: tf.Tensor, rank_widths: list[int], anchor: tf.Tensor,
               name: str) -> tf.Tensor:
    """This process's rows (``shard_rows``) of concat_p(E_p) @ concat_p(W_p) over all processes p.

    ``e`` [B, w_r]: this process's fields' rows (w_r = ``rank_widths[rank]``, 0 for a process that
    owns none); ``kernel`` [w_r, H]: its kernel rows; ``rank_widths``: w_p of every process, the
    same list everywhere; ``anchor``: a trainable scalar (its gradient is 0) so that every process
    runs the backward's collectives even when it holds no trainable input. Collectives:
    ``<name>_rows``, ``<name>_kernel`` (counted under ``step``), ``<name>_rows_grad``,
    ``<name>_kernel_grad`` (under ``tail``)."""
    n, r = comm.world_size, comm.rank
    widths = [int(w) for w in rank_widths]
    if len(widths) != n or widths[r] != int(e.shape[1]) or widths[r] != int(kernel.shape[0]):
        raise ValueError(f"rows_dense: rank {r} holds rows of width {e.shape[1]} and {kernel.shape[0]} kernel rows; "
                         f"the plan says widths {widths} for {n} processes")
    units = int(kernel.shape[1])

    @tf.custom_gradient
    def _rows_dense(e_p, w_p, a):
        batch = tf.shape(e_p, out_type=tf.int64)[0]
        sizes = _shard_sizes(batch, n)
        mine = sizes[r]
        flat = tf.reshape(e_p, [-1])                      # rows in batch order = grouped by destination
        with tf.control_dependencies([comm.count("step", nbytes(flat) + nbytes(w_p))]):
            got, _ = comm.alltoall(not_folded(comm, flat), sizes * widths[r], f"{name}_rows")
            kernel_all = tf.ensure_shape(comm.allgather(not_folded(comm, w_p), f"{name}_kernel"), [sum(widths), units])
        pieces = tf.split(got, tf.stack([mine * w for w in widths]), num=n)
        x = tf.concat([tf.reshape(p, tf.stack([mine, w])) for p, w in zip(pieces, widths)], axis=1)
        y = tf.matmul(x, kernel_all) + a * tf.cast(tf.minimum(mine, 0), tf.float32)

        def grad(dy):
            dx = tf.matmul(dy, kernel_all, transpose_b=True)                  # [b_r, w]
            dx_flat = tf.concat([tf.reshape(p, [-1]) for p in tf.split(dx, widths, axis=1)], 0)
            dk = tf.matmul(x, dy, transpose_a=True)                            # [w, H], every process's share
            dk_flat = tf.reshape(dk, [-1])                                    # blocks in rank order
            with tf.control_dependencies([comm.count("tail", nbytes(dx_flat) + nbytes(dk_flat))]):
                back, _ = comm.alltoall(not_folded(comm, dx_flat), tf.stack([mine * w for w in widths]),
                                        f"{name}_rows_grad")
                shares, _ = comm.alltoall(not_folded(comm, dk_flat), tf.constant([w * units for w in widths], tf.int32),
                                          f"{name}_kernel_grad")
            de = tf.reshape(back, tf.stack([tf.cast(batch, tf.int32), widths[r]]))   # sources in rank order = rows
            parts = tf.split(shares, n) if n > 1 else [shares]
            dw = parts[0]
            for part in parts[1:]:                                            # in rank order: the same bits
                dw = dw + part
            # the anchor's gradient (0) reads both all-to-alls: Horovod's collectives are stateless ops,
            # and on a process whose rows and kernel gradients nothing needs (it owns no field) the
            # graph would drop them while the others wait for them
            da = (tf.reduce_sum(back) + tf.reduce_sum(shares)) * variable_zero(comm)
            return de, tf.reshape(dw, [widths[r], units]), da
        return y, grad

    return _rows_dense(e, kernel, anchor)


def rows_to_samples(comm: Communicator, e: tf.Tensor, rank_widths: list[int], anchor: tf.Tensor,
                    name: str) -> tf.Tensor:
    """This process's samples' rows (``shard_rows``) of every process's ``e``, side by side in rank
    order: [b_r, sum(rank_widths)]. ``e`` [B, w_r]: the rows this process owns (for a field vector
    no rule splits, des_ops.suboperators.FieldRowsSubOp, under the data-parallel tail); one
    all-to-all sends each process q the rows of q's samples, w_r (B/N) floats per destination
    instead of the whole batch's [B, sum(rank_widths)] partials a reduce-scatter hands over.
    Backward: the reverse all-to-all, each owner receiving its columns' gradient for the whole
    batch (sources in rank order = batch order). ``anchor``: a trainable scalar whose gradient (0)
    reads both all-to-alls, so that a process that owns no rows joins them. Collectives
    ``<name>`` (counted under ``step``) and ``<name>_grad`` (under ``tail``).

        >>> from des_ops.comm import LocalCommunicator
        >>> e = tf.constant([[1.0, 2.0], [3.0, 4.0]])
        >>> rows_to_samples(LocalCommunicator(), e, [2], tf.zeros([]), "demo").numpy().tolist()
        [[1.0, 2.0], [3.0, 4.0]]
    """
    n, r = comm.world_size, comm.rank
    widths = [int(w) for w in rank_widths]
    if len(widths) != n or widths[r] != int(e.shape[1]):
        raise ValueError(f"rows_to_samples: rank {r} holds rows of width {e.shape[1]}; the plan says widths "
                         f"{widths} for {n} processes")

    @tf.custom_gradient
    def _to_samples(e_p, a):
        batch = tf.shape(e_p, out_type=tf.int64)[0]
        sizes = _shard_sizes(batch, n)
        mine = sizes[r]
        flat = tf.reshape(e_p, [-1])                      # rows in batch order = grouped by destination
        with tf.control_dependencies([comm.count("step", nbytes(flat))]):
            got, _ = comm.alltoall(not_folded(comm, flat), sizes * widths[r], name)
        pieces = tf.split(got, tf.stack([mine * w for w in widths]), num=n)
        x = tf.concat([tf.reshape(p, tf.stack([mine, w])) for p, w in zip(pieces, widths)], axis=1)
        x = x + a * tf.cast(tf.minimum(mine, 0), tf.float32)

        def grad(dx):
            dx_flat = tf.concat([tf.reshape(p, [-1]) for p in tf.split(dx, widths, axis=1)], 0)
            with tf.control_dependencies([comm.count("tail", nbytes(dx_flat))]):
                back, _ = comm.alltoall(not_folded(comm, dx_flat), tf.stack([mine * w for w in widths]), f"{name}_grad")
            de = tf.reshape(back, tf.stack([tf.cast(batch, tf.int32), widths[r]]))
            return de, tf.reduce_sum(back) * variable_zero(comm)
        return x, grad

    return _to_samples(e, anchor)


def samples_bytes_per_step(batch: int, rank_widths: list[int], rank: int) -> tuple[int, int]:
    """(forward, backward) bytes process ``rank`` hands to ``rows_to_samples``'s all-to-alls per step
    of ``batch`` rows: its rows of the whole batch; the gradient of its samples' rows of every width."""
    lo, hi = shard_rows(batch, rank, len(rank_widths))
    return 4 * batch * rank_widths[rank], 4 * (hi - lo) * sum(rank_widths)


def bytes_per_step(batch: int, rank_widths: list[int], units: int, rank: int) -> tuple[int, int]:
    """(forward, backward) bytes process ``rank`` hands to ``rows_dense``'s collectives per step of
    ``batch`` rows: its rows of the whole batch and its kernel rows; the gradient of its samples'
    whole rows and of the whole kernel."""
    n = len(rank_widths)
    lo, hi = shard_rows(batch, rank, n)
    w, mine = sum(rank_widths), rank_widths[rank]
    return 4 * (batch * mine + mine * units), 4 * ((hi - lo) * w + w * units)


def wire_floats(batch: int, width: int, units: int, world_size: int) -> tuple[float, float]:
    """(rows, partials): floats one process sends per step for the first Dense layer, by moving
    rows (fields spread evenly) or by reduce-scattering partials (forward and backward)."""
    n = world_size
    share = (n - 1) / n
    return 2 * share * (batch * width / n + width * units), 2 * share * batch * units

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

import dataclasses

import numpy as np
import tensorflow as tf

from des_ops.comm import Communicator, nbytes, not_folded, shard_rows, variable_zero


@dataclasses.dataclass(frozen=True)
class Block:
    """One field vector's columns in a rows exchange: ``width`` floats per sample and ``key``, the
    model input (one id per sample) whose value decides the vector's value, or None. With a key,
    an owner sends each process each distinct id's row once (the first sample of that process's
    slice holding it): the receiver, which reads the same whole batch, knows the ids of its
    samples and puts every row back in place, so de-duplicated rows need no index on the wire."""
    width: int
    key: str | None = None


def blocks_of(rank_widths: list[int]) -> list[list[Block]]:
    """Keyless blocks, one per process of ``rank_widths[p]`` columns (none for 0)."""
    return [[Block(int(w))] if w else [] for w in rank_widths]


class _Selection:
    """Which rows of a batch slice [lo, hi) travel for one key: all of them (key None), or the first
    sample of each distinct id (``first``), and how to put them back (``idx``: the distinct id of
    every sample). Memoised per (key, slice): tf.unique runs once per key and slice."""

    def __init__(self, keys: dict, lo, hi):
        self.keys, self.lo, self.hi, self.memo = keys, lo, hi, {}

    def of(self, key: str | None):
        """(first, idx, count) of ``key`` on this slice; (None, None, rows) without a key."""
        if key is None:
            return None, None, self.hi - self.lo
        if key not in self.memo:
            ids, idx = tf.unique(self.keys[key][self.lo:self.hi], out_idx=tf.int64)
            count = tf.size(ids, out_type=tf.int64)
            first = tf.math.unsorted_segment_min(tf.range(self.hi - self.lo), idx, count)
            self.memo[key] = (first, idx, count)
        return self.memo[key]


@dataclasses.dataclass(frozen=True)
class _Group:
    """A process's blocks that share a key (or all its keyless ones), moved as one: their columns
    ``cols`` of the process's rows (in block order) side by side, ``width`` floats a row."""
    key: str | None
    cols: tuple[int, ...]

    @property
    def width(self) -> int:
        return len(self.cols)


def _groups(blocks: list[Block]) -> list[_Group]:
    """``blocks`` grouped by key, in order of first appearance (a field's embedding and linear
    weight read by one id input travel as one row: one gather, one split and one segment sum)."""
    cols: dict = {}
    start = 0
    for b in blocks:
        cols.setdefault(b.key, []).extend(range(start, start + b.width))
        start += b.width
    return [_Group(key, tuple(c)) for key, c in cols.items()]


def _runs(positions: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(tensor, position) pairs in order -> runs (tensor, start, stop) of consecutive positions."""
    runs: list[list[int]] = []
    for t, c in positions:
        if runs and runs[-1][0] == t and runs[-1][2] == c:
            runs[-1][2] = c + 1
        else:
            runs.append([t, c, c + 1])
    return [tuple(r) for r in runs]


def _join_columns(tensors: list[tf.Tensor], positions: list[tuple[int, int]]) -> tf.Tensor:
    """The columns ``positions`` [(tensor, column)] of ``tensors``, side by side: slices of their
    runs, concatenated (a column gather copies one float at a time)."""
    parts = [tensors[t] if (a, b) == (0, int(tensors[t].shape[1])) else tensors[t][:, a:b]
             for t, a, b in _runs(positions)]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)


def _columns(x: tf.Tensor, cols: tuple[int, ...]) -> tf.Tensor:
    """Columns ``cols`` of ``x``."""
    return _join_columns([x], [(0, c) for c in cols])


def _in_block_order(grouped: list[tf.Tensor], groups: list[list[_Group]]) -> tf.Tensor:
    """The groups' columns (``grouped``, one tensor per group of every process in order) put back
    in block order (every process's blocks in rank order)."""
    positions, first = [], 0
    for gs in groups:
        where = {c: (first + k, j) for k, g in enumerate(gs) for j, c in enumerate(g.cols)}
        positions += [where[c] for c in range(sum(g.width for g in gs))]
        first += len(gs)
    return _join_columns(grouped, positions)


class _Exchange:
    """The all-to-all that hands each process its samples' rows of every owner's blocks, and its
    reverse: ``forward(e)`` -> [b_r, sum of every block's width] (ranks in order, each rank's
    blocks in order); ``backward(dx)`` -> the gradient of this process's ``e`` for the whole batch.
    On the wire a process's blocks go grouped by key (_groups): per destination, each group's rows
    (one per distinct id of a keyed group) in group order. Plain ops: rows_to_samples and
    rows_dense wrap them in their custom gradients."""

    def __init__(self, comm: Communicator, blocks: list[list[Block]], keys: dict, batch: tf.Tensor, name: str):
        self.comm, self.name = comm, name
        n, r = comm.world_size, comm.rank
        self.groups = [_groups(bl) for bl in blocks]
        self.bounds = [shard_rows(batch, q, n) for q in range(n)]
        self.slices = [_Selection(keys, lo, hi) for lo, hi in self.bounds]
        self.sent = [[self.slices[q].of(g.key) for g in self.groups[r]] for q in range(n)]     # [dest][my group]
        self.got = [[self.slices[r].of(g.key) for g in self.groups[p]] for p in range(n)]     # [source][its group]

    def forward(self, e: tf.Tensor, also_counted=0) -> tf.Tensor:
        """``also_counted``: bytes of the caller's other collective, counted with these (one count)."""
        mine = self.groups[self.comm.rank]
        cols = [_columns(e, g.cols) for g in mine]
        pieces, splits = [], []
        for (lo, hi), sent in zip(self.bounds, self.sent):
            rows = [c[lo:hi] if first is None else tf.gather(c[lo:hi], first) for c, (first, _, _) in zip(cols, sent)]
            pieces += [tf.reshape(x, [-1]) for x in rows]
            splits.append(sum((count * g.width for g, (_, _, count) in zip(mine, sent)), tf.constant(0, tf.int64)))
        flat = tf.concat(pieces, 0) if pieces else tf.zeros([0], e.dtype)
        with tf.control_dependencies([self.comm.count("step", nbytes(flat) + also_counted)]):
            got, _ = self.comm.alltoall(not_folded(self.comm, flat), tf.cast(tf.stack(splits), tf.int32), self.name)
        flat_groups = [(g, sel) for p in range(self.comm.world_size) for g, sel in zip(self.groups[p], self.got[p])]
        if not flat_groups:
            lo, hi = self.bounds[self.comm.rank]
            return tf.zeros(tf.stack([hi - lo, 0]), e.dtype)
        parts = tf.split(got, tf.stack([count * g.width for g, (_, _, count) in flat_groups]), num=len(flat_groups))
        placed = [_placed(tf.reshape(x, [-1, g.width]), idx) for x, (g, (_, idx, _)) in zip(parts, flat_groups)]
        return _in_block_order(placed, self.groups)

    def backward(self, dx: tf.Tensor, also_counted=0) -> tuple[tf.Tensor, tf.Tensor]:
        """(the gradient of this process's ``e``, [B, its width]; what came back, for the anchor)."""
        n, r = self.comm.world_size, self.comm.rank
        pieces, splits, offset = [], [], 0
        for p in range(n):
            total = tf.constant(0, tf.int64)
            for g, (_, idx, count) in zip(self.groups[p], self.got[p]):
                d = _columns(dx, tuple(offset + c for c in g.cols))
                pieces.append(tf.reshape(d if idx is None else tf.math.unsorted_segment_sum(d, idx, count), [-1]))
                total += count * g.width
            offset += sum(g.width for g in self.groups[p])
            splits.append(total)
        flat = tf.concat(pieces, 0) if pieces else tf.zeros([0], dx.dtype)
        with tf.control_dependencies([self.comm.count("tail", nbytes(flat) + also_counted)]):
            back, _ = self.comm.alltoall(not_folded(self.comm, flat), tf.cast(tf.stack(splits), tf.int32),
                                         f"{self.name}_grad")
        mine = self.groups[r]
        batch = self.bounds[-1][1]
        if not mine:
            return tf.zeros(tf.stack([batch, 0]), dx.dtype), back
        order = [(q, k) for q in range(n) for k in range(len(mine))]      # as sent: by destination, then group
        sizes = [self.sent[q][k][2] * mine[k].width for q, k in order]
        got = dict(zip(order, tf.split(back, tf.stack(sizes), num=len(order))))
        columns = []
        for k, g in enumerate(mine):
            rows = []
            for q, (lo, hi) in enumerate(self.bounds):
                first = self.sent[q][k][0]
                d = tf.reshape(got[q, k], [-1, g.width])
                rows.append(d if first is None else
                            tf.scatter_nd(first[:, None], d, tf.stack([hi - lo, tf.constant(g.width, tf.int64)])))
            columns.append(tf.concat(rows, axis=0))
        return _in_block_order(columns, [mine]), back


def _placed(rows: tf.Tensor, idx) -> tf.Tensor:
    """Rows back at their samples: ``rows`` as they came (idx None) or one per distinct id."""
    return rows if idx is None else tf.gather(rows, idx)


def _flat_keys(keys: dict | None) -> dict:
    return {name: tf.reshape(t, [-1]) for name, t in (keys or {}).items()}


def _check_blocks(fn: str, comm: Communicator, e: tf.Tensor, blocks: list[list[Block]], keys: dict) -> None:
    n, r = comm.world_size, comm.rank
    if len(blocks) != n or sum(b.width for b in blocks[r]) != int(e.shape[1]):
        raise ValueError(f"{fn}: rank {r} holds rows of width {e.shape[1]}; the plan says widths "
                         f"{[sum(b.width for b in bl) for bl in blocks]} for {n} processes")
    missing = sorted({b.key for bl in blocks for b in bl if b.key is not None} - set(keys))
    if missing:
        raise ValueError(f"{fn}: no ids given for the keys {missing}")


def rows_dense(comm: Communicator, e: tf.Tensor, kernel: tf.Tensor, rank_widths: list[int], anchor: tf.Tensor,
               name: str, blocks: list[list[Block]] | None = None, keys: dict | None = None) -> tf.Tensor:
    """This process's rows (``shard_rows``) of concat_p(E_p) @ concat_p(W_p) over all processes p.

    ``e`` [B, w_r]: this process's fields' rows (w_r = ``rank_widths[rank]``, 0 for a process that
    owns none); ``kernel`` [w_r, H]: its kernel rows; ``rank_widths``: w_p of every process, the
    same list everywhere; ``blocks`` (optional): each process's field vectors as Blocks (widths
    summing to w_p), whose keyed ones travel de-duplicated with ``keys`` {input name: the whole
    batch's ids}; ``anchor``: a trainable scalar (its gradient is 0) so that every process
    runs the backward's collectives even when it holds no trainable input. Collectives:
    ``<name>_rows``, ``<name>_kernel`` (counted under ``step``), ``<name>_rows_grad``,
    ``<name>_kernel_grad`` (under ``tail``)."""
    n, r = comm.world_size, comm.rank
    widths = [int(w) for w in rank_widths]
    blocks = blocks if blocks is not None else blocks_of(widths)
    if len(widths) != n or widths[r] != int(kernel.shape[0]) or [sum(b.width for b in bl) for bl in blocks] != widths:
        raise ValueError(f"rows_dense: rank {r} holds rows of width {e.shape[1]} and {kernel.shape[0]} kernel rows; "
                         f"the plan says widths {widths} for {n} processes")
    keys = _flat_keys(keys)
    _check_blocks("rows_dense", comm, e, blocks, keys)
    units = int(kernel.shape[1])

    @tf.custom_gradient
    def _rows_dense(e_p, w_p, a):
        exchange = _Exchange(comm, blocks, keys, tf.shape(e_p, out_type=tf.int64)[0], f"{name}_rows")
        x = exchange.forward(e_p, also_counted=nbytes(w_p))
        with tf.control_dependencies([x]):
            kernel_all = tf.ensure_shape(comm.allgather(not_folded(comm, w_p), f"{name}_kernel"), [sum(widths), units])
        mine = tf.shape(x)[0]
        y = tf.matmul(x, kernel_all) + a * tf.cast(tf.minimum(mine, 0), tf.float32)

        def grad(dy):
            dk = tf.matmul(x, dy, transpose_a=True)                            # [w, H], every process's share
            dk_flat = tf.reshape(dk, [-1])                                    # blocks in rank order
            de, back = exchange.backward(tf.matmul(dy, kernel_all, transpose_b=True), also_counted=nbytes(dk_flat))
            with tf.control_dependencies([back]):
                shares, _ = comm.alltoall(not_folded(comm, dk_flat), tf.constant([w * units for w in widths], tf.int32),
                                          f"{name}_kernel_grad")
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
                    name: str, blocks: list[list[Block]] | None = None, keys: dict | None = None) -> tf.Tensor:
    """This process's samples' rows (``shard_rows``) of every process's ``e``, side by side in rank
    order: [b_r, sum(rank_widths)]. ``e`` [B, w_r]: the rows this process owns (for a field vector
    no rule splits, des_ops.suboperators.FieldRowsSubOp, under the data-parallel tail); one
    all-to-all sends each process q the rows of q's samples, w_r (B/N) floats per destination
    instead of the whole batch's [B, sum(rank_widths)] partials a reduce-scatter hands over; with
    ``blocks`` and ``keys`` (as in rows_dense) a keyed block's rows go once per distinct id.
    Backward: the reverse all-to-all, each owner receiving its columns' gradient for the whole
    batch (a distinct id's summed over its samples, at its first one). ``anchor``: a trainable
    scalar whose gradient (0) reads both all-to-alls, so that a process that owns no rows joins
    them. Collectives ``<name>`` (counted under ``step``) and ``<name>_grad`` (under ``tail``).

        >>> from des_ops.comm import LocalCommunicator
        >>> e = tf.constant([[1.0, 2.0], [3.0, 4.0], [1.0, 2.0]])
        >>> rows_to_samples(LocalCommunicator(), e, [2], tf.zeros([]), "demo").numpy().tolist()
        [[1.0, 2.0], [3.0, 4.0], [1.0, 2.0]]
        >>> ids = {"user": tf.constant([7, 9, 7], tf.int64)}        # rows 0 and 2 are user 7's: sent once
        >>> rows_to_samples(LocalCommunicator(), e, [2], tf.zeros([]), "demo", [[Block(2, "user")]], ids).numpy().tolist()
        [[1.0, 2.0], [3.0, 4.0], [1.0, 2.0]]
    """
    n, r = comm.world_size, comm.rank
    widths = [int(w) for w in rank_widths]
    blocks = blocks if blocks is not None else blocks_of(widths)
    if len(widths) != n or widths[r] != int(e.shape[1]) or [sum(b.width for b in bl) for bl in blocks] != widths:
        raise ValueError(f"rows_to_samples: rank {r} holds rows of width {e.shape[1]}; the plan says widths "
                         f"{widths} for {n} processes")
    keys = _flat_keys(keys)
    _check_blocks("rows_to_samples", comm, e, blocks, keys)

    @tf.custom_gradient
    def _to_samples(e_p, a):
        exchange = _Exchange(comm, blocks, keys, tf.shape(e_p, out_type=tf.int64)[0], name)
        x = exchange.forward(e_p)
        x = x + a * tf.cast(tf.minimum(tf.shape(x)[0], 0), tf.float32)

        def grad(dx):
            de, back = exchange.backward(dx)
            return de, tf.reduce_sum(back) * variable_zero(comm)
        return x, grad

    return _to_samples(e, anchor)


def distinct_rows(ids: dict, blocks: list[list[Block]], batch: int, rank: int) -> tuple[int, int]:
    """(floats process ``rank`` sends, floats it receives) in a rows exchange of one batch of
    ``batch`` rows, counted in numpy from ``ids`` {key: [batch] ids}: per destination (per source)
    slice and block, the block's width times the slice's distinct ids of a keyed block, else its rows."""
    n = len(blocks)

    def rows(block: Block, q: int) -> int:
        lo, hi = shard_rows(batch, q, n)
        return len(np.unique(np.asarray(ids[block.key]).reshape(-1)[lo:hi])) if block.key else hi - lo
    sent = sum(rows(b, q) * b.width for q in range(n) for b in blocks[rank])
    got = sum(rows(b, rank) * b.width for p in range(n) for b in blocks[p])
    return sent, got


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


def wire_floats(batch: int, width: int, units: int, world_size: int, distinct: float = 1.0) -> tuple[float, float]:
    """(rows, partials): floats one process sends per step for the first Dense layer, by moving
    rows (fields spread evenly; ``distinct``: the share of a slice's rows that travel, one per
    distinct id, see Block) or by reduce-scattering partials (forward and backward)."""
    n = world_size
    share = (n - 1) / n
    return 2 * share * (batch * width / n * distinct + width * units), 2 * share * batch * units

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
    samples and puts every row back in place, so de-duplicated rows need no index on the wire.
    ``apart``: blocks of one key travel in one row unless their ``apart`` differ (a table split by
    key stripe keeps its own rows together: no per-position interleave to build and undo); the
    rows then travel in lanes of their own, which still share the key's de-duplication."""
    width: int
    key: str | None = None
    apart: str = ""


def _column_of(key: str) -> tuple[str, int | None]:
    """``name[f]`` -> (name, f); any other key -> (key, None)."""
    name, _, col = key.rpartition("[")
    return (name, int(col[:-1])) if name and col.endswith("]") and col[:-1].isdigit() else (key, None)


def _stripe_of(key: str) -> tuple[str, int, int | None, int | None]:
    """``base[+offset][@r/N]`` -> (base, offset, r, N): a position of a table split by key stripe
    (des.graph.fields.FieldAnalysis.stripe_keys; des_ops.stripes) reads ids + offset, and its
    stripe r of N keeps its own keys; others -> (key, 0, None, None)."""
    base, stripe, count = key, None, None
    head, at, tail = key.rpartition("@")
    if at and "/" in tail and all(p.isdigit() for p in tail.split("/", 1)):
        base, (stripe, count) = head, map(int, tail.split("/", 1))
    head, plus, off = base.rpartition("+")
    if plus and off.lstrip("-").isdigit():
        return head, int(off), stripe, count
    return base, 0, stripe, count


def unstriped(key: str | None) -> str | None:
    """``key`` without a key stripe's ``@r/N``: the ids of every stripe (None stays None)."""
    if key is None or _stripe_of(key)[2] is None:
        return key
    return key.rpartition("@")[0]


def key_ids(source: dict, key: str):
    """The ids ``key`` names in ``source`` (model inputs or a sample batch): the input itself, or for
    ``name[f]`` column f of input ``name`` (a position of ids + offsets, des.graph.fields.row_key);
    ``...+o@r/N``: those ids plus o where they are keys of stripe r of N, elsewhere one other key
    (the rows of other stripes, zeros, then travel once a slice).

        >>> key_ids({"ids": np.array([[1, 2], [3, 4]])}, "ids[1]").tolist()
        [2, 4]
        >>> key_ids({"ids": np.array([[1, 2], [3, 4]])}, "ids[1]+1@1/2").tolist()     # keys 3 and 5: odd
        [3, 5]
        >>> key_ids({"ids": np.array([[1, 2], [3, 4]])}, "ids[0]@0/2").tolist()       # 1 and 3 are not even
        [1, 1]
    """
    base, offset, stripe, count = _stripe_of(key)
    if base != key:
        ids = key_ids(source, base)
        ids = ids + offset if offset else ids
        if stripe is None:
            return ids
        if isinstance(ids, tf.Tensor):
            ids = tf.cast(ids, tf.int64)
            return tf.where(tf.equal(tf.math.floormod(ids, count), stripe), ids, tf.constant((stripe + 1) % count, tf.int64))
        ids = np.asarray(ids, np.int64)
        return np.where(np.mod(ids, count) == stripe, ids, (stripe + 1) % count)
    if key in source:
        return source[key]
    name, col = _column_of(key)
    if col is not None and name in source:
        return source[name][:, col]
    raise KeyError(key)


def key_input(key: str) -> str:
    """The model input a key reads: ``name`` for ``name[f]`` (and its stripe keys), else the key itself."""
    return _column_of(_stripe_of(key)[0])[0]


def blocks_of(rank_widths: list[int]) -> list[list[Block]]:
    """Keyless blocks, one per process of ``rank_widths[p]`` columns (none for 0)."""
    return [[Block(int(w))] if w else [] for w in rank_widths]


@dataclasses.dataclass(frozen=True)
class _Group:
    """A process's blocks that share a key (or all its keyless ones): their columns ``cols`` of
    the process's rows (in block order), one row of ``width`` floats per sample."""
    key: str | None
    cols: tuple[int, ...]

    @property
    def width(self) -> int:
        return len(self.cols)


def _groups(blocks: list[Block]) -> list[_Group]:
    """``blocks`` grouped by key, in order of first appearance (a field's embedding and linear
    weight read by one id input travel as one row)."""
    cols: dict = {}
    start = 0
    for b in blocks:
        cols.setdefault((b.key, b.apart if b.key is not None else ""), []).extend(range(start, start + b.width))
        start += b.width
    return [_Group(key, tuple(c)) for (key, _), c in cols.items()]


@dataclasses.dataclass(frozen=True)
class _Lane:
    """A process's groups of one row width, moved as ONE tensor: ``keys`` (a group's each, in
    order; (None,) for the keyless columns, which are one group), rows of ``width`` floats and
    ``cols``, the groups' columns of the process's rows one group after another, so that the
    lane is [B, G * width] viewed as [B * G, width]: a few ops per lane, not per field."""
    keys: tuple
    width: int
    cols: tuple[int, ...]
    apart: str = ""


def _lanes(blocks: list[Block]) -> list[_Lane]:
    """The lanes of one process's ``blocks``: its keyed groups (_groups) by width, the keyless
    columns on their own, in order of first appearance.

        >>> [(l.keys, l.width, l.cols) for l in _lanes([Block(2, "a"), Block(1, "a"), Block(3, "b"), Block(2)])]
        [(('a', 'b'), 3, (0, 1, 2, 3, 4, 5)), ((None,), 2, (6, 7))]
    """
    lanes: dict = {}
    for g, apart in zip(_groups(blocks), _aparts(blocks)):
        keys, cols = lanes.setdefault(None if g.key is None else (g.width, apart), ([], []))
        keys.append(g.key)
        cols.extend(g.cols)
    return [_Lane(tuple(keys), len(cols) if w is None else w[0], tuple(cols), "" if w is None else w[1])
            for w, (keys, cols) in lanes.items()]


def _aparts(blocks: list[Block]) -> list[str]:
    """Each group's ``apart``, in _groups' order."""
    return [apart for _, apart in dict.fromkeys((b.key, b.apart if b.key is not None else "") for b in blocks)]


def wire_order(blocks: list[Block]) -> list[int]:
    """An order of ``blocks`` (indices) in which each lane's columns are one run, lanes in order:
    a caller that lays its rows out so moves each lane with one slice, not a column gather.

        >>> wire_order([Block(2, "a"), Block(3, "b"), Block(1, "a"), Block(2)])
        [0, 2, 1, 3]
    """
    start, where = 0, {}
    for k, b in enumerate(blocks):
        where[start] = k
        start += b.width
    return [where[c] for lane in _lanes(blocks) for c in lane.cols if c in where]


class KeyIds:
    """The ids of the keys a rows exchange travels by (Block.key), read from ``source`` (the model
    inputs, or {key: ids}) by key_ids when first asked, each flattened to [B]. ``matrix(keys, lo,
    hi)``: rows [lo, hi) of G keys as [hi - lo, G]; when they are integer inputs or their columns
    with one stripe (a table of several fields in one key space: 39 positions and N stripes), one
    stack (or slice), one add of the offsets and one stripe mask, not a slice and a mask per key.

        >>> ids = KeyIds({"ids": tf.constant([[1, 2], [3, 4]], tf.int64)})
        >>> ids.matrix(("ids[0]@1/2", "ids[1]+1@1/2")).numpy().tolist()     # odd keys, others 0
        [[1, 3], [3, 5]]
        >>> ids.resolves("ids[1]"), ids.resolves("user"), ids["ids[1]"].numpy().tolist()
        (True, False, [2, 4])
        >>> mixed = {"a": tf.constant([4, 5], tf.int32), "b": tf.constant([[6], [7]], tf.int64)}
        >>> KeyIds(mixed).matrix(("a@0/2", "b@0/2"), 1, 2).numpy().tolist()      # 5 and 7 are not even
        [[1, 1]]
    """

    def __init__(self, source: dict | None):
        self.source, self.memo, self.stacked = source or {}, {}, {}

    def resolves(self, key: str) -> bool:
        return key in self.source or key_input(key) in self.source

    def __getitem__(self, key: str) -> tf.Tensor:
        if key not in self.memo:
            self.memo[key] = tf.reshape(key_ids(self.source, key), [-1])
        return self.memo[key]

    def matrix(self, keys: tuple, lo=None, hi=None):
        """[hi - lo, G] int64 of G > 1 keys of one stripe (or none) that read integer inputs as they are or
        their columns; else the keys' [hi - lo] ids, a list (_packed stacks them)."""
        parsed = [_parts(k) for k in keys]
        sources = [self.source.get(name) for name, *_ in parsed]
        if (len(keys) == 1 or any(x is None or not tf.as_dtype(x.dtype).is_integer for x in sources)
                or len({(stripe, count) for *_, stripe, count in parsed}) != 1):
            return [self[k] if lo is None else self[k][lo:hi] for k in keys]
        columns = tuple((name, col) for name, col, *_ in parsed)
        if columns not in self.stacked:        # the whole batch's, once for every slice and stripe
            self.stacked[columns] = self._side_by_side(columns)
        x = self.stacked[columns] if lo is None else self.stacked[columns][lo:hi]
        offsets, (*_, stripe, count) = [p[2] for p in parsed], parsed[0]
        if any(offsets):
            x = x + tf.constant([offsets], tf.int64)
        if stripe is not None:
            x = tf.where(tf.equal(tf.math.floormod(x, count), stripe), x, tf.constant((stripe + 1) % count, tf.int64))
        return x

    def _side_by_side(self, columns: tuple) -> tf.Tensor:
        """[B, G] int64: the inputs (one id a sample) or input columns ``columns`` ((name, column or None))."""
        names, cols = {name for name, _ in columns}, [col for _, col in columns]
        x = tf.convert_to_tensor(self.source[columns[0][0]])
        if len(names) == 1 and None not in cols and x.shape.rank == 2:     # positions of one [B, P] input
            return tf.cast(x if cols == list(range(x.shape[1] or -1)) else tf.gather(x, cols, axis=1), tf.int64)
        column = lambda x, col: tf.reshape(x, [-1]) if col is None else x[:, col]  # noqa: E731
        return tf.stack([tf.cast(column(tf.convert_to_tensor(self.source[name]), col), tf.int64)
                         for name, col in columns], axis=1)


def _parts(key: str) -> tuple:
    """(input, column or None, offset, stripe or None, count or None) of a key ``name[f][+o][@r/N]``."""
    base, offset, stripe, count = _stripe_of(key)
    return (*_column_of(base), offset, stripe, count)


def _packed(keys) -> tf.Tensor:
    """[B, G] from G keys (a list of [B] ids, or KeyIds.matrix's [B, G]): equal exactly where (key,
    id) pairs are equal. One key as it is (any dtype tf.unique takes: int32, int64, string); integer
    ids in [0, 2**(63 - bits)) packed into one int64 as ``group << (63 - bits) | id`` (bits: enough
    for G groups); other ids (negative, too large, strings) through each key's tf.unique index,
    ``group * B + index``."""
    whole = keys if isinstance(keys, tf.Tensor) else None
    if whole is None:
        if len(keys) == 1:
            return keys[0][:, None]
        keys = [tf.cast(k, tf.int64) if k.dtype.is_integer else k for k in keys]
    count = len(keys) if whole is None else int(whole.shape[1])

    def by_index():
        columns = keys if whole is None else tf.unstack(whole, axis=1)
        index = tf.stack([tf.unique(key, out_idx=tf.int64)[1] for key in columns], axis=1)
        return index + tf.range(count, dtype=tf.int64)[None, :] * tf.shape(columns[0], out_type=tf.int64)[0]
    if whole is None and not all(k.dtype.is_integer for k in keys):
        return by_index()
    k = tf.stack(keys, axis=1) if whole is None else whole
    shift = 63 - (count - 1).bit_length()
    fits = tf.logical_and(tf.reduce_min(k) >= 0, tf.reduce_max(k) < 2 ** shift)
    groups = tf.constant([[g << shift for g in range(count)]], tf.int64)
    return tf.cond(fits, lambda: tf.bitwise.bitwise_or(k, groups), by_index)


class _Selection:
    """Which rows of each lane travel to each batch slice [lo, hi): all of them (keyless), or
    per distinct (group, id) pair the first of them in the slice's rows [b * G + group]
    (``first``), and how to put them back (``idx``: the distinct pair of every row). Memoised per
    (lane keys, slice): one tf.unique per lane and slice, the same on sender and receiver (the
    distinct pairs in order of first appearance, however the keys were packed). The keys of the
    lanes in ``whole`` (a sender's, needed for every slice) are packed once for the whole batch;
    the others (a receiver's of another process, needed for its own slice only) slice by slice."""

    def __init__(self, keys: KeyIds, bounds: list, whole: set = frozenset()):
        self.keys, self.bounds, self.whole, self.packed, self.memo = keys, bounds, set(whole), {}, {}
        self.masked: dict = {}

    def keys_at(self, lane: _Lane, q: int) -> tf.Tensor:
        """The key (int64, as key_ids reads it) of each distinct pair ``of(lane, q)`` selects, in its order."""
        first, _, _ = self.of(lane, q)
        lo, hi = self.bounds[q]
        if lane.keys not in self.masked:
            m = self.keys.matrix(lane.keys)
            self.masked[lane.keys] = m if isinstance(m, tf.Tensor) else tf.stack([tf.cast(k, tf.int64) for k in m], 1)
        return tf.gather(tf.reshape(self.masked[lane.keys][lo:hi], [-1]), first)

    def of(self, lane: _Lane, q: int):
        """(first, idx, count) of ``lane`` on slice ``q``; (None, None, rows) for a keyless lane."""
        lo, hi = self.bounds[q]
        if lane.keys == (None,):
            return None, None, hi - lo
        if (lane.keys, q) not in self.memo:
            if lane.keys not in self.whole:
                rows = tf.reshape(_packed(self.keys.matrix(lane.keys, lo, hi)), [-1])
            else:
                if lane.keys not in self.packed:
                    self.packed[lane.keys] = _packed(self.keys.matrix(lane.keys))
                rows = tf.reshape(self.packed[lane.keys][lo:hi], [-1])
            ids, idx = tf.unique(rows, out_idx=tf.int64)
            count = tf.size(ids, out_type=tf.int64)
            first = tf.math.unsorted_segment_min(tf.range(tf.size(rows, out_type=tf.int64)), idx, count)
            self.memo[lane.keys, q] = (first, idx, count)
        return self.memo[lane.keys, q]


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
    # a whole tensor as it is; a gradient may come without its static width (then always a slice)
    parts = [tensors[t] if (a, b) == (0, tensors[t].shape[1]) else tensors[t][:, a:b]
             for t, a, b in _runs(positions)]
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=1)


def _columns(x: tf.Tensor, cols: tuple[int, ...]) -> tf.Tensor:
    """Columns ``cols`` of ``x``."""
    return _join_columns([x], [(0, c) for c in cols])


def _in_block_order(laned: list[tf.Tensor], lanes: list[list[_Lane]]) -> tf.Tensor:
    """The lanes' columns (``laned``, one tensor per lane of every process in order) put back in
    block order (every process's blocks in rank order)."""
    positions, first = [], 0
    for ls in lanes:
        where = {c: (first + k, j) for k, lane in enumerate(ls) for j, c in enumerate(lane.cols)}
        positions += [where[c] for c in range(len(where))]
        first += len(ls)
    return _join_columns(laned, positions)


class _Exchange:
    """The all-to-all that hands each process its samples' rows of every owner's blocks, and its
    reverse: ``forward(e)`` -> [b_r, sum of every block's width] (ranks in order, each rank's
    blocks in order); ``backward(dx)`` -> the gradient of this process's ``e`` for the whole batch.
    On the wire a process's blocks go by lane (_lanes): per destination, each lane's rows (one
    per distinct (group, id) of a keyed lane) in lane order. Plain ops: rows_to_samples and
    rows_dense wrap them in their custom gradients."""

    def __init__(self, comm: Communicator, blocks: list[list[Block]], keys: KeyIds, batch: tf.Tensor, name: str):
        self.comm, self.name = comm, name
        n, r = comm.world_size, comm.rank
        self.lanes = [_lanes(bl) for bl in blocks]
        self.bounds = [shard_rows(batch, q, n) for q in range(n)]
        select = self.select = _Selection(keys, self.bounds, {lane.keys for lane in self.lanes[r]})
        self.sent = [[select.of(lane, q) for lane in self.lanes[r]] for q in range(n)]     # [dest][my lane]
        self.got = [[select.of(lane, r) for lane in self.lanes[p]] for p in range(n)]      # [source][its lane]

    def forward(self, e: tf.Tensor | None, also_counted=0, picked: dict | None = None) -> tf.Tensor:
        """``also_counted``: bytes of the caller's other collective, counted with these (one count).
        ``picked`` {lane k of this process: its rows as they travel, [picked_keys(...)[k], width]}: those
        lanes are sent as given, not picked from ``e`` (None when every lane is picked)."""
        picked = picked or {}
        n, mine = self.comm.world_size, self.lanes[self.comm.rank]
        rows = {k: tf.reshape(_columns(e, lane.cols), [-1, lane.width])                   # [B * G, width]
                for k, lane in enumerate(mine) if k not in picked}
        per = {k: tf.split(x, tf.stack([self.sent[q][k][2] for q in range(n)]), num=n) for k, x in picked.items()}
        pieces, splits = [], []
        for q, ((lo, hi), sent) in enumerate(zip(self.bounds, self.sent)):
            total = tf.constant(0, tf.int64)
            for k, (lane, (first, _, count)) in enumerate(zip(mine, sent)):
                if k in per:
                    part = per[k][q]
                else:
                    g = len(lane.keys)
                    part = rows[k][lo * g:hi * g]
                    part = part if first is None else tf.gather(part, first)
                pieces.append(tf.reshape(part, [-1]))
                total += count * lane.width
            splits.append(total)
        return self._received(pieces, splits, tf.float32 if e is None else e.dtype, also_counted)

    def picked_keys(self, chosen: list[int]) -> dict[int, tf.Tensor]:
        """{lane k of this process, for k in ``chosen`` (keyed lanes): the keys of the rows it sends,
        each destination's distinct pairs (_Selection) one destination after another}; lanes of the
        same keys get the same tensor."""
        memo: dict = {}
        mine = self.lanes[self.comm.rank]
        for k in chosen:
            if mine[k].keys not in memo:
                memo[mine[k].keys] = tf.concat([self.select.keys_at(mine[k], q) for q in range(self.comm.world_size)], 0)
        return {k: memo[mine[k].keys] for k in chosen}

    def _received(self, pieces: list, splits: list, dtype, also_counted=0) -> tf.Tensor:
        """Send ``pieces`` (splits[q] floats to process q), and put what came back at this process's samples."""
        flat = tf.concat(pieces, 0) if pieces else tf.zeros([0], dtype)
        with tf.control_dependencies([self.comm.count("step", nbytes(flat) + also_counted)]):
            got, _ = self.comm.alltoall(not_folded(self.comm, flat), tf.cast(tf.stack(splits), tf.int32), self.name)
        flat_lanes = [(lane, sel) for p in range(self.comm.world_size) for lane, sel in zip(self.lanes[p], self.got[p])]
        if not flat_lanes:
            lo, hi = self.bounds[self.comm.rank]
            return tf.zeros(tf.stack([hi - lo, 0]), dtype)
        parts = tf.split(got, tf.stack([count * lane.width for lane, (_, _, count) in flat_lanes]), num=len(flat_lanes))
        placed = [tf.reshape(_placed(tf.reshape(x, [-1, lane.width]), idx), [-1, len(lane.cols)])
                  for x, (lane, (_, idx, _)) in zip(parts, flat_lanes)]
        return _in_block_order(placed, self.lanes)

    def backward(self, dx: tf.Tensor, also_counted=0, picked=()) -> tuple[tf.Tensor, dict, tf.Tensor]:
        """(the gradient of this process's ``e``, [B, its width], zeros in the columns of the lanes
        ``picked`` (as forward's); {picked lane k: the gradient of its rows}; what came back, for the
        anchor)."""
        got, back = self._returned(dx, also_counted)
        n, mine = self.comm.world_size, self.lanes[self.comm.rank]
        batch = self.bounds[-1][1]
        if not mine:
            return tf.zeros(tf.stack([batch, 0]), dx.dtype), {}, back
        d_picked = {k: tf.concat([tf.reshape(got[q, k], [-1, mine[k].width]) for q in range(n)], 0) for k in picked}
        columns = []
        for k, lane in enumerate(mine):
            if k in d_picked:
                columns.append(tf.zeros(tf.stack([batch, len(lane.cols)]), dx.dtype))
                continue
            rows = []
            for q, (lo, hi) in enumerate(self.bounds):
                first = self.sent[q][k][0]
                d = tf.reshape(got[q, k], [-1, lane.width])
                shape = tf.stack([(hi - lo) * len(lane.keys), tf.constant(lane.width, tf.int64)])
                rows.append(d if first is None else tf.scatter_nd(first[:, None], d, shape))
            columns.append(tf.reshape(tf.concat(rows, axis=0), [-1, len(lane.cols)]))
        de = None if len(d_picked) == len(mine) else _in_block_order(columns, [mine])
        return de, d_picked, back

    def _returned(self, dx: tf.Tensor, also_counted=0) -> tuple[dict, tf.Tensor]:
        """Send each owner the gradient of the rows it sent (one per distinct pair: the sum over its
        samples); ({(destination q, lane k): what came back for the rows sent to q}, all of it)."""
        n, r = self.comm.world_size, self.comm.rank
        pieces, splits, offset = [], [], 0
        for p in range(n):
            total = tf.constant(0, tf.int64)
            for lane, (_, idx, count) in zip(self.lanes[p], self.got[p]):
                d = tf.reshape(_columns(dx, tuple(offset + c for c in lane.cols)), [-1, lane.width])
                pieces.append(tf.reshape(d if idx is None else tf.math.unsorted_segment_sum(d, idx, count), [-1]))
                total += count * lane.width
            offset += sum(len(lane.cols) for lane in self.lanes[p])
            splits.append(total)
        flat = tf.concat(pieces, 0) if pieces else tf.zeros([0], dx.dtype)
        with tf.control_dependencies([self.comm.count("tail", nbytes(flat) + also_counted)]):
            back, _ = self.comm.alltoall(not_folded(self.comm, flat), tf.cast(tf.stack(splits), tf.int32),
                                         f"{self.name}_grad")
        mine = self.lanes[r]
        if not mine:
            return {}, back
        order = [(q, k) for q in range(n) for k in range(len(mine))]      # as sent: by destination, then lane
        sizes = [self.sent[q][k][2] * mine[k].width for q, k in order]
        return dict(zip(order, tf.split(back, tf.stack(sizes), num=len(order)))), back


def _placed(rows: tf.Tensor, idx) -> tf.Tensor:
    """Rows back at their samples: ``rows`` as they came (idx None) or one per distinct id."""
    return rows if idx is None else tf.gather(rows, idx)


def _check_blocks(fn: str, comm: Communicator, e: tf.Tensor, blocks: list[list[Block]], keys: KeyIds) -> None:
    n, r = comm.world_size, comm.rank
    if len(blocks) != n or sum(b.width for b in blocks[r]) != int(e.shape[1]):
        raise ValueError(f"{fn}: rank {r} holds rows of width {e.shape[1]}; the plan says widths "
                         f"{[sum(b.width for b in bl) for bl in blocks]} for {n} processes")
    missing = sorted({b.key for bl in blocks for b in bl if b.key is not None and not keys.resolves(b.key)})
    if missing:
        raise ValueError(f"{fn}: no ids given for the keys {missing}")


def rows_dense(comm: Communicator, e: tf.Tensor, kernel: tf.Tensor, rank_widths: list[int], anchor: tf.Tensor,
               name: str, blocks: list[list[Block]] | None = None, keys: dict | None = None) -> tf.Tensor:
    """This process's rows (``shard_rows``) of concat_p(E_p) @ concat_p(W_p) over all processes p.

    ``e`` [B, w_r]: this process's fields' rows (w_r = ``rank_widths[rank]``, 0 for a process that
    owns none); ``kernel`` [w_r, H]: its kernel rows; ``rank_widths``: w_p of every process, the
    same list everywhere; ``blocks`` (optional): each process's field vectors as Blocks (widths
    summing to w_p), whose keyed ones travel de-duplicated with ``keys``, the whole batch's model
    inputs (or {key: ids}) their keys read (key_ids); ``anchor``: a trainable scalar (its gradient is 0) so that every process
    runs the backward's collectives even when it holds no trainable input. Collectives:
    ``<name>_rows``, ``<name>_kernel`` (counted under ``step``), ``<name>_rows_grad``,
    ``<name>_kernel_grad`` (under ``tail``)."""
    n, r = comm.world_size, comm.rank
    widths = [int(w) for w in rank_widths]
    blocks = blocks if blocks is not None else blocks_of(widths)
    if len(widths) != n or widths[r] != int(kernel.shape[0]) or [sum(b.width for b in bl) for bl in blocks] != widths:
        raise ValueError(f"rows_dense: rank {r} holds rows of width {e.shape[1]} and {kernel.shape[0]} kernel rows; "
                         f"the plan says widths {widths} for {n} processes")
    keys = KeyIds(keys)
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
            de, _, back = exchange.backward(tf.matmul(dy, kernel_all, transpose_b=True), also_counted=nbytes(dk_flat))
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


def rows_to_samples(comm: Communicator, e: tf.Tensor | None, rank_widths: list[int], anchor: tf.Tensor,
                    name: str, blocks: list[list[Block]] | None = None, keys: dict | None = None,
                    picked=None, batch=None) -> tf.Tensor:
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

    ``picked`` {a block's ``apart``: 1-D int64 keys -> [n, width] rows of those keys}: this process's
    keyed blocks of those tables (des_ops.stripes.StripeLookup.at) send the rows ``picked`` gives for
    the keys they send, each destination's distinct ones, not rows picked out of ``e`` (whose
    columns of them are then not read: zeros will do; ``e`` None when every block is picked, with
    ``batch``, the global batch's rows); their gradients go straight back to ``picked``'s rows. The
    same rows on the wire.

        >>> table = tf.constant([[0.0, 0.0], [1.0, 2.0], [3.0, 4.0]])    # keys 1 and 2
        >>> ids = {"item": tf.constant([1, 2, 1], tf.int64)}
        >>> rows_to_samples(LocalCommunicator(), None, [2], tf.zeros([]), "demo", [[Block(2, "item", "t")]], ids,
        ...                 picked={"t": lambda k: tf.gather(table, k)}, batch=3).numpy().tolist()
        [[1.0, 2.0], [3.0, 4.0], [1.0, 2.0]]
    """
    n, r = comm.world_size, comm.rank
    widths = [int(w) for w in rank_widths]
    blocks = blocks if blocks is not None else blocks_of(widths)
    if e is None and (batch is None or not picked):
        raise ValueError("rows_to_samples: without rows (e=None), rows picked by key and the batch's size are needed")
    if len(widths) != n or (e is not None and widths[r] != int(e.shape[1])) or \
            [sum(b.width for b in bl) for bl in blocks] != widths:
        raise ValueError(f"rows_to_samples: rank {r} holds rows of width {None if e is None else e.shape[1]}; the "
                         f"plan says widths {widths} for {n} processes")
    keys = KeyIds(keys)
    _check_blocks("rows_to_samples", comm, tf.zeros([0, widths[r]]) if e is None else e, blocks, keys)
    if picked:
        return _picked_to_samples(comm, e, anchor, name, blocks, keys, picked, batch)

    @tf.custom_gradient
    def _to_samples(e_p, a):
        exchange = _Exchange(comm, blocks, keys, tf.shape(e_p, out_type=tf.int64)[0], name)
        x = exchange.forward(e_p)
        x = x + a * tf.cast(tf.minimum(tf.shape(x)[0], 0), tf.float32)

        def grad(dx):
            de, _, back = exchange.backward(dx)
            return de, tf.reduce_sum(back) * variable_zero(comm)
        return x, grad

    return _to_samples(e, anchor)


def _picked_to_samples(comm: Communicator, e: tf.Tensor | None, anchor: tf.Tensor, name: str,
                       blocks: list[list[Block]], keys: KeyIds, picked: dict, batch) -> tf.Tensor:
    """rows_to_samples with ``picked`` lanes: their rows looked up for the keys this process sends."""
    r = comm.rank
    exchange = _Exchange(comm, blocks, keys, tf.cast(batch, tf.int64) if e is None else
                         tf.shape(e, out_type=tf.int64)[0], name)
    mine = exchange.lanes[r]
    chosen = [k for k, lane in enumerate(mine) if lane.apart in picked and lane.keys != (None,)]
    if e is None and len(chosen) != len(mine):
        raise ValueError(f"rows_to_samples: rank {r} has no rows (e=None) for blocks of tables "
                         f"{sorted({lane.apart for lane in mine if lane.apart not in picked})}")
    sent_keys = exchange.picked_keys(chosen)
    rows = [tf.reshape(picked[mine[k].apart](sent_keys[k]), [-1, mine[k].width]) for k in chosen]

    @tf.custom_gradient
    def _picked(a, *args):
        e_p, sent = (None, args) if e is None else (args[0], args[1:])
        x = exchange.forward(e_p, picked=dict(zip(chosen, sent)))
        x = x + a * tf.cast(tf.minimum(tf.shape(x)[0], 0), tf.float32)

        def grad(dx):
            de, d_sent, back = exchange.backward(dx, picked=chosen)
            return [tf.reduce_sum(back) * variable_zero(comm)] + ([] if e is None else [de]) + \
                [d_sent[k] for k in chosen]
        return x, grad

    return _picked(anchor, *([] if e is None else [e]), *rows)


def distinct_rows(ids: dict, blocks: list[list[Block]], batch: int, rank: int) -> tuple[int, int]:
    """(floats process ``rank`` sends, floats it receives) in a rows exchange of one batch of
    ``batch`` rows, counted in numpy from ``ids`` {key: [batch] ids}: per destination (per source)
    slice and block, the block's width times the slice's distinct ids of a keyed block, else its rows."""
    n = len(blocks)

    def rows(block: Block, q: int) -> int:
        lo, hi = shard_rows(batch, q, n)
        return len(np.unique(np.asarray(key_ids(ids, block.key)).reshape(-1)[lo:hi])) if block.key else hi - lo
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

"""The first Dense layer by moving rows (des.transform(first_dense="rows"), des_ops/rows.py): each
process sends its fields' rows to the processes of their samples, which multiply them by the
all-gathered kernel; the model still computes what the untouched model computes on one process.
Batches of 31 rows (not divisible by 2, 3 or 5) and a last batch of 2 (some processes hold no
row); N = 5 > 4 fields (a process owns no field). Tolerances as in tests/test_tail.py."""
import numpy as np
import pytest
import tensorflow as tf

import des
from des.compiler.cost import AutoTail, choose_first_dense, choose_tail
from des_ops.comm import InProcessWorld, shard_rows
from des_ops.rows import Block, bytes_per_step, distinct_rows, rows_dense, rows_to_samples, wire_floats
from des.jobs.verify import _on_every_rank, run_in_process_world
from test_tail import _check, _data, _reference_and_base


def test_rows_dense_equals_the_product_of_the_whole_rows_and_kernel():
    """Three simulated processes owning 3, 0 and 2 input columns of a [7, 5] x [5, 2] product:
    each gets its rows of the product, and the gradients of its own columns and kernel rows."""
    rng = np.random.default_rng(0)
    x, w, dy = rng.normal(size=(7, 5)), rng.normal(size=(5, 2)), rng.normal(size=(7, 2))
    widths, cols = [3, 0, 2], [slice(0, 3), slice(3, 3), slice(3, 5)]
    world = InProcessWorld(3)

    def work(r):
        comm = world.communicator(r)
        e, k = tf.constant(x[:, cols[r]], tf.float32), tf.constant(w[cols[r]], tf.float32)
        lo, hi = shard_rows(7, r, 3)
        with tf.GradientTape() as tape:
            tape.watch([e, k])
            y = rows_dense(comm, e, k, widths, tf.zeros([]), "t")
            loss = tf.reduce_sum(y * tf.constant(dy[lo:hi], tf.float32))
        de, dk = tape.gradient(loss, [e, k])
        return y.numpy(), de.numpy(), dk.numpy(), comm.counted()
    out = _on_every_rank(world, work)
    for r, (y, de, dk, counted) in enumerate(out):
        lo, hi = shard_rows(7, r, 3)
        np.testing.assert_allclose(y, (x @ w)[lo:hi], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(de, (dy @ w.T)[:, cols[r]], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(dk, (x.T @ dy)[cols[r]], rtol=1e-5, atol=1e-6)
        assert y.shape == (hi - lo, 2) and de.shape == (7, widths[r]) and dk.shape == (widths[r], 2)
        assert (counted["step"]["bytes"], counted["tail"]["bytes"]) == bytes_per_step(7, widths, 2, r)
        assert (counted["step"]["calls"], counted["tail"]["calls"]) == (1, 1)


@pytest.mark.parametrize("offset", [0, 2 ** 61, -2 ** 62, "last slice"])
def test_rows_to_samples_moves_blocks_of_one_key_together_and_puts_every_column_back(offset):
    """Blocks of one key interleaved with others' and keyless ones (rank 0: A, B, A, none, B, C, so
    A and C are one lane of rows of 3; rank 1 owns nothing; rank 2: B, A), 3 processes, a batch of
    11 with repeated ids, C's equal to A's in places: each process gets its samples' rows of every
    block in rank and block order, exactly; each owner gets, per slice, the gradient of a distinct
    id summed over the slice's samples holding it at its first sample (a keyless block's at every
    sample); bytes are the distinct rows' (des_ops.rows.distinct_rows). ``offset`` is added to every
    id: large ids are packed with the lane's group in the top bits, negative ones through
    tf.unique's index (des_ops.rows._packed), with the same result. "last slice": only the last
    slice's ids are negative, so a sender (which packs the whole batch) goes by tf.unique's index
    while the other receivers (which pack their own slice) pack the bits: the same rows still."""
    rng = np.random.default_rng(3)
    n, batch = 3, 11
    if offset == "last slice":
        offset = np.where(np.arange(batch) >= shard_rows(batch, n - 1, n)[0], -2 ** 62, 0)
    ids = {"A": np.array([5, 5, 7, 5, 9, 7, 7, 5, 9, 9, 1]), "B": np.array([2, 4, 2, 2, 4, 4, 8, 8, 2, 4, 4]),
           "C": np.array([5, 1, 7, 7, 9, 7, 5, 5, 9, 1, 1])}
    blocks = [[Block(2, "A"), Block(3, "B"), Block(1, "A"), Block(2), Block(1, "B"), Block(3, "C")], [],
              [Block(1, "B"), Block(2, "A")]]
    e = []
    for bl in blocks:              # a keyed block's row is a function of its id, as a table lookup's is
        cols = [rng.normal(size=(20, b.width))[ids[b.key]] if b.key else rng.normal(size=(batch, b.width)) for b in bl]
        e.append(np.concatenate(cols, axis=1) if cols else np.zeros((batch, 0)))
    x_all = np.concatenate(e, axis=1)
    dx_all = rng.normal(size=(batch, x_all.shape[1]))
    world = InProcessWorld(n)

    def work(r):
        comm = world.communicator(r)
        er = tf.constant(e[r], tf.float32)
        lo, hi = shard_rows(batch, r, n)
        with tf.GradientTape() as tape:
            tape.watch(er)
            x = rows_to_samples(comm, er, [sum(b.width for b in bl) for bl in blocks], tf.zeros([]), "t", blocks,
                                {k: tf.constant(v, tf.int64) + offset for k, v in ids.items()})
            loss = tf.reduce_sum(x * tf.constant(dx_all[lo:hi], tf.float32))
        return x.numpy(), tape.gradient(loss, er).numpy(), comm.counted()
    out = _on_every_rank(world, work)
    offsets = np.cumsum([0] + [e_p.shape[1] for e_p in e])
    for r, (x, de, counted) in enumerate(out):
        lo, hi = shard_rows(batch, r, n)
        np.testing.assert_array_equal(x, x_all[lo:hi].astype(np.float32))
        expected = np.zeros_like(e[r], np.float32)
        start = 0
        for b in blocks[r]:
            cols = slice(start, start + b.width)
            g = dx_all[:, offsets[r] + start:offsets[r] + start + b.width].astype(np.float32)
            for q in range(n):
                qlo, qhi = shard_rows(batch, q, n)
                for i in range(qlo, qhi):
                    same = [j for j in range(qlo, qhi) if b.key and ids[b.key][j] == ids[b.key][i]]
                    if not b.key:
                        expected[i, cols] = g[i]
                    elif same[0] == i:
                        expected[i, cols] = np.sum(g[same], axis=0, dtype=np.float32)
            start += b.width
        np.testing.assert_allclose(de, expected, rtol=1e-6, atol=1e-7)
        sent, got = distinct_rows(ids, blocks, batch, r)
        assert (counted["step"]["bytes"], counted["tail"]["bytes"]) == (4 * sent, 4 * got)


@pytest.mark.parametrize("name, worlds", [("keras_deepfm", (2, 3, 5)), ("deepctr_deepfm", (5,)),
                                          ("regularized", (3,)), ("two_tower", (2,))])
def test_first_dense_by_rows_equals_one_process(name, worlds):
    """keras_deepfm: FM + first Dense + linear; deepctr_deepfm at N = 5: a process owns no field;
    regularized: penalties on the kernel rows and the bias; two_tower: two first Dense layers."""
    build, base, fit, ref = _reference_and_base(name, "sgd", 0.5)
    for n in worlds:
        ranks = run_in_process_world(n, build, lambda m: {**fit(m), "rows": list(des.distributed(m).layer.by_rows)},
                                     init_from=base, tail="data_parallel", first_dense="rows")
        assert all(any(r["rows"]) for r in ranks)
        print(name, n, _check(ref, ranks, "sgd"))


@pytest.mark.parametrize("optimizer, lr", [("adam", 0.02), ("adagrad", 0.05)])
def test_first_dense_by_rows_with_adaptive_optimizers(optimizer, lr):
    build, base, fit, ref = _reference_and_base("keras_deepfm", optimizer, lr)
    ranks = run_in_process_world(3, build, fit, init_from=base, tail="data_parallel", first_dense="rows")
    print(optimizer, _check(ref, ranks, optimizer))


def test_same_bits_every_run_and_bytes_counted_equal_analytic():
    """Two runs give the same bits on every rank. Per train step of b rows, rank r hands over
    b x W floats of partials (linear and FM: reduce-scatter) and the rows exchange's ("step"); the
    output all-gather, the backward all-gather of the partials, the rows' gradients and the tail's
    gradients ("tail"). The rows exchange: by default (distinct rows) each field's rows once per
    distinct id of each destination's slice, counted here in numpy from the batches' ids
    (des_ops.rows.distinct_rows); with ``distinct_rows=False`` once per sample
    (des_ops.rows.bytes_per_step). The gallery's ids repeat within a slice, so the two differ."""
    build, base, fit, _ = _reference_and_base("keras_deepfm", "sgd", 0.5)
    batches, probe = _data(base)
    n = 3

    def work(m):
        handle = des.distributed(m)
        before = handle.layer.comm.counted()
        snap = fit(m)
        after = handle.layer.comm.counted()
        rows_op = next(op for op, rows in zip(handle.layer.ops, handle.layer.by_rows) if rows)
        return snap, {p: after[p]["bytes"] - before[p]["bytes"] for p in ("step", "tail")}, \
            handle.layer.floats_per_sample(), sum(int(v.shape.num_elements()) for v in handle.tail_variables), \
            (rows_op.rank_widths, rows_op.width, rows_op.rank_blocks)
    runs = [run_in_process_world(n, build, work, init_from=base, tail="data_parallel", first_dense="rows")
            for _ in range(2)]
    for a, b in zip(*runs):
        flat_a, flat_b = tf.nest.flatten(a[0]), tf.nest.flatten(b[0])
        assert len(flat_a) == len(flat_b) > 3
        for u, v in zip(flat_a, flat_b):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    per_sample = run_in_process_world(n, build, work, init_from=base, tail="data_parallel", first_dense="rows",
                                      distinct_rows=False)
    fed = [x for x, _ in batches] + [probe]                                     # the probe's predict: forward only
    for r, ((_, counted, w, t, (widths, units, blocks)), (_, counted_each, *_)) in enumerate(zip(runs[0], per_sample)):
        assert w == 1 + (4 + 1) and widths == [8, 4, 4] and units == 8      # linear 1 + FM k+1 summed; rows: 4 fields x K
        assert [[(b.width, b.key) for b in bl] for bl in blocks] == [[(4, "f0"), (4, "f3")], [(4, "f1")], [(4, "f2")]]
        shard = lambda b: (lambda lo, hi: hi - lo)(*shard_rows(b, r, n))
        sizes = [len(x["f0"]) for x in fed]
        sent_got = [distinct_rows(x, blocks, b, r) for x, b in zip(fed, sizes)]
        step = sum(4 * b * w + 4 * sent + 4 * widths[r] * units for b, (sent, _) in zip(sizes, sent_got))
        tail = sum(4 * (shard(b) * 1 + shard(b) * w + t) + 4 * got + 4 * sum(widths) * units
                   for b, (_, got) in zip(sizes[:-1], sent_got)) + 4 * shard(16)
        assert counted == {"step": step, "tail": tail}, (r, counted, step, tail)
        step = sum(4 * b * w + bytes_per_step(b, widths, units, r)[0] for b in sizes)
        tail = sum(4 * (shard(b) * 1 + shard(b) * w + t) + bytes_per_step(b, widths, units, r)[1] for b in sizes[:-1]) \
            + 4 * shard(16)
        assert counted_each == {"step": step, "tail": tail}, (r, counted_each, step, tail)
        assert counted["step"] < counted_each["step"] and counted["tail"] < counted_each["tail"]


def test_choice_of_the_first_dense():
    """By hand: B 4096, w 312, H 400, N 4: rows 2 x 3/4 x (4096 x 312/4 + 312 x 400) = 666,432 floats
    (2.67 MB), partials 2 x 3/4 x 4096 x 400 = 2,457,600 (9.83 MB). At 100 Mbit/s (1.25e7 B/s) rows
    take 4 x 3 ms + 213 ms against 786 ms: rows; at 10 Gbit/s 12 + 2.1 ms against 7.9 ms: partials."""
    assert wire_floats(4096, 312, 400, 4) == (666_432.0, 2_457_600.0)
    slow, fast = AutoTail(bandwidth=1.25e7), AutoTail(bandwidth=1.25e9)
    assert choose_first_dense(4096, 312, 400, 4, slow)[0] == "rows"
    assert choose_first_dense(4096, 312, 400, 4, fast)[0] == "partials"
    assert choose_first_dense(4096, 312, 128, 2, slow)[0] == "partials"     # rows 2.72 MB > partials 2.10 MB
    # a third of a slice's ids distinct (one id per field, Zipf-like data; des.Options(distinct_rows=True)):
    # rows 2 x 1/2 x (4096 x 312/2 x 0.3 + 312 x 128) = 231,629 floats, 0.93 MB + 4 x 3 ms < 2.10 MB
    assert wire_floats(4096, 312, 128, 2, distinct=0.3)[0] == pytest.approx(231_628.8)
    assert choose_first_dense(4096, 312, 128, 2, AutoTail(bandwidth=1.25e7, distinct=0.3))[0] == "rows"
    # the tail: at 100 Mbit/s a 400,400,400 tail stays replicated unless the first Dense goes by rows
    dense, n = 400 * 400 * 2 + 400, 4              # the tail's kernels after the first Dense: 400x400 twice, 400x1
    assert choose_tail(dense, dense + 801, 1, n, slow)[0] == "replicated"
    tail, why = choose_tail(dense, dense + 801, 1, n, slow, first_dense=[(312, 400)])
    assert tail == "data_parallel" and "first Dense by rows" in why
    assert choose_tail(dense, dense + 801, 1, n, fast, first_dense=[(312, 400)])[1] == \
        choose_tail(dense, dense + 801, 1, n, fast)[1]                     # partials win: nothing changes
    build, base, _, _ = _reference_and_base("keras_deepfm", "sgd", 0.5)
    with pytest.raises(ValueError, match="needs the data-parallel tail"):
        des.transform(build(), des.Options(first_dense="rows"), comm=InProcessWorld(1).communicator(0))
    with pytest.raises(ValueError, match="needs the data-parallel tail"):
        des.transform(build(), des.Options(first_dense="rows", tail="auto"), comm=InProcessWorld(1).communicator(0))
    with pytest.raises(ValueError, match="first_dense='sideways'"):
        des.transform(build(), des.Options(first_dense="sideways"))


def test_auto_picks_rows_where_they_take_less_time_and_says_why():
    """keras_deepfm's first Dense: 4 fields x K 4 = 16 input floats, 8 units, at B = 4096 and a slow
    link (1e5 B/s, so that bytes decide). N = 2: rows move 2 x 1/2 x (4096 x 8 + 16 x 8) = 32,896
    floats, partials 32,768: partials; N = 3: rows 2 x 2/3 x (4096 x 16/3 + 128) = 29,298 < 43,691:
    rows. With tail='auto' too, the tail goes data-parallel only with the rows (the operators kept:
    first_layer='auto' would take the whole first layer by rows, tests/test_field_rows.py)."""
    build, base, _, _ = _reference_and_base("keras_deepfm", "sgd", 0.5)
    slow = AutoTail(batch_size=4096, bandwidth=1e5)
    for n, expected in ((2, False), (3, True)):
        out = run_in_process_world(n, build, lambda m: list(des.distributed(m).layer.by_rows), init_from=base,
                                   tail="data_parallel", first_dense="auto", costs=slow)
        assert all(any(r) == expected for r in out), (n, out)
    out = run_in_process_world(3, build, lambda m: (des.distributed(m).tail, any(des.distributed(m).layer.by_rows)),
                               init_from=base, tail="auto", first_dense="auto", costs=slow, first_layer="operators")
    assert out == [("data_parallel", True)] * 3
    world = InProcessWorld(1)
    _, report = des.transform(build(), des.Options(tail="data_parallel", first_dense="auto"), comm=world.communicator(0))
    assert "first_dense='auto'" in str(report) and "MB of partials" in str(report)


def test_columns_of_a_tensor_without_its_static_width():
    """A gradient can reach the exchange without its static width (DCN-v2 over TFRA tables did):
    the columns are still taken, the whole tensor included (it failed with a TypeError)."""
    from des_ops.rows import _columns

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32)])
    def take(x):
        return _columns(x, (0, 1, 2)), _columns(x, (1, 2))
    whole, part = take(tf.constant([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]))
    assert whole.numpy().tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
    assert part.numpy().tolist() == [[2.0, 3.0], [5.0, 6.0]]

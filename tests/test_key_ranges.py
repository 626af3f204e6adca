"""One table holding several fields through offsets (DLRM / pytorch-fm ports: ids [B, P] plus a
constant offset per position into one Keras Embedding(P * V, K)) is split by key range
(des.graph.fields.FieldAnalysis.offset_ranges, rewrite_rules.field_rows, des_ops.ranges): each
position is a field, its owner holds only its range's rows and sends its positions' rows. In the
simulated world: equal to the untouched model on one process, every row held by exactly one
process (none holds the whole table; some own nothing), saves, checkpoints that resume on another
N and on one process, an id outside its range is one clear error, and the cases that must not be
split are not. The same under mpirun: tests/test_mpi.py (gallery:dlrm_offsets)."""
import re

import numpy as np
import pytest
import tensorflow as tf

import des
from des.graph.fields import FieldAnalysis
from des.graph.ir import Graph
from des.jobs.verify import _on_every_rank, compare, copy_state, fit_and_snapshot, run_in_process_world
from des.runtime import checkpoint
from des_ops.comm import InProcessWorld
from gallery import BUILDERS, FIELDS, V, dlrm_offsets, optimizer_for, sliced_batches
from helpers import (adam_world, check_rows_saved_by_distinct_ids, fit_counting_rows, save_three_ways, served,
                     trained, within)

L = tf.keras.layers
P = len(FIELDS)


def _ranges_held(model) -> list[tuple]:
    """(untouched table name, global keys held) of each key-range table of a DES model."""
    return [(l.table, l.keys().tolist()) for l in des.distributed(model).layer.owned
            if getattr(l, "des_range_table", False)]


def _setup(steps=5, batch=31):
    tf.keras.utils.set_random_seed(0)
    base = dlrm_offsets()
    batches, probe = sliced_batches(base, steps * batch + 2, batch)
    reference = dlrm_offsets()
    copy_state(base, reference)
    return base, batches, probe, reference


def test_the_ranges_are_read_off_the_offsets_and_refused_where_they_would_not_be_exact():
    """offset_ranges: position f holds [offset_f, next larger offset), the largest up to input_dim,
    in position order (offsets need not be sorted); refused, with the reason, for offsets that
    repeat (two positions share rows), a regularized table, or ids + a non-constant."""
    def table_node(offsets, **kw):
        ids = tf.keras.Input(shape=(len(offsets),), dtype=tf.int64, name="ids")
        e = L.Embedding(100, 2, **kw)(ids + tf.constant(offsets, tf.int64))
        g = Graph(tf.keras.Model(ids, L.Dense(1)(L.Flatten()(e))))
        return FieldAnalysis(g), next(n for n in g.nodes if n.kind == "table")
    fa, n = table_node([30, 0, 70])
    assert fa.offset_ranges(n) == ((30, 70), (0, 30), (70, 100))
    fa, n = table_node([0, 30, 30])
    assert "are not distinct keys" in fa.offset_ranges(n)
    fa, n = table_node([0, 50], embeddings_regularizer="l2")
    assert "regularizer" in fa.offset_ranges(n)
    ids = tf.keras.Input(shape=(2,), dtype=tf.int64, name="ids")
    shift = tf.keras.Input(shape=(2,), dtype=tf.int64, name="shift")
    g = Graph(tf.keras.Model([ids, shift], L.Dense(1)(L.Flatten()(L.Embedding(100, 2)(ids + shift)))))
    assert "is not ids + one constant" in FieldAnalysis(g).offset_ranges(next(n for n in g.nodes if n.kind == "table"))


def test_a_dlrm_port_is_split_by_key_range_and_equals_one_process():
    """The gallery's DLRM (one Embedding(4 * V, 4) and one Embedding(4 * V, 1) read through ids +
    offsets, FM, MLP): 4 fields; at N = 2, 3 and 6 (two processes own nothing) the predictions,
    every row and every weight after 6 Adam steps equal one process's (the rows are the same
    floats, x + 0 = x, and the tail replicated: measured 0.0), every row is held by exactly one
    process (verify.compare), the ranges are the field plan's and no process holds a whole table."""
    base, batches, probe, reference = _setup()
    fit = lambda m: fit_and_snapshot(m, batches, probe, optimizer="adam", learning_rate=0.02)  # noqa: E731
    ref = fit(reference)
    for n in (2, 3, 6):
        ranks = run_in_process_world(n, dlrm_offsets, lambda m: {**fit(m), "held": _ranges_held(m),
                                                                 "plan": des.distributed(m).plan}, init_from=base)
        held = [r.pop("held") for r in ranks]
        plan = ranks[0].pop("plan")
        [r.pop("plan") for r in ranks[1:]]
        diff = compare(ref, ranks)
        within(f"DLRM key ranges N={n} predictions", diff["predictions"], 1e-6)
        within(f"DLRM key ranges N={n} rows and weights", max(diff["tables"], diff["owned"], diff["weights"]), 1e-6)
        for r in range(n):
            want = sorted(k for f in plan.fields_of(r) for k in range(int(f[4]) * V, (int(f[4]) + 1) * V))
            for _, keys in held[r]:
                assert keys == want, (n, r)
            assert len(held[r]) == (2 if want else 0)
            assert all(len(keys) < P * V for _, keys in held[r])
        assert sum(not h for h in held) == max(0, n - P)


def test_under_the_data_parallel_tail_each_owner_sends_its_positions_rows_to_their_samples():
    """The key-range rows have several owners: with the data-parallel tail and field rows by samples,
    every owner sends each process its samples' rows of its own positions (one block each in the
    samples' all-to-all) and the receiver puts the positions in order. N = 3 (positions interleaved
    over the owners) and N = 6 (two processes own nothing), batches of 31 and a last one of 2 (a
    process with no sample): equal to one process (the data-parallel tail sums the dense gradients
    in another order)."""
    base, batches, probe, reference = _setup()
    fit = lambda m: fit_and_snapshot(m, batches, probe, optimizer="adam", learning_rate=0.02)  # noqa: E731
    ref = fit(reference)
    for n in (3, 6):
        ranks = run_in_process_world(n, dlrm_offsets, lambda m: {**fit(m), "layer": des.distributed(m).layer},
                                     init_from=base, tail="data_parallel", field_rows="samples")
        layers = [r.pop("layer") for r in ranks]
        ranged = [[op for op, s in zip(layer.ops, layer.to_samples) if s and hasattr(op, "rank_positions")]
                  for layer in layers]
        assert all(len(ops) == 2 for ops in ranged), ranged         # the width-4 and the width-1 table
        owners = ranged[0][0].rank_positions
        order = [f for fs in owners for f in fs]            # the positions as the blocks hold them
        assert sorted(order) == list(range(P)) and (order != list(range(P))) == (n == 3), owners   # N=3: put back in order
        assert sum(not fs for fs in owners) == max(0, n - P)
        diff = compare(ref, ranks)
        within(f"DLRM key ranges by samples N={n}: predictions", diff["predictions"], 6e-7)
        within(f"DLRM key ranges by samples N={n}: rows and weights",
               max(diff["tables"], diff["owned"], diff["weights"]), 1e-6)


def test_the_report_says_how_the_table_is_split():
    _, report = des.transform(dlrm_offsets(), comm=InProcessWorld(1).communicator(0))
    text = str(report)
    assert f"split by key range into {P} fields (ids[0] .. ids[{P - 1}]: keys [0, {V}) .. [{(P - 1) * V}, {P * V}))" \
        in text, text
    assert "NOT substituted" not in text and f"each owner's rows, {P * 4 + P} floats" in text, text


def test_an_id_outside_its_fields_range_is_one_clear_error():
    """ids + offsets where an id is not below its field's vocabulary reads another field's row in the
    untouched model; split, it is an error naming the table, not a silent wrong row."""
    model, _ = des.transform(dlrm_offsets(), comm=InProcessWorld(1).communicator(0))
    ids = np.zeros([2, P], np.int64)
    ids[1, 2] = V                                  # field 2's id V: key 3V, field 3's first row
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"des: table embedding(_\d+)? holds one field per key "
                                                             r"range \(\[0, 40\) \[40, 80\) .* an id fell outside the range of its field"):
        model.predict_on_batch({"ids": ids})


def test_a_split_model_saves_the_untouched_model_and_resumes_on_another_n_and_one_process(tmp_path):
    """3 processes train 3 of 6 Adam steps, checkpoint, model.save and des.export (every process;
    rank 0 writes the untouched DLRM with every range's rows); the save and the export predict what
    the DES model does, the
    checkpoint resumed on 2 processes and in the untouched model on one process ends where the
    uninterrupted one-process model does."""
    base, batches, probe, _ = _setup(steps=6, batch=32)
    batches = batches[:6]

    ref = dlrm_offsets()
    copy_state(base, ref)
    ref.compile(optimizer_for(ref, "adam"), "binary_crossentropy")
    want = trained(ref, batches, probe)
    ckpt = str(tmp_path / "ckpt")         # written by save_three_ways
    w, ms = adam_world(3, dlrm_offsets, base)

    def first_half(r):
        got = trained(ms[r], batches[:3], probe)
        save_three_ways(ms[r], str(tmp_path))
        return got
    got = _on_every_rank(w, first_half)
    again = tf.keras.models.load_model(str(tmp_path / "saved"), compile=False)
    assert [type(l).__name__ for l in again.layers if isinstance(l, L.Embedding)] == ["Embedding"] * 2
    within("DLRM key ranges: model.save, loaded", float(np.abs(again.predict_on_batch(probe) - got[0]).max()), 1e-6)
    within("DLRM key ranges: des.export, served",
           float(np.abs(served(str(tmp_path / "served"), probe) - got[0].reshape(-1)).max()), 1e-6)
    untouched = [l for l in des.distributed(ms[0]).source.layers if isinstance(l, L.Embedding)]
    assert [l.embeddings for l in untouched] == [None, None]     # after the save rank 0 holds its ranges only

    def second_half(m):
        checkpoint.restore(ckpt, m, m.optimizer)
        return trained(m, batches[3:], probe)
    w2, ms2 = adam_world(2, dlrm_offsets, base)
    resumed = _on_every_rank(w2, lambda r: second_half(ms2[r]))
    one = dlrm_offsets()
    copy_state(base, one)
    one.compile(optimizer_for(one, "adam"), "binary_crossentropy")
    resumed.append(second_half(one))
    within("DLRM key ranges: checkpoint of 3 resumed on 2 and on one process",
           max(float(np.abs(p - want).max()) for p in resumed), 2e-6)


def stacked_inputs_model():
    """A DLRM port over one input per field: ids = tf.stack of the 4 inputs, one Embedding(4 V, K)
    by offsets, and beside it field f0's own 1-wide linear table read from its input directly."""
    x = {f: tf.keras.Input(shape=(), dtype=tf.int64, name=f) for f in FIELDS}
    ids = tf.stack([x[f] for f in FIELDS], axis=1)
    e = L.Embedding(P * V, 4)(ids + tf.constant(np.arange(P) * V, tf.int64))
    linear = L.Flatten()(L.Embedding(V, 1)(x["f0"]))
    deep = L.Dense(8, activation="relu")(L.Flatten()(e))
    return tf.keras.Model(x, tf.sigmoid(L.Dense(1)(L.Concatenate()([deep, linear]))))


def test_ranges_over_a_stack_of_inputs_are_named_after_them_and_go_with_their_fields_other_tables():
    """ids stacked from one input per field: each range is that input's field (f0 .. f3 in the plan),
    so f0's own linear table has the same owner as f0's range; N = 3 equals one process."""
    tf.keras.utils.set_random_seed(0)
    base = stacked_inputs_model()
    batches, probe = sliced_batches(base, 5 * 31 + 2, 31)
    reference = stacked_inputs_model()
    copy_state(base, reference)
    fit = lambda m: fit_and_snapshot(m, batches, probe, optimizer="adam", learning_rate=0.02)  # noqa: E731
    ref = fit(reference)
    ranks = run_in_process_world(3, stacked_inputs_model, lambda m: {**fit(m), "plan": des.distributed(m).plan,
                                                                     "held": _ranges_held(m)}, init_from=base)
    plan = ranks[0]["plan"]
    assert sorted(plan.owner) == sorted(FIELDS), plan
    held = [r.pop("held") for r in ranks]
    [r.pop("plan") for r in ranks]
    owner = plan.owner["f0"]
    assert [keys for _, keys in held[owner]][0][:V] == list(range(V))        # f0's range lives with f0's owner
    diff = compare(ref, ranks)
    within("stacked inputs N=3 predictions", diff["predictions"], 1e-6)
    within("stacked inputs N=3 rows and weights", max(diff["tables"], diff["owned"], diff["weights"]), 1e-6)


def test_a_table_by_offsets_that_cannot_be_split_has_one_owner_and_the_report_says_why():
    """A regularized Embedding(4 V, K) read through ids + offsets: its penalty is over the whole table,
    so it is not split by key range; one owner holds it (field rows), and the table's line says why.
    N = 2 equals one process."""
    def build():
        ids = tf.keras.Input(shape=(P,), dtype=tf.int64, name="ids")
        e = L.Embedding(P * V, 4, embeddings_regularizer=tf.keras.regularizers.l2(1e-3))(
            ids + tf.constant(np.arange(P) * V, tf.int64))
        deep = L.Dense(8, activation="relu")(L.Flatten()(e))
        return tf.keras.Model(ids, L.Dense(1, activation="sigmoid")(L.Concatenate()([deep, tf.reduce_sum(e, axis=1)])))
    _, report = des.transform(build(), comm=InProcessWorld(1).communicator(0))
    text = str(report)
    assert re.search(r"one owner holds all 4 fields \(not split by key range: 'embedding(_\d+)?' has a regularizer",
                     text), text
    tf.keras.utils.set_random_seed(0)
    base = build()
    batches, probe = sliced_batches(base, 3 * 31, 31)
    reference = build()
    copy_state(base, reference)
    fit = lambda m: fit_and_snapshot(m, batches, probe, optimizer="adam", learning_rate=0.02)  # noqa: E731
    ref = fit(reference)
    ranks = run_in_process_world(2, build, lambda m: {**fit(m), "held": _ranges_held(m)}, init_from=base)
    assert [r.pop("held") for r in ranks] == [[], []]
    diff = compare(ref, ranks)
    within("regularized table by offsets, one owner, N=2 predictions", diff["predictions"], 1e-6)


def test_key_range_rows_travel_once_per_distinct_id_of_each_slice():
    """The ids at position f alone decide its rows (key ``ids[f]``), so by samples each owner sends a
    slice each position's distinct ids' rows once: at N = 3 equal to one process, and the bytes handed to the collectives smaller by exactly the rows not sent,
    counted in numpy per slice and position from the batches' ids (des_ops.rows.distinct_rows) -
    forward under "step", the gradients back under "tail"; the report names the keys."""
    base, batches, probe, reference = _setup()
    n = 3
    runs = {d: run_in_process_world(n, dlrm_offsets, lambda m: fit_counting_rows(m, batches, probe, n), init_from=base,
                                    tail="data_parallel", field_rows="samples", distinct_rows=d) for d in (True, False)}
    for r in range(n):
        keyed, plain = runs[True][r][2], runs[False][r][2]
        assert {b.key for bl in keyed for b in bl} == {f"ids[{f}]" for f in range(P)}
        assert all(b.key is None for bl in plain for b in bl)
        check_rows_saved_by_distinct_ids(runs, batches, probe, r)
    ref = fit_and_snapshot(reference, batches, probe, optimizer="adam", learning_rate=0.02)
    diff = compare(ref, [s for s, _, _ in runs[True]])
    within("key ranges by samples, distinct rows, N=3: predictions", diff["predictions"], 6e-7)
    within("key ranges by samples, distinct rows, N=3: rows and weights",
           max(diff["tables"], diff["owned"], diff["weights"]), 1e-6)

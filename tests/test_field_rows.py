"""Field vectors no rule splits (DCN's Cross, DIN's attention, a DLRM's interaction read them) under
the data-parallel tail, by samples (des.Options(field_rows="samples"), des_ops.rows.rows_to_samples):
each owner sends its vectors' rows of the other processes' samples by one all-to-all instead of
handing every column of the whole batch to the reduce-scatter. Equal to the untouched model on
one process (simulated N = 2, 3 and 5: more processes than fields, some own nothing; batches of
31 rows and a last one of 2, so some processes hold no sample), the bytes counted equal to the
hand count, and the cost model's choice."""
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import des
from des.compiler.cost import AutoTail, choose_field_rows
from des.jobs.verify import compare, copy_state, fit_and_snapshot, run_in_process_world
from des_ops.fused import FusedTable
from des_ops.suboperators import DESFirstLayer
from gallery import BUILDERS, batches_for
from helpers import within

ROWS, BATCH = 5 * 31 + 2, 31


def din_sigmoid():
    """DeepCTR's DIN (tests/gallery.py) with a sigmoid attention activation: its default, Dice, holds
    a BatchNormalization, which keeps the tail replicated (test below)."""
    from deepctr import models as dm
    from deepctr.feature_column import SparseFeat, VarLenSparseFeat
    from gallery import K, V
    feats = [SparseFeat("user", V, embedding_dim=K, dtype="int64"), SparseFeat("item", V, embedding_dim=K, dtype="int64"),
             VarLenSparseFeat(SparseFeat("hist_item", V, embedding_dim=K, embedding_name="item", dtype="int64"),
                              maxlen=4, length_name="seq_length")]
    return dm.DIN(feats, ["item"], dnn_hidden_units=(8,), att_hidden_size=(8,), att_activation="sigmoid", seed=1)


def _setup(name):
    build = din_sigmoid if name == "din_sigmoid" else BUILDERS[name]
    tf.keras.utils.set_random_seed(0)
    base = build()
    des.make_keyed(base, seed=0)
    x, y = batches_for(base, 1, ROWS, seed=4)[0]
    batches = [({k: v[i:i + BATCH] for k, v in x.items()}, y[i:i + BATCH]) for i in range(0, ROWS, BATCH)]
    probe = batches_for(base, 1, 16, seed=99)[0][0]
    reference = build()
    copy_state(base, reference)
    des.make_keyed(reference, seed=0)
    fit = lambda m: fit_and_snapshot(m, batches, probe, optimizer="adam", learning_rate=0.02)  # noqa: E731
    return build, base, fit, fit(reference)


# (predictions, rows and weights) bounds, 20 Adam steps: measured DCN 6.0e-8 and 8.9e-8 (a DLRM's table
# split by key range has several owners and stays partials: tests/test_key_ranges.py); DIN 4.2e-7 and 4.5e-6 (its attention amplifies float32 order under Adam: the 1e-5 of
# tests/test_gallery.py's Adam bound)
BOUNDS = {"deepctr_dcn": (6e-7, 8e-7), "din_sigmoid": (4e-6, 1e-5)}


@pytest.mark.parametrize("name, worlds", [("deepctr_dcn", (2, 5)), ("din_sigmoid", (3,))])
def test_field_rows_by_samples_equal_one_process(name, worlds):
    build, base, fit, ref = _setup(name)
    for n in worlds:
        ranks = run_in_process_world(n, build, lambda m: {**fit(m), "layer": des.distributed(m).layer},
                                     init_from=base, tail="data_parallel", field_rows="samples")
        layers = [r.pop("layer") for r in ranks]
        assert all(any(layer.to_samples) for layer in layers)
        assert all("samples" in layer.collective for layer in layers)
        diff = compare(ref, ranks)
        print(name, n, diff)
        within(f"{name} N={n} predictions", diff["predictions"], BOUNDS[name][0])
        within(f"{name} N={n} rows and weights", max(diff["tables"], diff["owned"], diff["weights"]), BOUNDS[name][1])


def test_a_batch_normalization_inside_a_tail_layer_keeps_the_tail_replicated():
    """DeepCTR's DIN with its default Dice attention activation: a BatchNormalization inside the
    attention layer computes statistics over the batch, so the tail cannot run on each process's
    rows (it did, silently, before: 1.1e-3 off one process at N = 2); auto picks the replicated
    tail and says why, and the field rows then stay partials; first_layer="rows", which needs that
    tail, is refused naming itself."""
    from des_ops.comm import InProcessWorld
    with pytest.raises(ValueError, match=r"'attention_sequence_pooling_layer\w*' holds 'batch_normalization\w*', which "
                                         r"\(BatchNormalization\) computes statistics over the whole batch"):
        des.transform(BUILDERS["deepctr_din"](), des.Options(tail="data_parallel"), comm=InProcessWorld(1).communicator(0))
    with pytest.raises(ValueError, match=r"des.transform\(first_layer='rows', whose first layers run in the data-parallel "
                                         r"tail\): the tail cannot run data-parallel: .*\(BatchNormalization\)"):
        des.transform(BUILDERS["deepctr_din"](), des.Options(first_layer="rows"), comm=InProcessWorld(1).communicator(0))
    world = InProcessWorld(2)
    _, report = des.transform(BUILDERS["deepctr_din"](), des.Options(tail="auto", costs=AutoTail(batch_size=1 << 16)),
                              comm=world.communicator(0))
    assert report.tail == "replicated" and "BatchNormalization" in report.tail_reason, report.tail_reason
    assert report.by_samples == []


def test_the_cost_model_sends_wide_field_rows_by_samples_and_narrow_ones_as_partials():
    """By hand: 26 fields of 8 floats, B 4096, N 4 at 100 Mbit/s: partials 2 x 3/4 x 4096 x 208 x 4 B =
    5.11 MB (408.9 ms at 1.25e7 B/s), by samples a quarter of that, 1.28 MB (102 ms + 2 x 3 ms);
    16 floats of a batch of 64 at 10 Gbit/s: 6 ms of collectives against 6.6 us of bytes."""
    choice, why = choose_field_rows(4096, 208, 4, AutoTail(bandwidth=1.25e7))
    assert choice == "samples" and "5.11 MB of partials take 408.9 ms" in why and "1.28 MB by samples 108.2 ms" in why
    assert choose_field_rows(64, 16, 2)[0] == "partials"


def test_field_rows_travel_once_per_distinct_id_of_each_slice():
    """DCN at N = 3 by samples, with distinct rows (the default) and once per sample: the same
    predictions and state within float32 order, and what the processes hand to the collectives
    differs by exactly the floats of the rows not sent, counted in numpy from the batches' ids
    (des_ops.rows.distinct_rows: per destination slice, a field's distinct ids) - forward in
    "step", the gradients back in "tail"."""
    from des_ops.rows import distinct_rows
    build, base, fit, ref = _setup("deepctr_dcn")
    rows = 5 * 31 + 2
    x, _ = batches_for(base, 1, rows, seed=4)[0]
    batches = [{k: v[i:i + BATCH] for k, v in x.items()} for i in range(0, rows, BATCH)]
    probe = batches_for(base, 1, 16, seed=99)[0][0]

    def work(m):
        layer = des.distributed(m).layer
        before = layer.comm.counted()
        snap = fit(m)
        after = layer.comm.counted()
        sampled = [op for op, s in zip(layer.ops, layer.to_samples) if s]
        return snap, {p: after[p]["bytes"] - before[p]["bytes"] for p in ("step", "tail")}, \
            [(op.owner, op.block) for op in sampled]
    n = 3
    runs = {d: run_in_process_world(n, build, work, init_from=base, tail="data_parallel", field_rows="samples",
                                    distinct_rows=d) for d in (True, False)}
    for r in range(n):
        owners = runs[True][r][2]
        assert all(block.key is not None for _, block in owners)
        blocks = [[b for p, b in owners if p == q] for q in range(n)]
        flat = [[dataclasses.replace(b, key=None) for b in bl] for bl in blocks]
        fed = batches + [probe]
        saved = [tuple(e - d for d, e in zip(distinct_rows(x, blocks, len(x[blocks_key(blocks)]), r),
                                             distinct_rows(x, flat, len(x[blocks_key(blocks)]), r))) for x in fed]
        step = runs[False][r][1]["step"] - runs[True][r][1]["step"]
        tail = runs[False][r][1]["tail"] - runs[True][r][1]["tail"]
        assert step == 4 * sum(s for s, _ in saved) > 0, (r, step, saved)
        assert tail == 4 * sum(g for _, g in saved[:-1]) > 0, (r, tail, saved)    # the probe: no backward
    diff = compare(ref, [s for s, _, _ in runs[True]])
    within("deepctr_dcn N=3 distinct rows: predictions", diff["predictions"], BOUNDS["deepctr_dcn"][0])
    within("deepctr_dcn N=3 distinct rows: rows and weights", max(diff["tables"], diff["owned"], diff["weights"]),
           BOUNDS["deepctr_dcn"][1])


def blocks_key(blocks) -> str:
    """The id input of the first keyed block (every input holds the batch's rows)."""
    return next(b.key for bl in blocks for b in bl)


@pytest.mark.parametrize("name, worlds, tables", [("keras_deepfm", (2, 3), "auto"), ("tfra_deepfm", (2,), "auto"),
                                                  ("tfra_deepfm", (3,), "joined"), ("deepctr_deepfm", (5,), "auto")])
def test_the_first_layer_by_rows_equals_one_process(name, worlds, tables):
    """des.Options(first_layer="rows"): no operator is split (the linear sum, FM and the first Dense
    run in the data-parallel tail), every table's rows go to their samples' processes once per
    distinct id; 20 Adam steps equal the untouched model on one process (N = 5: a process owns no
    field); the first Dense's kernel is a tail weight, summed, equal on every process. Joined tables
    (a user's 1-wide linear weights carried as field rows): one TFRA table per process holds each
    owned field's embedding and weight side by side, and both travel as one row."""
    build, base, fit, ref = _setup(name)
    for n in worlds:
        ranks = run_in_process_world(n, build, lambda m: {**fit(m), "layer": des.distributed(m).layer},
                                     init_from=base, first_layer="rows", tables=tables)
        layers = [r.pop("layer") for r in ranks]
        assert all(all(type(op).__name__ == "FieldRowsSubOp" and op.exchange == "samples" for op in layer.ops)
                   for layer in layers)
        assert all(op.block.key is not None for op in layers[0].ops)
        if tables == "joined":
            for layer in layers:
                fused = [t.name for t in layer.owned if isinstance(t, FusedTable)]
                assert len(fused) == 1 and "_joined" in fused[0], fused
                assert layer.sends_fused_rows      # its lookup's rows as they are, not split and joined again
        for r in ranks:
            within(f"{name} N={n} first layer by rows: predictions",
                   float(np.abs(np.asarray(r["predictions"]) - np.asarray(ref["predictions"])).max()), 1e-6)
            within(f"{name} N={n} first layer by rows: loss", abs(r["loss"] - ref["loss"]), 1e-6)
            for k, w in r["weights"].items():                  # the tail: equal on every process
                np.testing.assert_array_equal(np.asarray(w), np.asarray(ranks[0]["weights"][k]))


def test_a_joined_tables_rows_are_sent_as_its_lookup_made_them_with_the_same_bits(monkeypatch):
    """By samples, a process whose field vectors are one joined table's rows sends that table's
    [B, S * dim] lookup as it is (DESFirstLayer._fused_rows_sent) instead of splitting it into the
    fields' vectors and joining them again: the same predictions, rows and weights, bit for bit,
    as with the split and join (N = 3, 20 Adam steps)."""
    build, base, fit, _ = _setup("tfra_deepfm")
    runs = {}
    for direct in (True, False):
        if not direct:
            monkeypatch.setattr(DESFirstLayer, "_fused_rows_sent", lambda self, mine, vectors: None)
        ranks = run_in_process_world(3, build, lambda m: {**fit(m), "direct": des.distributed(m).layer.sends_fused_rows},
                                     init_from=base, first_layer="rows", tables="joined")
        assert [r.pop("direct") for r in ranks] == [direct] * 3
        runs[direct] = ranks
    for r, (a, b) in enumerate(zip(runs[True], runs[False])):
        assert set(a) == set(b) and {"predictions", "tables", "weights"} <= set(a), sorted(a)
        for part in a:
            flat_a, flat_b = tf.nest.flatten(a[part]), tf.nest.flatten(b[part])
            assert len(flat_a) == len(flat_b) > 0, (r, part)
            for x, y in zip(flat_a, flat_b):
                np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=f"rank {r} {part}")


def test_auto_takes_the_first_layer_by_rows_where_it_moves_less_and_says_why():
    """4 simulated processes, a DeepFM with a wide tail (400,400,400: the tail runs data-parallel):
    at 100 Mbit/s (a given des.AutoTail; under mpirun it is measured) the first layer goes by rows
    (cost.choose_first_layer: 2 collectives and the rows, against the partials and the first Dense's
    exchanges); a small model whose tail stays replicated keeps its operators; a pinned tail too."""
    import models
    from des.jobs.verify import small_spec
    from des_ops.comm import InProcessWorld
    wide = lambda: models.deepfm(small_spec(n_fields=8, dim=8), hidden=(400, 400, 400))  # noqa: E731
    slow = AutoTail(bandwidth=1.25e7)
    _, report = des.transform(wide(), des.Options(costs=slow), comm=InProcessWorld(4).communicator(0))
    assert report.tail == "data_parallel" and report.first_layer == "rows", str(report)
    assert report.first_layer_reason.startswith("rows: ") and "first layer by rows: no operator is split" in str(report)
    _, report = des.transform(wide(), des.Options(costs=slow, tail="data_parallel"), comm=InProcessWorld(4).communicator(0))
    assert report.first_layer == "operators" and report.first_layer_reason == ""
    _, report = des.transform(BUILDERS["keras_deepfm"](), des.Options(costs=slow), comm=InProcessWorld(4).communicator(0))
    assert report.tail == "replicated" and report.first_layer == "operators"


def test_the_tail_goes_data_parallel_where_field_rows_by_samples_save_the_link():
    """DeepCTR's DCN on 4 simulated processes at 100 Mbit/s: under the replicated tail its 4 field
    vectors would travel as partials of the whole batch in the allreduce; the cost model counts what
    sending them by samples saves (cost.choose_tail's ``field_rows``), so the tail goes data-parallel
    and the vectors by samples. At 10 Gbit/s the small tail stays replicated (before this, DCN-v2 and
    AutoInt on 4 netbed hosts at 100 Mbit/s sent 8 MB a step as partials: reports/arch_netbed.md)."""
    from des_ops.comm import InProcessWorld
    slow = des.Options(costs=AutoTail(bandwidth=1.25e7, batch_size=1 << 16))
    _, report = des.transform(BUILDERS["deepctr_dcn"](), slow, comm=InProcessWorld(4).communicator(0))
    assert report.tail == "data_parallel" and sum(report.by_samples) > 0, str(report)
    assert "field rows by samples add" in report.tail_reason
    _, report = des.transform(BUILDERS["deepctr_dcn"](), des.Options(), comm=InProcessWorld(4).communicator(0))
    assert report.tail == "replicated" and report.by_samples == []


@pytest.mark.parametrize("distinct", [True, False])
def test_the_report_gives_each_fields_owner_exchange_and_bytes_on_the_sample(distinct):
    """des.transform's report, per field: its owner, its tables, rows by samples, once per distinct id
    (or per sample), and the bytes its owner sends a step on the ``sample=`` batch, hand-counted here:
    6 rows at N = 2 (slices [0, 3) and [3, 6)), Embedding width 3, 4 B a float."""
    import re
    from des_ops.comm import InProcessWorld
    from des.jobs.verify import _on_every_rank
    L = tf.keras.layers

    def build():
        x = {f: tf.keras.Input(shape=(), dtype=tf.int64, name=f) for f in ("a", "b")}
        e = [L.Embedding(10 * (k + 1), 3, name=f"emb_{f}")(x[f]) for k, f in enumerate(("a", "b"))]
        return tf.keras.Model(x, L.Dense(1)(L.Dense(4, activation="relu")(L.Concatenate()(e))))

    sample = {"a": np.array([1, 1, 2, 3, 3, 3]), "b": np.array([5, 6, 7, 8, 9, 8])}
    distinct_in = {("a", 0): 1, ("a", 1): 2, ("b", 0): 2, ("b", 1): 3}    # (field, owner): ids of the other slice
    world = InProcessWorld(2)
    reports = [rep for _, rep in _on_every_rank(world, lambda r: des.transform(
        build(), des.Options(first_layer="rows", distinct_rows=distinct), comm=world.communicator(r), sample=sample))]
    text = str(reports[0])
    assert "exchange per field (bytes a step its owner sends, on the sample batch of 6 rows at N = 2):" in text
    for f in ("a", "b"):
        owner = reports[0].plan.owner[f]
        rows = distinct_in[f, owner] if distinct else 3
        once = "once per distinct id" if distinct else "once per sample"
        line = (f"{f} (rank {owner}; emb_{f}): rows to its samples' processes, 3 floats a row, {once}: "
                f"{4 * 3 * rows:,} B a step out, as many back")
        assert line in text, text
    assert all(r.exchanges == reports[0].exchanges for r in reports)
    no_sample = [rep for _, rep in _on_every_rank(world, lambda r: des.transform(
        build(), des.Options(first_layer="rows"), comm=world.communicator(r)))][0]
    assert "pass sample=<a global batch> to des.transform for bytes a step" in str(no_sample)
    assert not re.search(r"B a step out", "\n".join(no_sample.exchanges))


@pytest.mark.parametrize("dtype", ["string", "int32"])
def test_rows_keyed_by_string_or_int32_ids_equal_one_process(dtype):
    """Rows by samples travel by their ids whatever the ids' dtype: string inputs through a StringLookup
    (as TFRS models read them) and int32 inputs, two fields of one width on each process (one lane of
    two keys), the first layer by rows at N = 2: 8 SGD steps of 31 rows equal one process."""
    from des.jobs.verify import copy_state
    L = tf.keras.layers
    names, vocab = ["a", "b", "c", "d"], [str(i) for i in range(20)]
    kind = tf.string if dtype == "string" else tf.int32

    def build():
        x = {f: tf.keras.Input(shape=(), dtype=kind, name=f) for f in names}
        ids = {f: L.StringLookup(vocabulary=vocab, name=f"lookup_{f}")(x[f]) for f in names} if dtype == "string" else x
        e = [L.Embedding(30, 3, name=f"emb_{f}")(ids[f]) for f in names]
        return tf.keras.Model(x, L.Dense(1, activation="sigmoid", name="out")(
            L.Dense(4, activation="relu", name="hidden")(L.Concatenate()(e))))

    rng = np.random.default_rng(3)
    raw = {f: rng.zipf(1.5, 8 * 31) % 20 for f in names}
    x = {f: np.array([str(v) for v in raw[f]]) if dtype == "string" else raw[f].astype(np.int32) for f in names}
    y = rng.integers(0, 2, 8 * 31).astype(np.float32)
    batches = [({f: v[i:i + 31] for f, v in x.items()}, y[i:i + 31]) for i in range(0, 8 * 31, 31)]
    tf.keras.utils.set_random_seed(0)
    base, reference = build(), build()
    copy_state(base, reference)

    def train(m):
        m.compile(tf.keras.optimizers.legacy.SGD(0.5), "binary_crossentropy")
        for bx, by in batches:
            m.train_on_batch(bx, by)
        return m.predict_on_batch(batches[0][0])

    expected = train(reference)
    got = run_in_process_world(2, build, lambda m: (train(m), des.distributed(m).layer.ops), init_from=base,
                               first_layer="rows")
    for predictions, ops in got:
        assert sorted(op.block.key for op in ops) == names            # every field keyed by its own input
        within(f"{dtype} ids by rows N=2: predictions", float(np.max(np.abs(predictions - expected))), 1e-6)

"""The data-parallel tail (des.transform(tail="data_parallel"), des_ops/tail.py): each process runs
the layers after the first one on its own rows of the batch, and the model still computes what
the untouched model computes on one process. Batches of 31 rows (not divisible by 2, 3 or 5) and
a last batch of 2 (some processes hold no row); N = 5 > 4 fields (a process owns no field).

Tolerances at most 10x what they measure (reports/tolerances.md, scripts/tolerances.py): rows and
weights within 5e-7 under SGD and under Adam, Adagrad and FTRL (measured <= 7.5e-8 and <= 8.9e-8:
these 5 steps do not reach the amplification tests/test_gallery.py's Adam bound allows for),
predictions within 1e-6 (<= 1.2e-7), the fit's AUC and loss within 2e-6 (<= 3.0e-7)."""
import numpy as np
import pytest
import tensorflow as tf

import des
from des.jobs.verify import compare, copy_state, fit_and_snapshot, run_in_process_world
from des_ops.comm import InProcessWorld, LocalCommunicator, shard_rows
from gallery import BUILDERS, FIELDS, K, V, batches_for
from helpers import within

L = tf.keras.layers
ROWS, BATCH = 5 * 31 + 2, 31
TOL_SGD, TOL_ADAPTIVE_STATE, TOL_PREDICTIONS, TOL_METRICS = 5e-7, 5e-7, 1e-6, 2e-6


def _data(model):
    x, y = batches_for(model, 1, ROWS, seed=4)[0]
    batches = [({k: v[i:i + BATCH] for k, v in x.items()}, y[i:i + BATCH]) for i in range(0, ROWS, BATCH)]
    return batches, batches_for(model, 1, 16, seed=99)[0][0]


def _reference_and_base(name, optimizer, lr):
    build = BUILDERS[name]
    tf.keras.utils.set_random_seed(0)
    base = build()
    des.make_keyed(base, seed=0)
    batches, probe = _data(base)
    reference = build()
    copy_state(base, reference)
    des.make_keyed(reference, seed=0)
    fit = lambda m: fit_and_snapshot(m, batches, probe, optimizer=optimizer, learning_rate=lr)
    return build, base, fit, fit(reference)


def _check(ref, ranks, optimizer):
    diff = compare(ref, ranks)
    metrics = max(max(abs(r["auc"] - ref["auc"]), abs(r["loss"] - ref["loss"])) for r in ranks)
    state = max(diff["tables"], diff["owned"], diff["weights"])
    within("predictions", diff["predictions"], TOL_PREDICTIONS, case=optimizer)
    within("AUC and loss", metrics, TOL_METRICS, case=optimizer)
    within(f"rows and weights ({'SGD' if optimizer == 'sgd' else 'adaptive'})", state,
           TOL_SGD if optimizer == "sgd" else TOL_ADAPTIVE_STATE, case=optimizer)
    return diff


@pytest.mark.parametrize("name, worlds", [("keras_deepfm", (2, 3, 5)), ("deepctr_deepfm", (5,)),
                                          ("regularized", (3,)), ("two_tower", (2,)), ("deepctr_dcn", (2, 5))])
def test_data_parallel_tail_equals_one_process(name, worlds):
    """keras_deepfm: FM + first Dense + linear sum; deepctr_deepfm: DeepCTR's penalties on tables
    and tail (N = 5: a process owns no field); regularized: penalties on the first Dense's bias
    and replicated rows (tail side); two_tower: two first Dense layers; deepctr_dcn: every table
    by field rows (its Cross reads them), each process its rows of every field's vector."""
    build, base, fit, ref = _reference_and_base(name, "sgd", 0.5)
    for n in worlds:
        ranks = run_in_process_world(n, build, lambda m: {**fit(m), "tail": des.distributed(m).tail}, init_from=base,
                                     tail="data_parallel")
        assert all(r["tail"] == "data_parallel" for r in ranks)
        print(name, n, _check(ref, ranks, "sgd"))


@pytest.mark.parametrize("optimizer, lr", [("adam", 0.02), ("adagrad", 0.05), ("ftrl", 0.05)])
def test_data_parallel_tail_with_adaptive_optimizers(optimizer, lr):
    build, base, fit, ref = _reference_and_base("keras_deepfm", optimizer, lr)
    ranks = run_in_process_world(3, build, fit, init_from=base, tail="data_parallel")
    print(optimizer, _check(ref, ranks, optimizer))


def test_same_bits_every_run_and_replicated_tail_agrees():
    build, base, fit, ref = _reference_and_base("keras_deepfm", "sgd", 0.5)
    runs = [run_in_process_world(3, build, fit, init_from=base, tail="data_parallel") for _ in range(2)]
    for a, b in zip(*runs):                               # every rank's predictions, rows and weights
        flat_a, flat_b = tf.nest.flatten(a), tf.nest.flatten(b)
        assert len(flat_a) == len(flat_b) > 3
        for u, v in zip(flat_a, flat_b):
            np.testing.assert_array_equal(np.asarray(u), np.asarray(v))
    replicated = run_in_process_world(3, build, fit, init_from=base)
    _check(ref, replicated, "sgd")
    _check(ref, runs[0], "sgd")
    np.testing.assert_allclose(replicated[0]["predictions"], runs[0][0]["predictions"], atol=TOL_PREDICTIONS)


def test_bytes_counted_equal_analytic():
    """Per train step of B rows on rank r (b_r rows): the reduce-scatter hands over B x W floats
    ("step"); the output all-gather b_r x 1, the backward all-gather b_r x W and the tail's
    gradients T ("tail"). Predict: B x W and b_r x 1."""
    build, base, fit, _ = _reference_and_base("keras_deepfm", "sgd", 0.5)
    n = 3

    def work(m):
        before = des.distributed(m).layer.comm.counted()
        fit(m)
        after = des.distributed(m).layer.comm.counted()
        return {p: after[p]["bytes"] - before[p]["bytes"] for p in ("step", "tail")}, des.distributed(m).layer.floats_per_sample(), \
            sum(int(v.shape.num_elements()) for v in des.distributed(m).tail_variables)
    out = run_in_process_world(n, build, work, init_from=base, tail="data_parallel")
    sizes = [BATCH] * (ROWS // BATCH) + [ROWS % BATCH]
    # by hand, from tests/gallery.py keras_deepfm (4 fields, K = 4, Dense 8 -> Dense 1): a sample's
    # partials are the linear sum (1), the FM's S and Q (K + 1) and the first Dense's 8 units; the
    # tail's variables the first Dense's bias (8) and the last Dense's kernel and bias (8 + 1)
    w, t = 1 + (K + 1) + 8, 8 + 8 * 1 + 1
    for r, (counted, w_model, t_model) in enumerate(out):
        assert (w_model, t_model) == (w, t) == (14, 17), (w_model, t_model)
        shard = lambda b: (lambda lo, hi: hi - lo)(*shard_rows(b, r, n))
        step = sum(4 * b * w for b in sizes) + 4 * 16 * w
        tail = sum(4 * (shard(b) * 1 + shard(b) * w + t) for b in sizes) + 4 * shard(16)
        assert counted == {"step": step, "tail": tail}, (r, counted, step, tail)
    assert shard_rows(2, 2, 3) == (2, 2)                                # the last batch: rank 2 holds none


def test_a_batch_smaller_than_the_world_predicts_every_row():
    build, base, _, _ = _reference_and_base("keras_deepfm", "sgd", 0.5)
    x = batches_for(base, 1, 2, seed=5)[0][0]
    expected = base.predict_on_batch(x)
    preds = run_in_process_world(3, build, lambda m: m.predict_on_batch(x), init_from=base, tail="data_parallel")
    for p in preds:
        np.testing.assert_allclose(p, expected, atol=1e-6)


def _inputs():
    return {f: tf.keras.Input(shape=(), dtype=tf.int64, name=f) for f in FIELDS}


def test_negative_tails_that_cannot_run_data_parallel():
    x = _inputs()
    h = L.Dense(8)(L.Concatenate()([L.Embedding(V, K)(x[f]) for f in FIELDS]))
    bn = tf.keras.Model(x, L.Dense(1)(L.BatchNormalization(name="bn")(h)))
    with pytest.raises(ValueError, match=r"'bn' \(BatchNormalization\) computes statistics over the whole batch"):
        des.transform(bn, des.Options(tail="data_parallel"), comm=LocalCommunicator())
    with pytest.raises(ValueError, match="choose from auto, replicated, data_parallel"):
        des.transform(BUILDERS["keras_deepfm"](), des.Options(tail="sharded"), comm=LocalCommunicator())


def _tower(hidden, batch_norm=False):
    x = _inputs()
    h = L.Dense(16, activation="relu")(L.Concatenate()([L.Embedding(V, K)(x[f]) for f in FIELDS]))
    if batch_norm:
        h = L.BatchNormalization(name="bn")(h)
    for units in hidden:
        h = L.Dense(units, activation="relu")(h)
    return tf.keras.Model(x, L.Dense(1, activation="sigmoid")(h))


def test_auto_tail_follows_the_cost_model():
    """tail="auto" on 4 simulated processes: a wide tail (256, 256: 69,888 kernel weights)
    is run data-parallel at B = 4096 and replicated at B = 64 (the products saved no longer
    pay for three more collectives), a narrow one (8) is replicated, one the data-parallel tail
    cannot run (BatchNormalization) is replicated, not refused; one process keeps the replicated
    tail. Every process picks the same."""
    from des.compiler.cost import AutoTail, choose_tail
    cases = [((256, 256), False, 4096, "data_parallel"), ((256, 256), False, 64, "replicated"),
             ((8,), False, 4096, "replicated"), ((256, 256), True, 4096, "replicated")]
    for hidden, batch_norm, batch, expected in cases:
        tails = run_in_process_world(4, lambda: _tower(hidden, batch_norm), lambda m: des.distributed(m).tail,
                                     tail="auto", costs=AutoTail(batch_size=batch))
        assert tails == [expected] * 4, (hidden, batch_norm, batch, tails)
    dense = 16 * 256 + 256 * 256 + 256                     # the tail's kernels: 16x256, 256x256, 256x1
    assert choose_tail(dense, dense + 513, 1, 4, AutoTail(batch_size=4096))[0] == "data_parallel"
    _, report = des.transform(_tower((256, 256), batch_norm=True), des.Options(tail="auto"), comm=InProcessWorld(1).communicator(0))
    assert report.tail == "replicated" and "one process" in str(report)
    world = InProcessWorld(2)
    reasons = [des.transform(_tower((256, 256), batch_norm=True), des.Options(tail="auto"), comm=world.communicator(r))[1]
               .tail_reason for r in range(2)]
    assert "'bn' (BatchNormalization) computes statistics" in reasons[0] and reasons[0] == reasons[1]


def test_report_says_the_tail_is_data_parallel():
    world = InProcessWorld(1)
    _, report = des.transform(BUILDERS["keras_deepfm"](), des.Options(tail="data_parallel"), comm=world.communicator(0))
    assert "data-parallel tail" in str(report)


def test_checkpoints_move_between_one_process_and_the_data_parallel_tail(tmp_path):
    """The project's DeepFM (TFRA tables, FTRL on the linear part, Adagrad on the rest): one
    process trains 3 steps and saves; DES on 3 with the data-parallel tail restores it (the same
    predictions), trains 2 more steps (the uninterrupted single model's predictions) and saves;
    one process restores that (the same rows and predictions as the data-parallel run)."""
    import json
    import os

    import models
    from des.runtime import checkpoint
    from des.jobs.verify import random_batches, small_spec
    spec = small_spec(5, dim=4)
    batches, probe = random_batches(spec, 5, 32, seed=11), random_batches(spec, 1, 64, seed=99)[0][0]
    build = lambda: models.build("deepfm", spec, seed=1, hidden=(8,))            # noqa: E731
    optimizer = lambda: models.make_optimizer("adagrad", 0.05, linear="ftrl", linear_learning_rate=0.05)  # noqa: E731
    config = {"model": "deepfm", "spec": json.loads(spec.to_json()), "hidden": "8", "seed": 1, "dim": 4,
              "format": "libffm", "optimizer": "adagrad", "linear_optimizer": "ftrl"}
    ref, opt = build(), optimizer()
    ref.compile(opt, "binary_crossentropy")
    for x, y in batches[:3]:
        ref.train_on_batch(x, y)
    single, dp = str(tmp_path / "single"), str(tmp_path / "dp")
    checkpoint.save(single, ref, opt, config=config, position={"epoch": 0, "step": 3})
    at3 = np.asarray(ref.predict_on_batch(probe))
    for x, y in batches[3:]:
        ref.train_on_batch(x, y)
    at5 = np.asarray(ref.predict_on_batch(probe))

    def resume(m):
        comm = des.distributed(m).layer.comm
        o = optimizer()
        m.compile(o, "binary_crossentropy")
        checkpoint.restore(single, m, o, comm.rank, 3)
        p3 = np.asarray(m.predict_on_batch(probe))
        for x, y in batches[3:]:
            m.train_on_batch(x, y)
        checkpoint.save(dp, m, o, des.distributed(m).plan, comm.rank, 3, config=config,
                        barrier=lambda: comm.allreduce(tf.zeros([1])))
        return p3, np.asarray(m.predict_on_batch(probe))
    for p3, p5 in run_in_process_world(3, build, resume, tail="data_parallel", tables="fused"):   # FTRL + Adagrad
        assert np.abs(p3 - at3).max() <= 1e-6 and np.abs(p5 - at5).max() <= 1e-6
    assert sorted(os.listdir(os.path.join(dp, "state"))) == ["config.json"] + [f"rank{r}-of-3.npz" for r in range(3)]
    back, o = build(), optimizer()
    back.compile(o, "binary_crossentropy")
    checkpoint.restore(dp, back, o)
    assert np.abs(np.asarray(back.predict_on_batch(probe)) - at5).max() <= 1e-6

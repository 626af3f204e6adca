"""Equivalence in the simulated world: a DES model on N in-process ranks equals the untouched
single-process model (predictions after every step, final table rows, dense weights)."""
import numpy as np
import pytest
import tensorflow as tf
from helpers import random_batches, small_spec

import des
import models
from des.jobs.verify import compare, run_in_process_world, train_and_snapshot
from des_ops.comm import InProcessWorld, LocalCommunicator, allreduce_sum
from models.layers import FieldEmbedding
from models.spec import PAD_ID, FeatureSpec, Field

TOL = 2e-6   # the README quotes <= 2.7e-7 measured; float32 summation order, not a loose bound
SPEC = small_spec(4, dim=3)
BATCHES = random_batches(SPEC, 20, 32, seed=4)
PROBE = random_batches(SPEC, 1, 16, seed=99)[0][0]
LR = {"sgd": 0.2, "adagrad": 0.05, "adam": 0.01, "ftrl": 0.05}


def build(name):
    return lambda: models.build(name, SPEC, seed=3, hidden=(8, 4))


# Two optimizers per model, each optimizer on two or three models (pairwise, not the full 5 x 4:
# an optimizer's update of the owned rows does not depend on which rule split the model, and what
# a model's split does with the gradients does not depend on the optimizer; suite time). Each pair
# runs at N = 3 (an uneven split, 2/1/1 fields) and at one more size: N = 2 (two fields per rank,
# an even split) or N = 5 (more ranks than fields: one is idle). Every model runs at N = 2, 3 and
# 5. What an idle rank holds - replicated dense weights only, no table, no kernel block - every
# rank holds at N = 2 and 3 too; what is idle-specific (zeros as its partial results, nothing to
# look up or update) depends on the model, not on the optimizer. The plan side of an idle rank:
# tests/test_rules.py. The wide sweeps under mpirun: tests/test_mpi.py (N = 4 there).
SWEEP = [("lr", "ftrl", 5), ("lr", "sgd", 2), ("fm", "adagrad", 5), ("fm", "adam", 2),
         ("dnn", "sgd", 5), ("dnn", "adam", 2), ("wdl", "ftrl", 5), ("wdl", "adagrad", 2),
         ("deepfm", "adam", 5), ("deepfm", "ftrl", 2)]


@pytest.mark.parametrize("name, optimizer, other_n", SWEEP)
def test_sweep_n_3_and_2_or_5(name, optimizer, other_n):
    """A model x optimizer of SWEEP at N = 3 and at ``other_n`` equals the untouched model on one
    process. N = 1 is test_n1_des_equals_plain_model."""
    work = lambda m: train_and_snapshot(m, optimizer, LR[optimizer], BATCHES, PROBE)
    ref = work(build(name)())
    assert np.ptp(ref["predictions"][:, 0]) > 1e-3          # training moved the predictions
    for n in (3, other_n):
        diff = compare(ref, run_in_process_world(n, build(name), work))
        print(f"{name} {optimizer} N={n}: {diff}")
        assert max(diff.values()) < TOL, (n, diff)


def test_the_sweep_covers_every_model_optimizer_and_size():
    """SWEEP's design: every model at N = 2, 3 and 5 with two optimizers, every optimizer twice or more."""
    names = ["lr", "fm", "dnn", "wdl", "deepfm"]
    assert sorted({m for m, _, _ in SWEEP}) == sorted(names)
    for m in names:
        assert sorted(n for mm, _, n in SWEEP if mm == m) == [2, 5] and len({o for mm, o, _ in SWEEP if mm == m}) == 2
    for o in LR:
        assert sum(oo == o for _, oo, _ in SWEEP) >= 2, o


@pytest.mark.parametrize("name", ["deepfm"])     # a linear part and a rest (Wide & Deep's too, with FM)
def test_ftrl_on_the_linear_part_adam_on_the_rest(name):
    """Wide&Deep's usual optimizers (FTRL for the linear part, Adam for the rest) under DES on 2
    processes (which optimizer updates a row does not depend on N: test_sweep_n_3_and_2_or_5 sweeps N)."""
    make = lambda: models.make_optimizer("adam", LR["adam"], linear="ftrl", linear_learning_rate=LR["ftrl"])  # noqa: E731
    work = lambda m: train_and_snapshot(m, make, None, BATCHES, PROBE)  # noqa: E731
    ref = work(build(name)())
    adam_only = train_and_snapshot(build(name)(), "adam", LR["adam"], BATCHES, PROBE)
    assert np.abs(ref["predictions"] - adam_only["predictions"]).max() > 1e-4  # FTRL did act
    diff = compare(ref, run_in_process_world(2, build(name), work))
    print(f"{name} ftrl+adam N=2: {diff}")
    assert max(diff.values()) < TOL, diff


def test_n1_des_equals_plain_model():
    x = PROBE
    for name in ["lr", "fm", "dnn", "wdl", "deepfm"]:
        plain = build(name)()
        expected = plain.predict_on_batch(x)
        new, report = des.transform(build(name)(), comm=LocalCommunicator())
        assert report.changed
        np.testing.assert_allclose(new.predict_on_batch(x), expected, rtol=0, atol=1e-6)


def test_identity_gradient_through_allreduce():
    world = InProcessWorld(3)
    results = [None] * 3

    def rank(r):
        comm = world.communicator(r)
        x = tf.Variable(tf.fill([2, 2], float(r + 1)))
        with tf.GradientTape() as tape:
            y = allreduce_sum(comm, x)
            loss = tf.reduce_sum(y * tf.constant([[1.0, 2.0], [3.0, 4.0]]))
        results[r] = (y.numpy(), tape.gradient(loss, x).numpy(), int(comm.payload_bytes.numpy()))

    import threading
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    for y, g, sent in results:
        assert np.all(y == 6.0)                                  # 1 + 2 + 3
        assert np.array_equal(g, [[1.0, 2.0], [3.0, 4.0]])       # identity, not 3x
        assert sent == 16


def test_transform_keeps_trained_weights():
    base = build("deepfm")()
    base.compile(models.make_optimizer("adam", 0.02), "binary_crossentropy")
    for x, y in BATCHES[:5]:
        base.train_on_batch(x, y)
    expected = base.predict_on_batch(PROBE)
    # rank 0 holds the trained model; the other ranks build fresh random ones and must get
    # rank 0's weights and rows from the transform's broadcast
    preds = run_in_process_world(3, build("deepfm"), lambda m: m.predict_on_batch(PROBE), init_from=base)
    for p in preds:
        np.testing.assert_allclose(p, expected, atol=1e-6)


def test_replica_check_names_the_step_and_the_diverged_layer():
    from des.runtime.callbacks import ReplicaCheck

    def work(m):
        comm = des.distributed(m).layer.comm
        check = ReplicaCheck(comm, every=2)
        check.set_model(m)
        check.on_train_batch_end(0)
        check.on_train_batch_end(1)                  # step 2: replicas agree
        if comm.rank == 1:                           # now rank 1's tail drifts
            w = m.get_layer("dnn_1")
            w.set_weights([v + 1e-3 for v in w.get_weights()])
        check.on_train_batch_end(2)
        try:
            check.on_train_batch_end(3)
        except RuntimeError as e:
            return str(e)
        return "no error"

    for msg in run_in_process_world(2, build("deepfm"), work):
        assert "replicas diverged at step 4" in msg and "dnn_1" in msg


def test_processes_reading_different_batches_are_named_by_the_replica_check():
    from des.runtime.callbacks import ReplicaCheck

    def work(m, same):
        comm = des.distributed(m).layer.comm
        m.compile(models.make_optimizer("sgd", 0.1), "binary_crossentropy")
        check = ReplicaCheck(comm, every=1)
        check.set_model(m)
        check.on_train_batch_begin(0)                # arms the DES layer's fingerprint for this step
        m.train_on_batch(*BATCHES[0 if same else comm.rank])
        try:
            check.on_train_batch_end(0)
        except RuntimeError as e:
            return str(e)
        return "agree"

    assert run_in_process_world(2, build("deepfm"), lambda m: work(m, True)) == ["agree", "agree"]
    for msg in run_in_process_world(2, build("deepfm"), lambda m: work(m, False)):
        assert "processes read different batches at step 1" in msg, msg


def test_the_batch_fingerprint_is_taken_on_the_checked_steps_only():
    """The DES layer fingerprints a training batch only when a ReplicaCheck armed it for that step:
    fit without one leaves it untouched; with one every 2 steps it holds the digest of step 4's batch
    (des_ops.partials.fingerprint over every input), and the switch is off again after fit."""
    from des.runtime.callbacks import ReplicaCheck
    from des_ops.partials import fingerprint

    def work(m):
        layer = des.distributed(m).layer
        m.compile(models.make_optimizer("sgd", 0.1), "binary_crossentropy")
        for x, y in BATCHES[:2]:
            m.train_on_batch(x, y)
        untouched = float(layer.batch_fingerprint.numpy())
        seen = []

        class Spy(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                seen.append(float(layer.batch_fingerprint.numpy()))
        x0, y0 = BATCHES[0]
        signature = ({k: tf.TensorSpec.from_tensor(tf.convert_to_tensor(v)) for k, v in x0.items()},
                     tf.TensorSpec.from_tensor(tf.convert_to_tensor(y0)))
        m.fit(tf.data.Dataset.from_generator(lambda: iter(BATCHES[:5]), output_signature=signature),
              epochs=1, verbose=0, callbacks=[ReplicaCheck(layer.comm, every=2), Spy()])
        digests = [float(fingerprint([x[k] for k in sorted(x)]).numpy()) for x, _ in BATCHES[:5]]
        return untouched, seen, digests, bool(layer.fingerprint_armed.numpy())

    for untouched, seen, digests, armed in run_in_process_world(2, build("deepfm"), work):
        assert untouched == 0.0
        assert seen == [0.0, digests[1], digests[1], digests[3], digests[3]]
        assert len(set(digests)) == 5 and not armed


def test_processes_with_different_field_plans_fail_at_transform():
    from des.compiler.plan import FieldPlan
    from des_ops.comm import DisagreementError
    world = InProcessWorld(2)
    names = SPEC.names()
    a = FieldPlan(2, {f: i % 2 for i, f in enumerate(names)}, "mod")
    b = FieldPlan(2, {f: int(i < 2) for i, f in enumerate(names)}, "mod")
    des.transform(build("fm")(), des.Options(plan=a), comm=world.communicator(0))
    with pytest.raises(DisagreementError, match=r"rank 1 of 2 disagrees with rank 0 on the field plan: "
                                                 r"rank 0 has 'f0 -> 0, f1 -> 1, .*', rank 1 has 'f0 -> 1, f1 -> 1, "):
        des.transform(build("fm")(), des.Options(plan=b), comm=world.communicator(1))
    world = InProcessWorld(2)                     # same owners, other label: fine
    des.transform(build("fm")(), des.Options(plan=a), comm=world.communicator(0))
    des.transform(build("fm")(), des.Options(plan=FieldPlan(2, dict(a.owner), "balanced")), comm=world.communicator(1))


MIXED = FeatureSpec((Field("u", "categorical", 3, 30), Field("tags", "multi", 3, 40, max_len=4),
                     Field("terms", "multi", 3, 60, max_len=5, weighted=True),
                     Field("ad", "categorical", 3, 20)))
MIXED_BATCHES = random_batches(MIXED, 12, 32, seed=5)


@pytest.mark.parametrize("name", ["deepfm"])    # its three rules are FM's and Wide & Deep's too
def test_multi_valued_and_weighted_fields(name):
    """Sum-pooled and weighted (libsvm/libffm idx:val) fields substitute exactly too."""
    make = lambda: models.build(name, MIXED, seed=3, hidden=(8, 4))
    work = lambda m: train_and_snapshot(m, "adagrad", 0.05, MIXED_BATCHES, MIXED_BATCHES[0][0])
    ref = work(make())
    assert np.ptp(ref["predictions"][:, 0]) > 1e-3
    for n in (2, 3):
        diff = compare(ref, run_in_process_world(n, make, work))
        assert max(diff.values()) < TOL, (n, diff)


def test_weights_change_the_pooled_embedding_and_padding_is_not_a_key():
    emb = models.layers.FieldEmbedding("terms", 2, seed=0, init_scale=0.5)
    ids = tf.constant([[5, 6, PAD_ID], [5, PAD_ID, PAD_ID]], tf.int64)
    w = tf.constant([[2.0, 1.0, 0.0], [0.5, 0.0, 0.0]])
    rows = emb(tf.constant([5, 6], tf.int64), training=True).numpy()
    out = emb([ids, w], training=True).numpy()
    np.testing.assert_allclose(out, [2 * rows[0] + rows[1], 0.5 * rows[0]], rtol=1e-6)
    assert int(emb.params.size()) == 2                       # PAD_ID was never inserted
    np.testing.assert_allclose(emb(ids, training=True).numpy()[1], rows[0], rtol=1e-6)


def test_weighted_fields_are_substituted():
    _, report = des.transform(models.build("deepfm", MIXED, seed=3, hidden=(8, 4)), comm=LocalCommunicator())
    assert sorted(m.rule for m in report.substitutions) == ["embed_concat_dense", "fm_interaction", "lr_sum"]
    assert all(len(m.vectors) == 4 for m in report.substitutions), str(report)


def test_fit_with_reshuffling_over_epochs():
    """model.fit for 3 epochs on a tf.data pipeline reshuffled every epoch (seeded), on multi-valued
    and weighted fields: DES at N = 3 equals the single-process model fit the same way."""
    from des.jobs.verify import fit_and_snapshot
    make = lambda: models.build("wdl", MIXED, seed=3, hidden=(8, 4))  # noqa: E731
    batches, probe = MIXED_BATCHES[:10], random_batches(MIXED, 1, 16, seed=99)[0][0]
    work = lambda m: fit_and_snapshot(m, batches, probe, "adagrad", 0.05, epochs=3, shuffle_seed=11)  # noqa: E731
    ref = work(make())
    in_order = fit_and_snapshot(make(), batches, probe, "adagrad", 0.05, epochs=3)
    reorder = np.abs(ref["predictions"] - in_order["predictions"]).max()
    assert reorder > 1e-4, reorder                         # the shuffle did reorder the rows
    diff = compare(ref, run_in_process_world(3, make, work))
    print(f"wdl adagrad fit 3 epochs shuffled N=3: {diff}; shuffled vs in order: {reorder:.3g}")
    assert max(diff.values()) < TOL, diff


def test_mod_plan_is_exact():
    """plan="mod" (field i -> rank i mod N, the DES paper's layout) is exact at N = 3, also where
    the balanced plan for the same spec would place the fields differently."""
    mod = {f: i % 3 for i, f in enumerate(SPEC.names())}
    balanced = run_in_process_world(3, build("deepfm"), lambda m: des.distributed(m).plan.owner, spec=SPEC)[0]
    assert balanced != mod, balanced                       # the sweep's default plan is not this one
    work = lambda m: train_and_snapshot(m, "adagrad", LR["adagrad"], BATCHES, PROBE)  # noqa: E731
    ref = work(build("deepfm")())
    ranks = run_in_process_world(3, build("deepfm"), lambda m: {**work(m), "plan": des.distributed(m).plan},
                                 plan="mod", spec=SPEC)
    for r in ranks:
        assert (r["plan"].strategy, r["plan"].owner) == ("mod", mod), r["plan"]
    diff = compare(ref, ranks)
    print(f"deepfm adagrad N=3 plan=mod {mod}: {diff}")
    assert max(diff.values()) < TOL, diff


class _ClipIfLarge(tf.keras.layers.Layer):
    """A user layer with Python control flow on a tensor, which only autograph makes traceable."""

    def call(self, x):
        if tf.reduce_max(tf.abs(x)) > 0.02:
            return tf.clip_by_value(x, -0.02, 0.02)
        return x


def test_a_user_layer_with_tensor_control_flow_in_a_field_chain_is_still_converted():
    """The DES layer's own call is plain TensorFlow (autograph off: ~1 s of the first step); the user
    layers it calls in a field's chain (here between a table and the first Dense layer) keep
    autograph, as in the untouched model, and the result is the untouched model's."""
    def make():
        x = {f: tf.keras.Input((), dtype=tf.int64, name=f) for f in SPEC.names()}
        rows = [_ClipIfLarge()(FieldEmbedding(f, 3, seed=0)(x[f])) for f in SPEC.names()]
        h = tf.keras.layers.Dense(4, activation="relu", kernel_initializer=tf.keras.initializers.GlorotUniform(1))(
            tf.keras.layers.Concatenate()(rows))
        return tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid",
                                                       kernel_initializer=tf.keras.initializers.GlorotUniform(2))(h))
    work = lambda m: train_and_snapshot(m, "adam", 0.01, BATCHES[:6], PROBE)  # noqa: E731
    ref = work(make())
    runs = run_in_process_world(2, make, lambda m: (work(m), des.distributed(m).layer.ops), tables="fused")
    assert all(ops for _, ops in runs)          # the first Dense layer was substituted
    diff = compare(ref, [r for r, _ in runs])
    assert max(diff.values()) < TOL, diff

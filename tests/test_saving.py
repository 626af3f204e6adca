"""Getting a user's model out in the simulated world (des.runtime.saving, des.checkpoint, des.export):
optimizer slots read through the optimizers' public variables, ``model.save`` and
ModelCheckpoint on every process, disagreeing saves, resume on another N, bad checkpoints.
The same under a real mpirun, every optimizer: tests/test_mpi_saving.py."""
import os

import numpy as np
import pytest
import tensorflow as tf

import des
import models
from des.runtime import checkpoint
from des.runtime.checkpoint import CheckpointError
from des.runtime.saving import SaveError
from des.runtime.state import optimizer_slots
from des.jobs.verify import _on_every_rank, copy_state
from des_ops.comm import InProcessWorld
from gallery import BUILDERS, batches_for, optimizer_for

G = np.array([0.5, -2.0], np.float32)     # the gradient of the one step below
ONE_MINUS_BETA2 = np.float32(1) - np.float32(0.999)      # as legacy Adam computes it (new Adam: in Python)
# slot -> its value after one step from zeros with gradient G, by each optimizer's published update
# rule (Keras 2.15: Adagrad's and Ftrl's accumulators start at 0.1, rho 0.9, betas 0.9 / 0.999)
AFTER_ONE_STEP = {
    "adam": {"m": 0.1 * G, "v": (1 - 0.999) * G * G},
    "adagrad": {"accumulator": 0.1 + G * G},
    "sgd": {"m": -0.05 * G},
    "rmsprop": {"velocity": 0.1 * G * G, "average_gradient": 0.1 * G},
    "ftrl": {"accumulator": 0.1 + G * G},
    "legacy_adam": {"m": 0.1 * G, "v": ONE_MINUS_BETA2 * G * G},
    "legacy_adagrad": {"accumulator": 0.1 + G * G},
    "legacy_sgd": {"momentum": -0.05 * G},
    "legacy_rmsprop": {"rms": 0.1 * G * G, "mg": 0.1 * G},
    "legacy_ftrl": {"accumulator": 0.1 + G * G},
}
SLOTS = {"adam": {"m", "v"}, "adagrad": {"accumulator"}, "sgd": {"m"}, "ftrl": {"accumulator", "linear"},
         "rmsprop": {"velocity", "momentum", "average_gradient"}, "legacy_adam": {"m", "v"},
         "legacy_adagrad": {"accumulator"}, "legacy_sgd": {"momentum"}, "legacy_ftrl": {"accumulator", "linear"},
         "legacy_rmsprop": {"rms", "momentum", "mg"}}


@pytest.mark.parametrize("name", sorted(AFTER_ONE_STEP))
def test_optimizer_slots_are_found_by_name_with_their_values(name):
    from gallery import OPTIMIZERS
    w = tf.Variable(tf.zeros([2]), name=f"w_{name}")
    other = tf.Variable(tf.zeros([2]), name=f"x/w_{name}")        # a name that ends like w's
    opt = OPTIMIZERS[name]()
    opt.apply_gradients([(tf.constant(G), w), (tf.constant(G), other)])
    slots = optimizer_slots(opt, w)
    assert set(slots) == SLOTS[name]
    for slot, want in AFTER_ONE_STEP[name].items():
        np.testing.assert_allclose(slots[slot].numpy(), want, rtol=1e-6, err_msg=slot)
    assert not any(s is t for s in slots.values() for t in optimizer_slots(opt, other).values())


def _world(n: int, name: str, init, **transform_kwargs) -> tuple[InProcessWorld, list]:
    world, out = InProcessWorld(n), []
    for r in range(n):
        m = BUILDERS[name]()
        if r == 0:
            copy_state(init, m)
        out.append(des.transform(m, des.Options(**transform_kwargs), comm=world.communicator(r))[0])
    return world, out


def _case(name: str, steps: int = 6):
    tf.keras.utils.set_random_seed(0)
    init = BUILDERS[name]()
    return init, batches_for(init, steps, 32, seed=4), batches_for(init, 1, 16, seed=99)[0][0]


def _reference(name, init, batches, probe, opt="adam"):
    ref = BUILDERS[name]()
    copy_state(init, ref)
    des.make_keyed(ref, seed=0)
    ref.compile(optimizer_for(ref, opt), "binary_crossentropy")
    for x, y in batches:
        ref.train_on_batch(x, y)
    return np.asarray(ref.predict_on_batch(probe))


def test_model_save_and_model_checkpoint_on_every_process_write_the_untouched_model(tmp_path):
    """5 processes, 4 fields (rank 4 owns nothing): fit with ModelCheckpoint (whole model and
    weights only) on every process, then model.save in three formats. Each file is the untouched
    Keras DeepFM with the trained weights."""
    init, batches, probe = _case("keras_deepfm")
    ref = _reference("keras_deepfm", init, batches, probe)
    world, ranks = _world(5, "keras_deepfm", init)
    xs = {k: tf.concat([x[k] for x, _ in batches], 0) for k in batches[0][0]}
    ys = tf.concat([y for _, y in batches], 0)

    def work(r):
        m = ranks[r]
        m.compile(optimizer_for(m, "adam"), "binary_crossentropy")
        m.fit(xs, ys, batch_size=32, shuffle=False, verbose=0, callbacks=[
            tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "cb.keras")),
            tf.keras.callbacks.ModelCheckpoint(str(tmp_path / "cb_weights.h5"), save_weights_only=True)])
        for path in ("m.keras", "m.h5", "m_tf"):
            m.save(str(tmp_path / path))
        m.save_weights(str(tmp_path / "w.h5"))
        return np.asarray(m.predict_on_batch(probe))
    preds = _on_every_rank(world, work)
    assert max(np.abs(p - ref).max() for p in preds) < 2e-6
    assert all(p.tobytes() == preds[0].tobytes() for p in preds)
    for path in ("cb.keras", "m.keras", "m.h5", "m_tf"):
        again = tf.keras.models.load_model(str(tmp_path / path), compile=False)
        assert not any("des" in type(layer).__module__ for layer in again.submodules), path
        assert np.abs(again.predict_on_batch(probe) - preds[0]).max() <= 1e-6, path
    for path in ("cb_weights.h5", "w.h5"):
        fresh = BUILDERS["keras_deepfm"]()
        fresh.load_weights(str(tmp_path / path))
        assert np.abs(fresh.predict_on_batch(probe) - preds[0]).max() <= 1e-6, path


@pytest.mark.parametrize("tables", ["fused", "joined"])
def test_a_model_with_fused_tables_saves_its_own_tables(tmp_path, tables):
    """TFRA tables fused (or joined) into one table a process: a save writes each declared table
    with its trained rows (their storage, for the save, apart from the fused table's), and the
    DES model trains on and saves again (2 processes)."""
    init, batches, probe = _case("tfra_deepfm")
    world, ranks = _world(2, "tfra_deepfm", init, tables=tables)

    def work(r):
        m = ranks[r]
        m.compile(optimizer_for(m, "adam"), "binary_crossentropy")
        out = []
        for k, half in enumerate((batches[:3], batches[3:])):
            for x, y in half:
                m.train_on_batch(x, y)
            m.save(str(tmp_path / f"m{k}"))
            out.append(np.asarray(m.predict_on_batch(probe)))
        return out
    preds = _on_every_rank(world, work)[0]
    assert np.abs(preds[1] - preds[0]).max() > 1e-4                          # trained on after the first save
    for k, pred in enumerate(preds):
        again = tf.keras.models.load_model(str(tmp_path / f"m{k}"), compile=False)
        assert np.abs(again.predict_on_batch(probe) - pred).max() <= 1e-6, k


def test_a_save_the_processes_disagree_on_ends_every_process_naming_the_ranks(tmp_path):
    init, _, _ = _case("keras_deepfm", 1)
    world, ranks = _world(3, "keras_deepfm", init)
    errors = []

    def work(r):
        try:
            ranks[r].save(str(tmp_path / ("b.keras" if r == 2 else "a.keras")))
        except SaveError as e:
            errors.append(str(e))
    _on_every_rank(world, work)
    assert len(errors) == 3 and len(set(errors)) == 1 and "\n" not in errors[0]
    assert "ranks 0, 1: " in errors[0] and "rank 2: " in errors[0], errors[0]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name, opt, fuse", [("keras_deepfm", "rmsprop", False), ("deepctr_deepfm", "adam", False),
                                             ("tfra_deepfm", "adam", True)])
def test_checkpoint_of_des_2_resumes_exactly_on_des_3_and_one_process(tmp_path, name, opt, fuse):
    """Save after 4 of 8 steps on 2 processes; restore on 3 and on a plain model of one process
    (step counts, Adam's bias correction, rows with their slots) and train the other 4: both
    equal the uninterrupted single process."""
    init, batches, probe = _case(name, 8)
    ref = _reference(name, init, batches, probe, opt)
    ckpt = str(tmp_path / "ckpt")

    def run(n, work):
        world, ranks = _world(n, name, init, tables="fused" if fuse else "per-field")
        for m in ranks:
            m.compile(optimizer_for(m, opt), "binary_crossentropy")
        return _on_every_rank(world, lambda r: work(ranks[r], world.communicator(r)))

    def first_half(m, comm):
        for x, y in batches[:4]:
            m.train_on_batch(x, y)
        checkpoint.save(ckpt, m, m.optimizer)             # rank, world size and barrier: the model's

    def second_half(m, comm):
        checkpoint.restore(ckpt, m, m.optimizer)
        for x, y in batches[4:]:
            m.train_on_batch(x, y)
        return np.asarray(m.predict_on_batch(probe))
    run(2, first_half)
    got = run(3, second_half)
    one = BUILDERS[name]()
    copy_state(init, one)
    des.make_keyed(one, seed=0)
    one.compile(optimizer_for(one, opt), "binary_crossentropy")
    got.append(second_half(one, None))
    assert max(np.abs(p - ref).max() for p in got) < 2e-6


def test_the_first_layer_by_rows_checkpoints_saves_and_resumes_on_the_operators_and_one_process(tmp_path):
    """des.Options(first_layer="rows") on 5 processes (4 fields: rank 4 owns none; the first Dense's
    kernel is a tail weight, every table's rows go by samples): after 4 of 8 Adam steps
    checkpoint.save and model.save. The saved file is the untouched Keras DeepFM with the 4-step
    weights; the checkpoint resumes on 2 processes with the operators split and on one plain
    process, and after the other 4 steps both equal the uninterrupted single process."""
    name = "keras_deepfm"
    init, batches, probe = _case(name, 8)
    ref_half, ref = (_reference(name, init, batches[:k], probe) for k in (4, 8))
    ckpt = str(tmp_path / "ckpt")

    def first_half(m):
        for x, y in batches[:4]:
            m.train_on_batch(x, y)
        checkpoint.save(ckpt, m, m.optimizer)
        m.save(str(tmp_path / "half.keras"))
        return np.asarray(m.predict_on_batch(probe))

    def second_half(m):
        checkpoint.restore(ckpt, m, m.optimizer)
        for x, y in batches[4:]:
            m.train_on_batch(x, y)
        return np.asarray(m.predict_on_batch(probe))

    def run(n, work, **options):
        world, ranks = _world(n, name, init, **options)
        for m in ranks:
            m.compile(optimizer_for(m, "adam"), "binary_crossentropy")
        return _on_every_rank(world, lambda r: work(ranks[r]))
    world, ranks = _world(5, name, init, first_layer="rows", tail="data_parallel")
    ops = des.distributed(ranks[0]).layer.ops
    assert ops and all(type(op).__name__ == "FieldRowsSubOp" and op.exchange == "samples" for op in ops)
    for m in ranks:
        m.compile(optimizer_for(m, "adam"), "binary_crossentropy")
    half = _on_every_rank(world, lambda r: first_half(ranks[r]))
    assert max(np.abs(p - ref_half).max() for p in half) < 2e-6
    saved = tf.keras.models.load_model(str(tmp_path / "half.keras"), compile=False)
    assert not any("des" in type(layer).__module__ for layer in saved.submodules)
    assert np.abs(saved.predict_on_batch(probe) - half[0]).max() <= 1e-6
    got = run(2, second_half)
    one = BUILDERS[name]()
    copy_state(init, one)
    des.make_keyed(one, seed=0)
    one.compile(optimizer_for(one, "adam"), "binary_crossentropy")
    got.append(second_half(one))
    assert np.abs(got[-1] - got[0]).max() < 2e-6
    assert max(np.abs(p - ref).max() for p in got) < 2e-6


@pytest.mark.parametrize("tables", [{}, {"tables": "joined"}])
def test_export_of_a_tfra_model_serves_what_des_predicts(tmp_path, tables):
    """Per-field TFRA tables, and the same joined into one table a process (the export reads
    the rows the model declares, wherever they live)."""
    init, batches, probe = _case("tfra_deepfm")
    world, ranks = _world(2, "tfra_deepfm", init, **tables)

    def work(r):
        m = ranks[r]
        m.compile(optimizer_for(m, "adam"), "binary_crossentropy")
        for x, y in batches:
            m.train_on_batch(x, y)
        return des.export(m, str(tmp_path / "served")), np.asarray(m.predict_on_batch(probe))
    (info, pred), (other, _) = _on_every_rank(world, work)
    assert other is None and info["rows"] > 0
    sig = tf.saved_model.load(str(tmp_path / "served")).signatures["serving_default"]
    got = sig(**{k: tf.constant(probe[k]) for k in sig.structured_input_signature[1]})
    assert np.abs(list(got.values())[0].numpy().reshape(pred.shape) - pred).max() <= 1e-6


def test_a_checkpoint_of_another_architecture_is_one_line_naming_the_piece(tmp_path):
    spec = models.spec.FeatureSpec((models.spec.Field("a", dim=4), models.spec.Field("b", dim=4)))
    small, wide = models.deepfm(spec, hidden=(8,)), models.deepfm(spec, hidden=(16,))
    small.compile(tf.keras.optimizers.Adam(), "binary_crossentropy")
    checkpoint.save(str(tmp_path / "c"), small, small.optimizer)
    with pytest.raises(CheckpointError) as e:
        checkpoint.restore(str(tmp_path / "c"), wide)
    assert "\n" not in str(e.value) and "dnn_0/kernel" in str(e.value) and "in this model" in str(e.value), str(e.value)


@pytest.mark.parametrize("name", ["subclassed_wdl", "tfrs_ranking"])
def test_a_subclassed_model_saves_as_its_own_class(tmp_path, name):
    """A subclassed Wide & Deep and TFRS's ranking model, transformed in place on 2 simulated
    processes: model.save writes the user's class with its own call and every trained weight,
    and the object goes on training as the DES model afterwards."""
    import subclassed_models as S
    tf.keras.utils.set_random_seed(0)
    batches, probe = S.batches_for(name, 4, 32, seed=3), S.probe_of(name)
    ref = S.BUILDERS[name]()
    ref(probe)
    world, ranks = InProcessWorld(2), []
    for r in range(2):
        m = S.BUILDERS[name]()
        m(probe)
        if r == 0:
            m.set_weights(ref.get_weights())
        ranks.append(des.transform(m, comm=world.communicator(r))[0])
    want = S.train(name, ref, batches, probe)["predictions"]

    def work(r):
        got = S.train(name, ranks[r], batches, probe)["predictions"]
        ranks[r].save(str(tmp_path / "saved"))
        des.export(ranks[r], str(tmp_path / "served"))
        again = S.train(name, ranks[r], batches[:1], probe)["predictions"]      # still the DES model
        return got, again
    (got, again), _ = _on_every_rank(world, work)
    assert np.abs(got - want).max() < 2e-6
    loaded = tf.keras.models.load_model(str(tmp_path / "saved"), compile=False)
    assert type(loaded).__name__ == type(ref).__name__
    assert np.abs(np.asarray(loaded.predict_on_batch(probe)) - got).max() <= 1e-6
    sig = tf.saved_model.load(str(tmp_path / "served")).signatures["serving_default"]
    served = sig(**{k: probe[k] for k in sig.structured_input_signature[1]})      # the features call() reads
    assert np.abs(list(served.values())[0].numpy().reshape(got.shape) - got).max() <= 1e-6
    S.train(name, ref, batches[:1], probe)
    assert np.abs(again - np.asarray(ref.predict_on_batch(probe))).max() < 2e-6


def test_des_export_of_a_checkpoint_of_a_users_model_says_what_to_do(tmp_path):
    from des.runtime import export
    model = BUILDERS["keras_deepfm"]()
    model.compile(tf.keras.optimizers.Adam(), "binary_crossentropy")
    checkpoint.save(str(tmp_path / "c"), model, model.optimizer)
    with pytest.raises(CheckpointError, match=r"a checkpoint of your own model .* des.export\(model, out\)"):
        export.export(str(tmp_path / "c"), str(tmp_path / "served"))
    assert export.main(["--checkpoint", str(tmp_path / "c"), "--out", str(tmp_path / "served")]) == 2
    assert not os.path.exists(tmp_path / "served")


def test_a_model_of_towers_refuses_a_whole_save_in_one_line_and_its_towers_save(tmp_path):
    """TFRS retrieval: des.transform rewrites the towers one by one. A save of the whole is one
    line naming them (not a traceback from inside the SavedModel writer); each tower saves."""
    import subclassed_models as S
    batches = S.batches_for("tfrs_retrieval", 2, 16)
    model, report = des.transform(S.BUILDERS["tfrs_retrieval"](), sample=batches[0])
    assert report.changed
    S.train("tfrs_retrieval", model, batches, S.probe_of("tfrs_retrieval"))
    with pytest.raises(SaveError, match=r"rewrote its towers one by one \(candidate_model, query_model\)"):
        model.save(str(tmp_path / "whole"))
    assert not os.path.exists(tmp_path / "whole")
    probe = S.probe_of("tfrs_retrieval")["movie_id"]
    model.candidate_model.save(str(tmp_path / "candidate"))
    again = tf.keras.models.load_model(str(tmp_path / "candidate"), compile=False)
    assert np.abs(again.predict_on_batch(probe) - model.candidate_model.predict_on_batch(probe)).max() <= 1e-6


def test_an_optimizer_whose_slots_cannot_be_read_is_one_line_and_nothing_is_written(tmp_path):
    class Handmade:                              # neither Keras's legacy slots nor variables to read
        iterations = tf.Variable(0, dtype=tf.int64)
    model = BUILDERS["keras_deepfm"]()
    with pytest.raises(ValueError, match=r"^optimizer Handmade: its slots cannot be read") as e:
        checkpoint.save(str(tmp_path / "c"), model, Handmade())
    assert "\n" not in str(e.value) and not os.path.exists(tmp_path / "c")


def test_a_subclassed_models_checkpoint_resumes_on_3_processes_and_one(tmp_path):
    """A subclassed Wide & Deep: a checkpoint after 2 of 4 steps on 2 simulated processes,
    restored on 3 and into the plain model on one, trains on as the uninterrupted model."""
    import subclassed_models as S
    tf.keras.utils.set_random_seed(0)
    batches, probe = S.batches_for("subclassed_wdl", 4, 32, seed=3), S.probe_of("subclassed_wdl")
    init = S.WideAndDeep()
    init(probe)

    def fresh():
        m = S.WideAndDeep()
        m(probe)
        m.set_weights(init.get_weights())
        return m

    def steps(m, part):
        for x, y in part:
            m.train_on_batch(x, y)
        return np.asarray(m.predict_on_batch(probe))
    ref = fresh()
    ref.compile(tf.keras.optimizers.Adam(0.02), "binary_crossentropy")
    want = steps(ref, batches)

    def world(n, work):
        w = InProcessWorld(n)
        ms = [des.transform(fresh(), comm=w.communicator(r))[0] for r in range(n)]
        for m in ms:
            m.compile(tf.keras.optimizers.Adam(0.02), "binary_crossentropy")
        return _on_every_rank(w, lambda r: work(ms[r]))
    ckpt = str(tmp_path / "ckpt")
    world(2, lambda m: (steps(m, batches[:2]), checkpoint.save(ckpt, m, m.optimizer)))

    def resume(m):
        checkpoint.restore(ckpt, m, m.optimizer)
        return steps(m, batches[2:])
    got = world(3, resume)
    one = fresh()
    one.compile(tf.keras.optimizers.Adam(0.02), "binary_crossentropy")
    got.append(resume(one))
    assert max(np.abs(p - want).max() for p in got) < 2e-6


def test_a_write_that_fails_on_rank_0_is_the_same_error_on_every_process(tmp_path):
    """Rank 0 cannot write (the folder is a file): every process gets one line naming rank 0,
    the path and Keras's error, instead of the others going on into a collective alone."""
    init, _, _ = _case("keras_deepfm", 1)
    world, ranks = _world(3, "keras_deepfm", init)
    (tmp_path / "file").write_text("not a folder")
    path = str(tmp_path / "file" / "m.h5")
    errors = []

    def work(r):
        try:
            ranks[r].save(path)
        except SaveError as e:
            errors.append(str(e))
    _on_every_rank(world, work)
    assert len(errors) == 3 and len(set(errors)) == 1 and "\n" not in errors[0], errors
    assert errors[0].startswith(f"model.save: rank 0 could not write {path!r}: "), errors[0]

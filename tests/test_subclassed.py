"""Subclassed models (TensorFlow Recommenders' ranking model, a subclassed Wide & Deep): their
call() is traced on symbolic inputs, the graph it gives is rewritten, and the user's own model
object comes back, trained with its own compile/fit (TFRS: its compute_loss and task). DES on
N = 1..3 simulated processes equals the untouched model on one process. Under mpirun:
tests/test_mpi.py. Negative cases: one-line reasons."""
import numpy as np
import pytest
import tensorflow as tf

import des
from des.jobs.verify import run_in_process_world
from des_ops.comm import LocalCommunicator
from subclassed_models import BUILDERS, EXPECTED, ValueDependent, batches_for, outputs, probe_of, sample_of, train


def _seeded(name):
    def build():
        tf.keras.utils.set_random_seed(7)
        return BUILDERS[name]()
    return build


@pytest.mark.parametrize("name", list(BUILDERS))
def test_subclassed_model_is_traced_substituted_and_equivalent(name):
    build = _seeded(name)
    batches, probe = batches_for(name, 20, 32, seed=4), probe_of(name)
    untrained = outputs(name, build(), probe)
    ref = train(name, build(), batches, probe)
    assert np.abs(ref["predictions"] - untrained).max() > 1e-3                    # training moved them
    model = build()
    new, report = des.transform(model, comm=LocalCommunicator(), sample=sample_of(name, batches))
    assert new is model and type(new) is type(model)                               # the user's own object
    assert sorted(m.rule for m in report.substitutions) == EXPECTED[name], str(report)
    for n in (1, 2, 3):
        ranks = run_in_process_world(n, build, lambda m: train(name, m, batches, probe),
                                     sample=sample_of(name, batches))
        for r in ranks:
            diff = float(np.abs(r["predictions"] - ref["predictions"]).max())
            print(f"{name} N={n}: predictions {diff:.1e}, loss {abs(r['loss'] - ref['loss']):.1e}")
            assert diff < 1e-6 and abs(r["loss"] - ref["loss"]) < 1e-5 * max(1.0, abs(ref["loss"]))   # retrieval: a sum ~100
            np.testing.assert_array_equal(r["predictions"], ranks[0]["predictions"])


def test_tfrs_model_keeps_its_task_and_metrics():
    name = "tfrs_ranking"
    batches = batches_for(name, 3, 16)
    model, _ = des.transform(BUILDERS[name](), comm=LocalCommunicator(), sample=sample_of(name, batches))
    model.compile(tf.keras.optimizers.Adagrad(0.1))
    ds = tf.data.Dataset.from_tensor_slices({k: tf.concat([b[k] for b in batches], 0) for k in batches[0]}).batch(16)
    hist = model.fit(ds, verbose=0).history
    assert {"root_mean_squared_error", "loss"} <= set(hist), hist


def test_negative_python_control_flow_on_values_is_a_one_line_reason():
    model = ValueDependent()
    sample = {"f0": tf.constant([[1], [2]], tf.int64)}
    same, report = des.transform(model, comm=LocalCommunicator(), sample=sample)
    assert same is model and not report.changed
    reason = str(report).splitlines()[1]
    assert reason.startswith("  not read: 'value_dependent") and "its call() could not be traced on symbolic inputs" \
        in reason and "instead of Python control flow on tensor values" in reason, str(report)
    with pytest.raises(des.TransformError, match="could not be traced"):
        des.transform(ValueDependent(), des.Options(strict=True), comm=LocalCommunicator(), sample=sample)


def test_negative_unknown_input_shapes_ask_for_a_sample():
    _, report = des.transform(BUILDERS["subclassed_wdl"](), comm=LocalCommunicator())
    assert "its input shapes are unknown: pass sample=<a batch of its inputs> to des.transform" in str(report)


def test_tfrs_dcn_leaves_no_table_whole():
    """TFRS's DCN: the Cross layer multiplies x0 (every field's embedding) elementwise, so no
    rule splits it by partials; each table still lives with one owner, whose field vector every
    process receives (field rows: 2 x 8 floats a sample). Equivalence: the parametrized test."""
    from subclassed_models import tfrs_dcn
    sample = batches_for("tfrs_dcn", 1, 8)[0]
    model = tfrs_dcn()
    same, report = des.transform(model, comm=LocalCommunicator(), sample={k: v for k, v in sample.items()
                                                                          if k != "rating"})
    widths = [m.vectors[0].width for m in report.substitutions]
    assert same is model and report.unsubstituted == [] and widths == [8, 8] and report.floats_per_sample == 16


def test_towers_take_tail_auto_and_refuse_a_data_parallel_tail():
    """A retrieval model's towers run the replicated tail: tail="auto" transforms them, tail=
    "data_parallel" is refused in one line."""
    name = "tfrs_retrieval"
    sample = sample_of(name, batches_for(name, 1, 8))
    _, report = des.transform(BUILDERS[name](), des.Options(tail="auto"), comm=LocalCommunicator(), sample=sample)
    assert sorted(m.rule for m in report.substitutions) == EXPECTED[name]
    with pytest.raises(ValueError, match="calls its towers in compute_loss; only tail='replicated'"):
        des.transform(BUILDERS[name](), des.Options(tail="data_parallel"), comm=LocalCommunicator(), sample=sample)

"""Bring your own model: the model styles users write (tests/gallery.py) are substituted as
expected and, trained with their own compile/fit for 20 steps, a DES model on N = 1..3
simulated processes equals the untouched model on one process (predictions, table rows,
kernel rows and replicated weights <= 1e-5; the fit metrics too). Negative cases: the report
names why a table or operator was not substituted."""
import numpy as np
import pytest
import tensorflow as tf

import des
import models
from des.compiler import find_substitutions
from des.ir import Graph
from des.verify import compare, copy_state, run_in_process_world, snapshot
from des_ops.comm import LocalCommunicator
from gallery import BUILDERS, EXPECTED, FIELDS, K, V, batches_for

L = tf.keras.layers
TOL = 1e-5


def fit_and_snapshot(model, batches, probe) -> dict:
    """The user's loop: compile with a metric, fit one epoch over ``batches`` in order."""
    model.compile(models.make_optimizer("adam", 0.02), "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(name="auc")])
    xs = {k: tf.concat([x[k] for x, _ in batches], 0) for k in batches[0][0]}
    ys = tf.concat([y for _, y in batches], 0)
    ds = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(int(batches[0][1].shape[0]))
    hist = model.fit(ds, epochs=1, verbose=0, shuffle=False).history
    return {"predictions": np.asarray(model.predict_on_batch(probe)), "auc": hist["auc"][-1],
            "loss": hist["loss"][-1], **snapshot(model)}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_gallery_model_is_substituted_and_equivalent(name):
    build = BUILDERS[name]
    base = build()
    des.make_keyed(base, seed=0)                   # TFRA tables: rows from (table, key, seed), as DES makes them
    matches, rejections = find_substitutions(Graph(base))
    assert sorted(m.rule for m in matches) == EXPECTED[name], [str(r) for r in rejections]
    batches = batches_for(base, 20, 32, seed=4)
    probe = batches_for(base, 1, 16, seed=99)[0][0]
    reference = build()
    copy_state(base, reference)
    des.make_keyed(reference, seed=0)
    ref = fit_and_snapshot(reference, batches, probe)
    assert np.ptp(ref["predictions"]) > 1e-3                                  # training moved them
    for n in (1, 2, 3):
        # rank 0 starts from base's weights, the other ranks from their own random ones: the
        # transform's broadcast must give every rank rank 0's weights
        ranks = run_in_process_world(n, build, lambda m: fit_and_snapshot(m, batches, probe), init_from=base)
        diff = compare(ref, ranks)
        for r in ranks:
            diff["auc"] = max(diff.get("auc", 0.0), abs(r["auc"] - ref["auc"]))
            diff["loss"] = max(diff.get("loss", 0.0), abs(r["loss"] - ref["loss"]))
        print(f"{name} N={n}: {diff}")
        assert max(diff.values()) < TOL, (n, diff)


def test_transform_report_lists_every_table_and_strict_mode():
    model = BUILDERS["deepctr_deepfm"]()
    new, report = des.transform(model, comm=LocalCommunicator(), strict=True)
    text = str(report)
    assert "3 substitution(s)" in text and "tables:" in text
    for f in FIELDS:       # the embedding and the linear weight of every field
        assert f"sparse_emb_{f} (Keras Embedding, width {K}, field '{f}'): substituted in" in text
        assert f"linear0sparse_emb_{f} (Keras Embedding, width 1, field '{f}'): substituted in lr_sum" in text


def _inputs():
    return {f: tf.keras.Input(shape=(), dtype=tf.int64, name=f) for f in FIELDS}


def _report(model):
    _, report = des.transform(model, comm=LocalCommunicator())
    with pytest.raises(des.TransformError):
        des.transform(model, comm=LocalCommunicator(), strict=True)
    return str(report)


def test_negative_table_also_read_by_a_layer_that_is_not_substituted():
    x = _inputs()
    e = [L.Embedding(V, K, name=f"emb_{f}")(x[f]) for f in FIELDS]
    side = L.Dense(1, name="side")(L.Multiply(name="cross")([e[0], e[1]]))     # no rule for f0 * f1
    model = tf.keras.Model(x, L.Dense(1)(L.Concatenate()(e)) + side)
    text = _report(model)
    assert "tables are also read by layers that are not substituted: 'emb_f0' (field 'f0') by 'cross'" in text
    assert "emb_f0 (Keras Embedding, width 4, field 'f0'): NOT substituted" in text


def test_negative_fm_over_different_widths():
    x = _inputs()
    e = tf.stack([L.Embedding(V, 4 if f != "f3" else 3)(x[f]) for f in FIELDS[:3]] +
                 [L.Embedding(V, 4)(x["f3"])], axis=1)
    s = tf.reduce_sum(e, axis=1)
    fm = 0.5 * tf.reduce_sum(s * s - tf.reduce_sum(e * e, axis=1), axis=1, keepdims=True)
    model = tf.keras.Model(x, tf.sigmoid(fm))
    assert rules_and_reasons(model)[0] == []
    x = _inputs()
    vs = [L.Embedding(V, 4)(x[f]) for f in FIELDS[:2]] + [L.Embedding(V, 3)(x[f]) for f in FIELDS[2:]]
    e = L.Concatenate(axis=1)([L.Reshape((1, -1))(v) for v in vs])       # cannot concatenate [.,1,4] and [.,1,3]
    assert e is not None


def rules_and_reasons(model):
    matches, rejections = find_substitutions(Graph(model))
    return sorted(m.rule for m in matches), [str(r) for r in rejections]


def test_negative_fm_layer_over_fields_of_different_widths_names_the_widths():
    class MyFM(L.Layer):
        des_substitute = "fm_interaction"

        def call(self, e):
            s = tf.reduce_sum(e, axis=1)
            return 0.5 * tf.reduce_sum(s * s - tf.reduce_sum(e * e, axis=1), axis=1, keepdims=True)

    x = _inputs()
    e = L.Concatenate(axis=1)([L.Reshape((1, 4))(L.Embedding(V, 4)(x["f0"])),
                               L.Reshape((1, 4))(L.Dense(4)(L.Embedding(V, 2)(x["f1"])))])
    model = tf.keras.Model(x, tf.sigmoid(MyFM(name="my_fm")(e)))
    rules, why = rules_and_reasons(model)
    assert rules == ["fm_interaction"] and why == []          # a per-field Dense is part of f1's chain
    x = _inputs()
    e = tf.stack([L.Embedding(V, 4)(x["f0"]), L.Embedding(V, 4)(x["f1"])], axis=1)
    mixed = L.Concatenate(axis=-1)([e, tf.stack([L.Embedding(V, 2)(x["f2"]), L.Embedding(V, 2)(x["f3"])], 1)])
    model = tf.keras.Model(x, tf.sigmoid(MyFM(name="my_fm")(mixed)))
    text = _report(model)
    assert "fm_interaction at 'my_fm'" in text and "not substituted" in text


def test_negative_nonlinear_op_between_lookups_and_the_sum():
    x = _inputs()
    w = L.Concatenate()([L.Embedding(V, 1)(x[f]) for f in FIELDS])           # [B, F]
    model = tf.keras.Model(x, tf.sigmoid(tf.reduce_sum(tf.nn.relu(w), axis=1, keepdims=True)))
    text = _report(model)
    assert "NOT substituted: its field vector reaches 'concatenate" in text or "tf.nn.relu" in text, text


def test_transformed_model_keeps_rank0_weights_and_trained_values():
    """A model that was already trained keeps its weights: DES predictions equal the trained model's."""
    build = BUILDERS["deepctr_deepfm"]
    trained = build()
    batches = batches_for(trained, 5, 32, seed=1)
    fit_and_snapshot(trained, batches, batches[0][0])
    expected = trained.predict_on_batch(batches[0][0])
    preds = run_in_process_world(2, build, lambda m: m.predict_on_batch(batches[0][0]), init_from=trained)
    for p in preds:
        np.testing.assert_allclose(p, expected, atol=1e-6)

"""Reference models: key-deterministic tables, training to a real AUC, checkpoint round trip."""

import numpy as np
import pytest
import tensorflow as tf

import models
from des.runtime import checkpoint
from des.data import criteo_spec
from des.data.readers import make_dataset
from des.data.synth import write_criteo
from des.compiler.fusion import fuse_model
from models.layers import FieldEmbedding, key_init


def rows(layer):
    keys, values = layer.params.export()
    return dict(zip(keys.numpy().tolist(), values.numpy().tolist()))


def test_row_init_depends_only_on_field_key_and_seed():
    a = FieldEmbedding("C1", 4, seed=7)
    b = FieldEmbedding("C1", 4, seed=7)
    keys = tf.constant([5, 17, 2**62, -3, 99], tf.int64)
    a(keys, training=True)
    for chunk in ([99, -3], [2**62], [17, 5, 5]):          # other order, other batches
        b(tf.constant(chunk, tf.int64), training=True)
    assert rows(a) == rows(b) and len(rows(a)) == 5
    v = np.array(list(rows(a).values()))
    assert np.all(np.abs(v) <= 0.05) and np.std(v) > 0.01
    other_field = FieldEmbedding("C2", 4, seed=7)(keys, training=True).numpy()
    other_seed = FieldEmbedding("C1", 4, seed=8)(keys, training=True).numpy()
    assert not np.allclose(other_field, a(keys).numpy()) and not np.allclose(other_seed, a(keys).numpy())


def test_inference_does_not_insert_but_reads_the_same_init():
    a = FieldEmbedding("C1", 3, seed=1)
    unseen = a(tf.constant([11, 12], tf.int64), training=False).numpy()
    assert int(a.params.size()) == 0
    trained = a(tf.constant([11, 12], tf.int64), training=True).numpy()
    assert int(a.params.size()) == 2 and np.array_equal(unseen, trained)


def test_multi_valued_field_sum_pools_and_ignores_padding():
    a = FieldEmbedding("tags", 2, seed=1)
    pooled = a(tf.constant([[1, 2, -1], [2, -1, -1]], tf.int64), training=True).numpy()
    single = a(tf.constant([1, 2], tf.int64), training=True).numpy()
    assert np.allclose(pooled[0], single[0] + single[1]) and np.allclose(pooled[1], single[1])


def test_one_sgd_step_moves_each_row_by_its_summed_gradient():
    """A training call reads a held row as the table holds it and a new key's row from key_init
    (one table read a step, tests/test_fused.py: the same for fused tables); the optimizer then
    moves each row by the sum of its gradients."""
    a = FieldEmbedding("C1", 3, seed=2)
    a(tf.constant([4], tf.int64), training=True)                         # key 4 held, key 9 new
    a.params.upsert(tf.constant([4], tf.int64), tf.constant([[1.0, 2.0, 3.0]]))
    start9 = key_init(tf.constant([9], tf.int64), a.salt, 3, 0.05).numpy()[0]
    optimizer = models.make_optimizer("sgd", 0.5)
    with tf.GradientTape() as tape:
        out = a(tf.constant([4, 9, 4], tf.int64), training=True)
        loss = tf.reduce_sum(out * tf.constant([[1.0, 0, 0], [0, 1, 0], [0, 0, 2]]))
    assert np.array_equal(out.numpy(), [[1, 2, 3], start9, [1, 2, 3]])   # the held row as the table holds it
    optimizer.apply_gradients(zip(tape.gradient(loss, a.trainable_weights), a.trainable_weights))
    keys, values = a.params.export()
    got = dict(zip(keys.numpy().tolist(), values.numpy().tolist()))
    assert np.allclose(got[4], [0.5, 2.0, 2.0]) and np.allclose(got[9], start9 - [0, 0.5, 0])


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("data") / "train.txt")
    meta = write_criteo(path, 60_000, "criteo-like", seed=11, quiet=True)
    return path, meta


@pytest.mark.parametrize("name", ["lr", "fm", "dnn", "wdl", "deepfm"])
def test_each_model_learns(data, name):
    """Each model, as des.train --mode single trains it (its tables of one width in one TFRA table:
    the same function, tests/test_fused.py, and one lookup per width a step instead of 39), reaches
    a real AUC on held-out criteo-like data, and none beats the Bayes-optimal one."""
    path, meta = data
    spec = criteo_spec(dim=4)
    model, _ = fuse_model(models.build(name, spec, seed=1, hidden=(32, 16)))
    model.compile(models.make_optimizer("adam", 0.005), "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(num_thresholds=5000, name="auc")])
    train = make_dataset(path, "criteo", spec, 512, take_lines=50_000, shuffle_buffer=10_000, seed=1)
    model.fit(train, epochs=1, verbose=0)
    auc = model.evaluate(make_dataset(path, "criteo", spec, 4096, skip_lines=50_000),
                         verbose=0, return_dict=True)["auc"]
    print(f"{name}: AUC {auc:.4f}, Bayes-optimal {meta['bayes_auc']:.4f}")
    assert 0.62 < auc <= meta["bayes_auc"] + 0.01


@pytest.mark.parametrize("optimizer", ["adagrad", "ftrl", "sgd"])
def test_tfra_optimizers_update_table_rows_as_dense_keras_would(optimizer):
    """One train step: in every table the rows of the batch's ids move exactly as the same Keras
    optimizer moves a dense variable holding them, given the same gradient; no other row moves."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    spec = type(criteo_spec())(criteo_spec(dim=2).fields[:4])
    model = models.build("wdl", spec, seed=0, hidden=(8,))
    model.compile(models.make_optimizer(optimizer, 0.1), "binary_crossentropy")
    x = {f.name: tf.constant([1, 2, 3], tf.int64) for f in spec}
    y = tf.constant([1.0, 0.0, 1.0])
    model(x)
    tables = [l for l in model.layers if isinstance(l, FieldEmbedding)]
    ids = tf.constant([[1], [2], [3]], tf.int64)
    before = {t.name: dict(zip((1, 2, 3), t(ids).numpy().reshape(3, -1).tolist())) for t in tables}
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.binary_crossentropy(y[:, None], model(x, training=True)))
    wrappers = [v for v in model.trainable_variables if isinstance(v, de.TrainableWrapper)]
    grads = {id(w.params): g for w, g in zip(wrappers, tape.gradient(loss, wrappers))}
    model.train_on_batch(x, y)
    checked = 0
    for t in tables:
        after, old = rows(t), before[t.name]
        assert sorted(after) == [1, 2, 3]                # only the batch's rows were written
        g = grads[id(t.params)]
        dense = tf.Variable([old[k] for k in (1, 2, 3)], dtype=tf.float32)
        expected_grad = tf.math.unsorted_segment_sum(g.values, g.indices, 3)
        models.make_optimizer(optimizer, 0.1).apply_gradients([(expected_grad, dense)])
        np.testing.assert_allclose([after[k] for k in (1, 2, 3)], dense.numpy(), rtol=1e-5, atol=1e-7)
        assert not np.allclose([after[k] for k in (1, 2, 3)], [old[k] for k in (1, 2, 3)])
        checked += 1
    assert checked == 8                                 # 4 fields x (linear + embedding) tables


@pytest.mark.parametrize("name", ["fm", "wdl", "deepfm"])
def test_ftrl_on_the_linear_part_adam_on_the_rest(name):
    """After one step from the same start, the linear part's rows equal an all-FTRL model's and
    every other weight equals an all-Adam model's (the gradients are the same in all three)."""
    from des.jobs.verify import random_batches, small_spec, snapshot
    from models.optim import is_linear
    spec = small_spec(3, dim=4)
    x, y = random_batches(spec, 1, 16, seed=1)[0]

    def one_step(opt):
        m = models.build(name, spec, seed=3, hidden=(4,))
        m.compile(opt, "binary_crossentropy")
        m.train_on_batch(x, y)
        return m, snapshot(m)
    _, ftrl = one_step(models.make_optimizer("ftrl", 0.05))
    _, adam = one_step(models.make_optimizer("adam", 0.01))
    split_model, split = one_step(models.make_optimizer("adam", 0.01, linear="ftrl", linear_learning_rate=0.05))
    linear_names = [v.name for v in split_model.trainable_variables if is_linear(v)]
    assert len([n for n in linear_names if "emb1_" in n]) == 3
    assert any("bias/b" in n for n in linear_names) == (name != "wdl")
    for key, rows in split["tables"].items():
        dim = len(next(iter(rows.values())))
        same, other = (ftrl, adam) if dim == 1 else (adam, ftrl)
        for k, row in rows.items():
            np.testing.assert_array_equal(row, same["tables"][key][k])
        assert max(np.abs(r - other["tables"][key][k]).max() for k, r in rows.items()) > 1e-4
    for k, w in split["weights"].items():
        np.testing.assert_array_equal(w, (ftrl if ":Bias/" in k else adam)["weights"][k])


def test_a_second_model_built_in_one_process_restores_its_rows(tmp_path):
    """TFRA names the tables of a second model built in a process differently; checkpoints key
    rows by their place in the graph, so it restores the first model's rows all the same."""
    from des.jobs.verify import random_batches, small_spec
    spec = small_spec(2, dim=3)
    x, y = random_batches(spec, 1, 16, seed=1)[0]
    a = models.build("fm", spec, seed=3)
    a.compile(models.make_optimizer("adam", 0.01), "binary_crossentropy")
    a.train_on_batch(x, y)
    checkpoint.save(str(tmp_path), a, a.optimizer)
    b = models.build("fm", spec, seed=3)
    assert np.abs(b.predict_on_batch(x) - a.predict_on_batch(x)).max() > 1e-4
    checkpoint.restore(str(tmp_path), b)
    np.testing.assert_array_equal(b.predict_on_batch(x), a.predict_on_batch(x))

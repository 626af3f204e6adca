"""Rewrite rules: what fires, what must not fire (and why), the plan and the report."""
import numpy as np
import pytest
import tensorflow as tf

import des
import models
from des.compiler import find_substitutions
from des.graph.ir import Graph
from des.compiler.plan import FieldCost, make_plan
from des_ops.comm import InProcessWorld, LocalCommunicator
from helpers import random_batches, small_spec
from models.layers import Bias, FieldEmbedding
from models.zoo import inputs_for

L = tf.keras.layers
SPEC = small_spec(4, dim=3)


def embs(x, dim=3):
    return [FieldEmbedding(f.name, dim, seed=0)(x[f.name]) for f in SPEC]


def rules_of(model):
    matches, rejections = find_substitutions(Graph(model))
    return sorted(m.rule for m in matches), [str(r) for r in rejections]


def user_fm_tf_ops(extra_use=False):
    """FM as a user writes it with tf ops, E built by Concatenate(Reshape(...))."""
    x = inputs_for(SPEC)
    e = tf.keras.layers.Concatenate(axis=1)([L.Reshape((1, 3))(v) for v in embs(x)])
    sum_sq = tf.square(tf.reduce_sum(e, axis=1))
    sq_sum = tf.reduce_sum(tf.square(e), axis=1)
    fm = 0.5 * tf.reduce_sum(sum_sq - sq_sum, axis=1, keepdims=True)
    logit = fm + L.Dense(1)(sum_sq) if extra_use else fm
    return tf.keras.Model(x, L.Activation("sigmoid")(Bias()(logit)))


def test_user_fm_with_tf_ops_is_matched_and_equivalent():
    model = user_fm_tf_ops()
    assert rules_of(model) == (["fm_interaction"], [])
    x, _ = random_batches(SPEC, 1, 16)[0]
    new, report = des.transform(model, comm=LocalCommunicator())
    assert report.floats_per_sample == 4 and "fm_interaction" in str(report)
    np.testing.assert_allclose(new.predict_on_batch(x), model.predict_on_batch(x), atol=1e-6)


def test_fm_not_substituted_when_an_intermediate_is_used_elsewhere():
    rules, why = rules_of(user_fm_tf_ops(extra_use=True))
    assert "fm_interaction" not in rules and set(rules) <= {"field_rows", "lr_sum"}    # the tables: by field rows
    assert any("fm_interaction" in w and "is also used by" in w for w in why)


def test_dense_not_substituted_when_a_field_embedding_feeds_another_layer():
    x = inputs_for(SPEC)
    e = embs(x)
    h = L.Dense(4, name="first")(L.Concatenate()(e))
    side = L.Dense(4)(L.Multiply(name="side")([e[2], e[3]]))   # f2 x f3: no rule for it
    model = tf.keras.Model(x, L.Dense(1)(L.Add()([h, side])))
    rules, why = rules_of(model)
    assert rules == ["field_rows"] * len(SPEC) and any("field 'f2'" in w and "'side'" in w for w in why)
    new, report = des.transform(model, comm=LocalCommunicator())     # no partials for 'first': field rows
    assert "(FieldEmbedding, width 3, field 'f2'): substituted in field_rows" in str(report)
    xb, _ = random_batches(SPEC, 1, 8)[0]
    np.testing.assert_allclose(new.predict_on_batch(xb), model.predict_on_batch(xb), atol=1e-6)


def test_dense_over_embeddings_and_a_numeric_input_keeps_its_rows_replicated():
    x = inputs_for(SPEC)
    num = tf.keras.Input(shape=(2,), name="num")
    model = tf.keras.Model({**x, "num": num}, L.Dense(2, activation="relu")(L.Concatenate()(embs(x) + [num])))
    assert rules_of(model) == (["embed_concat_dense"], [])
    new, report = des.transform(model, comm=LocalCommunicator())
    assert "1 replicated input(s)" in str(report) and report.floats_per_sample == 2
    xb, _ = random_batches(SPEC, 1, 8)[0]
    xb["num"] = tf.random.uniform([8, 2])
    np.testing.assert_allclose(new.predict_on_batch(xb), model.predict_on_batch(xb), atol=1e-6)


def test_model_with_nothing_to_rewrite_comes_back_unchanged():
    x = tf.keras.Input(shape=(3,), name="num")
    model = tf.keras.Model(x, L.Dense(1, activation="sigmoid")(L.Dense(4)(x)))
    new, report = des.transform(model, comm=LocalCommunicator())
    assert new is model and report.substitutions == [] and report.rejections == [] and report.tables == []
    with pytest.raises(des.TransformError, match="nothing to substitute"):
        des.transform(model, des.Options(strict=True), comm=LocalCommunicator())


def test_linear_sum_as_reduce_sum_of_concat():
    x = inputs_for(SPEC)
    w = [FieldEmbedding(f.name, 1, seed=0, init_scale=0.01)(x[f.name]) for f in SPEC]
    s = tf.reduce_sum(L.Concatenate(axis=1)(w), axis=1, keepdims=True)
    model = tf.keras.Model(x, L.Activation("sigmoid")(s))
    assert rules_of(model) == (["lr_sum"], [])
    xb, _ = random_batches(SPEC, 1, 8)[0]
    new, _ = des.transform(model, comm=LocalCommunicator())
    np.testing.assert_allclose(new.predict_on_batch(xb), model.predict_on_batch(xb), atol=1e-7)


def test_a_per_field_layer_before_the_sum_moves_to_the_field_owner():
    x = inputs_for(SPEC)
    w = [FieldEmbedding(f.name, 1, seed=0, init_scale=0.1)(x[f.name]) for f in SPEC]
    w[1] = L.Dense(1, name="per_field")(w[1])         # depends on field f1 only: part of its chain
    model = tf.keras.Model(x, L.Add()(w))
    assert rules_of(model) == (["lr_sum"], [])
    new, _ = des.transform(model, comm=LocalCommunicator())
    assert any(l.name == "per_field" for l in des.distributed(new).layer.owned)
    xb, _ = random_batches(SPEC, 1, 8)[0]
    np.testing.assert_allclose(new.predict_on_batch(xb), model.predict_on_batch(xb), atol=1e-6)


def test_an_op_mixing_fields_before_the_sum_does_not_fire_and_the_report_says_where():
    x = inputs_for(SPEC)
    w = [FieldEmbedding(f.name, 1, seed=0)(x[f.name]) for f in SPEC]
    soft = tf.nn.softmax(L.Concatenate(axis=1)(w), axis=1)       # non-linear across fields
    model = tf.keras.Model(x, tf.reduce_sum(soft, axis=1, keepdims=True))
    assert rules_of(model) == (["field_rows"] * len(SPEC), [])        # no linear sum: softmax comes first
    _, report = des.transform(model, comm=LocalCommunicator())
    assert "lr_sum" not in str(report) and "NOT substituted" not in str(report), str(report)


def test_deepfm_keeps_one_table_per_field_shared_by_fm_and_dnn():
    model = models.build("deepfm", SPEC, seed=0, hidden=(8,))
    _, fused = des.transform(models.build("deepfm", SPEC, seed=0, hidden=(8,)), comm=LocalCommunicator())
    assert fused.table_layout == "fused" and "fused table des_fused3_rank0" in str(fused)     # the default, uncompiled
    compiled = models.build("deepfm", SPEC, seed=0, hidden=(8,))
    compiled.compile(tf.keras.optimizers.Adam(), "binary_crossentropy")
    _, joined = des.transform(compiled, comm=LocalCommunicator())
    assert joined.table_layout == "joined" and "fused table des_fused4_joined_rank0" in str(joined)   # one optimizer
    new, report = des.transform(model, des.Options(tables="per-field"), comm=LocalCommunicator())
    assert sorted(m.rule for m in report.substitutions) == ["embed_concat_dense", "fm_interaction", "lr_sum"]
    tables = [l for l in des.distributed(new).layer.owned if getattr(l, "des_embedding", False)]
    assert len(tables) == 2 * len(SPEC)               # one 1-wide and one 3-wide table per field
    assert len({id(t) for t in tables}) == len(tables)
    assert report.floats_per_sample == 1 + (3 + 1) + 8


def test_plans():
    fields = [FieldCost(f"f{i}", rows=r, width=9) for i, r in enumerate([1e6, 10, 10, 10, 5e5, 10])]
    mod = make_plan(fields, 4, "mod")
    assert [mod.owner[f"f{i}"] for i in range(6)] == [0, 1, 2, 3, 0, 1]
    bal = make_plan(fields, 2, "balanced")
    assert bal.owner["f0"] != bal.owner["f4"]         # the two big fields are split
    idle = make_plan(fields[:2], 5, "balanced")
    assert sorted(idle.owner.values()) == [0, 1] and idle.fields_of(4) == []
    assert "contributes zeros" in str(idle)
    assert type(bal).from_json(bal.to_json()) == bal
    with pytest.raises(ValueError):
        make_plan(fields, 2, "random")


def test_tfra_tables_are_balanced_by_their_distinct_ids_in_the_sample():
    """A TFRA table starts empty, so without a batch every field costs the same and the balanced
    plan deals the fields out in order: here f0 and f2, the fields with many distinct ids, both
    land on rank 0. With ``sample=`` a global batch, each field's distinct ids in it are its rows:
    the two big fields go to different processes, and every process agrees on the plan. The report
    says when fields went unsized, and how to size them."""
    from gallery import BUILDERS, batches_for
    from des.jobs.verify import _on_every_rank
    x = {k: np.asarray(v) for k, v in batches_for(BUILDERS["tfra_deepfm"](), 1, 256, seed=0)[0][0].items()}
    many = np.arange(256, dtype=np.int64).reshape(x["f0"].shape)
    sample = {**x, "f0": many, "f2": many + 1000, "f1": x["f1"] % 2, "f3": x["f3"] % 2}
    world = InProcessWorld(2)
    for given, big_apart in ((None, False), (sample, True)):
        reports = [rep for _, rep in _on_every_rank(world, lambda r: des.transform(
            BUILDERS["tfra_deepfm"](), des.Options(tail="replicated"), comm=world.communicator(r), sample=given))]
        owner = reports[0].plan.owner
        assert all(rep.plan.owner == owner for rep in reports)
        assert (owner["f0"] != owner["f2"]) == big_apart, owner
        assert sorted(owner.values()) == [0, 0, 1, 1], owner
        note = "the plan could not size 4 field(s) (f0, f1, f2, f3): their tables are empty and no sample= batch"
        assert all((note in str(rep)) == (given is None) for rep in reports), str(reports[0])


class HalfEmbedding(FieldEmbedding):
    """A table whose output is float16: DES supports float32 partials only."""

    def call(self, ids, training=None):
        return tf.cast(super().call(ids, training=training), tf.float16)


def test_unsupported_dtype_is_rejected():
    x = inputs_for(SPEC)
    e = [HalfEmbedding(f.name, 3, seed=0)(x[f.name]) for f in SPEC]
    model = tf.keras.Model(x, L.Dense(1)(L.Concatenate()(e)))
    rules, why = rules_of(model)
    assert rules == [] and any("dtype float16" in w for w in why)


def test_the_transformed_model_carries_no_attributes_stuck_onto_it():
    """What des.transform made (plan, DES layer, state keys, tail) is the handle des.distributed
    returns, kept beside the model; the Keras object gets no des_* attributes from outside."""
    from des.data import FeatureSpec, Field
    spec = FeatureSpec((Field("a", dim=2), Field("b", dim=2), Field("c", dim=2)))
    plain = models.deepfm(spec, hidden=(4,))
    before = set(vars(plain))
    new, _ = des.transform(models.deepfm(spec, hidden=(4,)), comm=InProcessWorld(1).communicator(0))
    handle = des.distributed(new)
    assert handle.plan.owner == {"a": 0, "b": 0, "c": 0} and handle.tail == "replicated"
    assert handle.layer in new.layers and handle.comm is handle.layer.comm
    assert {k for k in vars(new) if k.startswith("des")} == set() == {k for k in before if k.startswith("des")}
    assert des.distributed(plain) is None

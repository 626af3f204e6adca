"""Model styles a user would write, as builders for the bring-your-own-model tests.

Each builder returns a fresh, untrained tf.keras model over 4 categorical fields with ids in
[1, V) (0 is padding for multi-hot fields). ``EXPECTED[name]`` lists the substitutions
des.transform must make. ``batches_for(model, ...)`` makes data for any of them from the
model's own inputs (ids, strings, floats), so the tests and the mpirun script share it.

    >>> model = BUILDERS["keras_deepfm"]()
    >>> batches = batches_for(model, steps=20, batch=32, seed=4)
"""
from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf

L = tf.keras.layers
FIELDS = ["f0", "f1", "f2", "f3"]
V, K = 40, 4
_count = itertools.count()


def _uid(base: str) -> str:
    """A fresh name: TFRA shares tables by name, and a test builds the same model many times."""
    return f"{base}_{next(_count)}"


def _ids(shape=(1,), dtype=tf.int64):
    return {f: tf.keras.Input(shape=shape, dtype=dtype, name=f) for f in FIELDS}


def _fm_tf_ops(e):
    """FM as users write it: tf.reduce_sum, * and -; e is [B, F, K]."""
    s = tf.reduce_sum(e, axis=1)
    return 0.5 * tf.reduce_sum(s * s - tf.reduce_sum(e * e, axis=1), axis=1, keepdims=True)


def keras_deepfm():
    """One Keras Embedding per field on [B, 1] ids; Concatenate(axis=1) of [B, 1, K]; FM with
    tf ops; linear part Embedding(V, 1) summed with Add(); deep part Flatten -> Dense."""
    x = _ids()
    e = L.Concatenate(axis=1)([L.Embedding(V, K)(x[f]) for f in FIELDS])
    linear = L.Add()([L.Flatten()(L.Embedding(V, 1)(x[f])) for f in FIELDS])
    deep = L.Dense(1)(L.Dense(8, activation="relu")(L.Flatten()(e)))
    return tf.keras.Model(x, tf.sigmoid(linear + _fm_tf_ops(e) + deep))


def keras_fm_stack_square():
    """[B] ids -> [B, K]; tf.stack(axis=1); FM with tf.square, keepdims and 0.5 inside the sum;
    the linear weights stacked [B, F, 1] and summed over the fields axis."""
    x = _ids(shape=())
    e = tf.stack([L.Embedding(V, K)(x[f]) for f in FIELDS], axis=1)
    fm = tf.reduce_sum(0.5 * (tf.square(tf.reduce_sum(e, axis=1, keepdims=True))
                              - tf.reduce_sum(tf.square(e), axis=1, keepdims=True)), axis=-1)
    w = tf.stack([L.Embedding(V, 1)(x[f]) for f in FIELDS], axis=1)          # [B, F, 1]
    linear = tf.reduce_sum(w, axis=1)
    return tf.keras.Model(x, L.Activation("sigmoid")(L.Dense(1)(tf.concat([fm, linear], -1))))


def keras_wdl_concat_plus():
    """Wide & Deep: tf.concat(-1) of [B, K] into a Dense with no bias and no activation, then a
    Reshape; the wide part a chain of + over [B, 1] weights."""
    x = _ids(shape=())
    deep = L.Dense(8, use_bias=False)(tf.concat([L.Embedding(V, K)(x[f]) for f in FIELDS], axis=-1))
    deep = L.Dense(1)(L.ReLU()(L.Reshape((8,))(deep)))
    w = [L.Embedding(V, 1)(x[f]) for f in FIELDS]
    wide = w[0] + w[1] + w[2] + w[3]
    return tf.keras.Model(x, tf.sigmoid(wide + deep))


def keras_lr_reduce_fields():
    """Logistic regression: Concatenate(axis=1) of [B, 1, 1] weights -> [B, F, 1], reduce_sum over
    the fields axis without keepdims, a Dense(1) bias and sigmoid."""
    x = _ids()
    w = L.Concatenate(axis=1)([L.Embedding(V, 1)(x[f]) for f in FIELDS])
    logit = tf.reduce_sum(w, axis=[1, 2])
    return tf.keras.Model(x, L.Activation("sigmoid")(tf.expand_dims(logit, -1) + 0.1))


def keras_sequential_mlp():
    """Embeddings flattened into a Sequential MLP whose first layer is the substituted Dense."""
    x = _ids()
    h = L.Flatten()(L.Concatenate(axis=1)([L.Embedding(V, K)(x[f]) for f in FIELDS]))
    mlp = tf.keras.Sequential([L.Dense(8, activation="relu"), L.Dense(4, activation="relu"),
                               L.Dense(1, activation="sigmoid")])
    return tf.keras.Model(x, mlp(h))


def keras_nfm():
    """NFM: bi-interaction pooling 0.5 * ((sum E)^2 - sum E^2) as tf ops, a [B, K] vector, then an MLP."""
    x = _ids(shape=())
    e = L.Concatenate(axis=1)([L.Reshape((1, K))(L.Embedding(V, K)(x[f])) for f in FIELDS])
    bi = 0.5 * (tf.square(tf.reduce_sum(e, axis=1)) - tf.reduce_sum(tf.square(e), axis=1))
    return tf.keras.Model(x, L.Dense(1, activation="sigmoid")(L.Dense(8, activation="relu")(bi)))


def tfra_deepfm():
    """DeepFM on TFRA dynamic tables (de.keras.layers.Embedding), int64 ids of any value."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    x = _ids(shape=())
    init = tf.keras.initializers.RandomUniform(-0.1, 0.1)
    e = tf.stack([de.keras.layers.Embedding(K, initializer=init, name=_uid(f"emb_{f}"))(x[f]) for f in FIELDS], 1)
    w = [de.keras.layers.Embedding(1, initializer=init, name=_uid(f"w_{f}"))(x[f]) for f in FIELDS]
    deep = L.Dense(1)(L.Dense(8, activation="relu")(L.Flatten()(e)))
    return tf.keras.Model(x, tf.sigmoid(L.Add()(w) + _fm_tf_ops(e) + deep))


def multi_hot_combiner():
    """Multi-hot fields [B, 3] (0 = padding): Keras Embedding(mask_zero) averaged by
    GlobalAveragePooling1D (the mask), and a TFRA SquashedEmbedding with combiner='sum'."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    x = {f: tf.keras.Input(shape=(3,), dtype=tf.int64, name=f) for f in FIELDS}
    vecs = [L.GlobalAveragePooling1D()(L.Embedding(V, K, mask_zero=True)(x[f])) for f in FIELDS[:2]]
    init = tf.keras.initializers.RandomUniform(-0.1, 0.1)
    vecs += [de.keras.layers.SquashedEmbedding(K, initializer=init, combiner="sum",
                                               name=_uid(f"bag_{f}"))(x[f]) for f in FIELDS[2:]]
    h = L.Dense(8, activation="relu")(L.Concatenate()(vecs))
    return tf.keras.Model(x, L.Dense(1, activation="sigmoid")(h))


def dense_feature_into_first_dense():
    """A numeric feature concatenated with the embeddings into the first Dense: its rows of the
    kernel stay replicated."""
    x = _ids(shape=())
    num = tf.keras.Input(shape=(2,), name="num")
    h = L.Dense(8, activation="relu")(L.Concatenate()([L.Embedding(V, K)(x[f]) for f in FIELDS] + [num]))
    return tf.keras.Model({**x, "num": num}, L.Dense(1, activation="sigmoid")(h))


def lookup_preprocessing():
    """String features mapped to ids by replicated preprocessing before the lookup: Keras
    StringLookup (a vocabulary; unknown values -> 0) for two fields, Hashing for the others."""
    x = {f: tf.keras.Input(shape=(1,), dtype=tf.string, name=f) for f in FIELDS}
    vocab = [str(i) for i in range(1, V // 2)]
    ids = {f: (L.StringLookup(vocabulary=vocab)(x[f]) if f in FIELDS[:2] else L.Hashing(V)(x[f])) for f in FIELDS}
    e = [L.Embedding(V, K)(ids[f]) for f in FIELDS]
    w = [L.Embedding(V, 1)(L.Hashing(V, salt=7)(x[f])) for f in FIELDS]
    deep = L.Dense(1)(L.Dense(8, activation="relu")(L.Flatten()(L.Concatenate()(e))))
    return tf.keras.Model(x, tf.sigmoid(L.Flatten()(L.Add()(w)) + deep))


def regularized():
    """Weight penalties everywhere: L2 on the tables, L2 on the first Dense's kernel (whose rows
    are split by field, plus replicated rows for a numeric input) and L1 on its bias."""
    x = _ids(shape=())
    num = tf.keras.Input(shape=(2,), name="num")
    reg = tf.keras.regularizers.l2(1e-2)
    e = [L.Embedding(V, K, embeddings_regularizer=reg)(x[f]) for f in FIELDS]
    h = L.Dense(8, activation="relu", kernel_regularizer=reg, bias_regularizer=tf.keras.regularizers.l1(1e-2))(
        L.Concatenate()(e + [num]))
    return tf.keras.Model({**x, "num": num}, L.Dense(1, activation="sigmoid")(h))


class ClippedModel(tf.keras.Model):
    """A user's functional model with its own train_step: gradients clipped to [-0.01, 0.01]
    (per entry, so the same on every process; a global-norm clip would need the norm over
    all processes' tables)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            pred = self(x, training=True)
            loss = self.compiled_loss(y, pred, regularization_losses=self.losses)
        grads = tape.gradient(loss, self.trainable_variables)
        grads = [tf.clip_by_value(g, -0.01, 0.01) if isinstance(g, tf.Tensor)
                 else tf.IndexedSlices(tf.clip_by_value(g.values, -0.01, 0.01), g.indices, g.dense_shape)
                 for g in grads]
        self.optimizer.apply_gradients(zip(grads, self.trainable_variables))
        self.compiled_metrics.update_state(y, pred)
        return {m.name: m.result() for m in self.metrics}


def custom_train_step():
    x = _ids()
    e = L.Concatenate(axis=1)([L.Embedding(V, K)(x[f]) for f in FIELDS])
    h = L.Dense(8, activation="relu")(L.Flatten()(e))
    return ClippedModel(x, L.Dense(1, activation="sigmoid")(h))


def shared_table_deepfm():
    """User and target user (f0, f1) read ONE Embedding and ONE 1-wide weight table: a field
    group that one process owns whole; f2 and f3 have their own tables."""
    x = _ids()
    user = (L.Embedding(V, K), L.Embedding(V, 1))
    tables = {"f0": user, "f1": user, **{f: (L.Embedding(V, K), L.Embedding(V, 1)) for f in FIELDS[2:]}}
    e = L.Concatenate(axis=1)([tables[f][0](x[f]) for f in FIELDS])
    linear = L.Add()([L.Flatten()(tables[f][1](x[f])) for f in FIELDS])
    deep = L.Dense(1)(L.Dense(8, activation="relu")(L.Flatten()(e)))
    return tf.keras.Model(x, tf.sigmoid(linear + _fm_tf_ops(e) + deep))


def two_tower():
    """A user tower (f0 with a big table, f1) and an item tower (f2, f3), each Dense 16 -> 8,
    the logit their dot product: two first Dense layers, each over some of the fields, so at
    N = 2 the balanced plan leaves a process with no field of one of them."""
    x = _ids()
    sizes = {"f0": 50 * V, "f1": V, "f2": V, "f3": V}

    def tower(fs):
        h = L.Concatenate()([L.Flatten()(L.Embedding(sizes[f], K)(x[f])) for f in fs])
        return L.Dense(8)(L.Dense(16, activation="relu")(h))
    return tf.keras.Model(x, L.Activation("sigmoid")(L.Dot(axes=1)([tower(FIELDS[:2]), tower(FIELDS[2:])])))


def nested_towers():
    """The two towers as functional models of their own, called as layers of the outer model:
    DES reads through them."""
    x = _ids()

    def tower(fs, name):
        inner = {f: tf.keras.Input(shape=(1,), dtype=tf.int64, name=f) for f in fs}
        h = L.Concatenate()([L.Flatten()(L.Embedding(V, K)(inner[f])) for f in fs])
        return tf.keras.Model(inner, L.Dense(8)(L.Dense(16, activation="relu")(h)), name=_uid(name))
    user, item = tower(FIELDS[:2], "user_tower"), tower(FIELDS[2:], "item_tower")
    dot = L.Dot(axes=1)([user({f: x[f] for f in FIELDS[:2]}), item({f: x[f] for f in FIELDS[2:]})])
    return tf.keras.Model(x, L.Activation("sigmoid")(dot))


def dlrm_offsets():
    """DLRM / pytorch-fm port: one [B, F] ids input plus per-field offsets into ONE table
    Embedding(F*V, K), FM, a linear part from Embedding(F*V, 1) and an MLP. DES splits both
    tables by key range (one field per range) and sends their rows; the FM is not split."""
    ids = tf.keras.Input(shape=(len(FIELDS),), dtype=tf.int64, name="ids")
    x = ids + tf.constant(np.arange(len(FIELDS)) * V, tf.int64)
    e = L.Embedding(len(FIELDS) * V, K)(x)
    linear = tf.reduce_sum(L.Embedding(len(FIELDS) * V, 1)(x), axis=1)
    deep = L.Dense(8, activation="relu")(L.Flatten()(e))
    return tf.keras.Model(ids, tf.sigmoid(L.Dense(1)(L.Concatenate()([deep, _fm_tf_ops(e), linear]))))


def tfra_one_table():
    """TFRA's one-table style: ONE [B, F] ids input into ONE dynamic table of width K (and one of
    width 1 for the linear part), FM by TF ops and an MLP. No field owns a table: DES splits both by
    key stripe over the processes (des_ops.stripes)."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    ids = tf.keras.Input(shape=(len(FIELDS),), dtype=tf.int64, name="ids")
    init = tf.keras.initializers.RandomUniform(-0.1, 0.1)
    e = de.keras.layers.Embedding(K, initializer=init, name=_uid("emb_all"))(ids)
    linear = tf.reduce_sum(de.keras.layers.Embedding(1, initializer=init, name=_uid("w_all"))(ids), axis=1)
    deep = L.Dense(1)(L.Dense(8, activation="relu")(L.Flatten()(e)))
    return tf.keras.Model(ids, tf.sigmoid(linear + _fm_tf_ops(e) + deep))


def big_field_deepfm():
    """keras_deepfm with f0's two tables 30 times larger (30 V of 33 V rows): f0 is too big for one
    owner at N > 1 with des.Options(stripe_min_rows=0), and split by key stripe (des.compiler.big_tables)."""
    x = _ids()
    rows = {f: 30 * V if f == "f0" else V for f in FIELDS}
    e = L.Concatenate(axis=1)([L.Embedding(rows[f], K)(x[f]) for f in FIELDS])
    linear = L.Add()([L.Flatten()(L.Embedding(rows[f], 1)(x[f])) for f in FIELDS])
    deep = L.Dense(1)(L.Dense(8, activation="relu")(L.Flatten()(e)))
    return tf.keras.Model(x, tf.sigmoid(linear + _fm_tf_ops(e) + deep))


def big_bag_deepfm():
    """keras_deepfm plus "hist", a bag of 5 ids a sample into tables of 30 V rows (too big for one
    owner at N > 1 with des.Options(stripe_min_rows=0)), mean-pooled into FM beside the one-id
    fields and into the first Dense, and summed into the linear sum: split by key stripe (FM squares
    its pooled vector after the sum over processes). The first Dense has an L2 kernel penalty (the
    shared rows of "hist" counted once over processes)."""
    x = _ids()
    hist = tf.keras.Input(shape=(5,), dtype=tf.int64, name="hist")
    e = L.Concatenate(axis=1)([L.Embedding(V, K)(x[f]) for f in FIELDS])
    bag = tf.reduce_mean(L.Embedding(30 * V, K)(hist), axis=1)
    linear = L.Add()([L.Flatten()(L.Embedding(V, 1)(x[f])) for f in FIELDS]
                     + [tf.reduce_sum(L.Embedding(30 * V, 1)(hist), axis=1)])
    deep = L.Dense(1)(L.Dense(8, activation="relu", kernel_regularizer="l2")(L.Concatenate()([L.Flatten()(e), bag])))
    fm = _fm_tf_ops(L.Concatenate(axis=1)([e, tf.expand_dims(bag, 1)]))
    return tf.keras.Model({**x, "hist": hist}, tf.sigmoid(linear + fm + deep))


def deepctr_deepfm_defaults():
    """DeepCTR's DeepFM as its README writes it: 8 fields, vocabulary 500, its default DNN
    (256, 128, 64) and l2_reg_embedding 1e-5 (a weight penalty on every table)."""
    from deepctr import models as dm
    from deepctr.feature_column import SparseFeat
    cols = [SparseFeat(f"c{j}", vocabulary_size=500, embedding_dim=K, dtype="int64") for j in range(8)]
    return dm.DeepFM(cols, cols, seed=1)


def _deepctr(kind: str):
    from deepctr import models as dm
    from deepctr.feature_column import SparseFeat
    cols = [SparseFeat(f, vocabulary_size=V, embedding_dim=K, dtype="int64") for f in FIELDS]
    if kind == "PNN":                    # one set of feature columns, no linear part
        return dm.PNN(cols, dnn_hidden_units=(8, 4), seed=1)
    return getattr(dm, kind)(cols, cols, dnn_hidden_units=(8, 4), seed=1)


def deepctr_din():
    """DeepCTR's DIN: a user and a candidate item, the behaviour history (4 items, zero-padded,
    read through the item's table with Keras's mask) attended to by the candidate."""
    from deepctr import models as dm
    from deepctr.feature_column import SparseFeat, VarLenSparseFeat
    feats = [SparseFeat("user", V, embedding_dim=K, dtype="int64"), SparseFeat("item", V, embedding_dim=K, dtype="int64"),
             VarLenSparseFeat(SparseFeat("hist_item", V, embedding_dim=K, embedding_name="item", dtype="int64"),
                              maxlen=4, length_name="seq_length")]
    return dm.DIN(feats, ["item"], dnn_hidden_units=(8,), att_hidden_size=(8,), seed=1)


def deepctr_mmoe():
    """DeepCTR's MMoE with its default gates (no hidden units: the gate's DNN passes its input
    through), two experts, two binary tasks (des.jobs.verify.fit_and_snapshot trains both)."""
    from deepctr import models as dm
    from deepctr.feature_column import SparseFeat
    cols = [SparseFeat(f, vocabulary_size=V, embedding_dim=K, dtype="int64") for f in FIELDS]
    return dm.MMOE(cols, num_experts=2, expert_dnn_hidden_units=(8,), tower_dnn_hidden_units=(4,),
                   task_types=("binary", "binary"), task_names=("click", "buy"), seed=1)


# models with several outputs: not in BUILDERS (whose tests read one prediction per sample)
MULTI_TASK = {"deepctr_mmoe": deepctr_mmoe}

BUILDERS = {
    "keras_deepfm": keras_deepfm,
    "keras_fm_stack_square": keras_fm_stack_square,
    "keras_wdl_concat_plus": keras_wdl_concat_plus,
    "keras_lr_reduce_fields": keras_lr_reduce_fields,
    "keras_sequential_mlp": keras_sequential_mlp,
    "keras_nfm": keras_nfm,
    "tfra_deepfm": tfra_deepfm,
    "multi_hot_combiner": multi_hot_combiner,
    "dense_feature_into_first_dense": dense_feature_into_first_dense,
    "lookup_preprocessing": lookup_preprocessing,
    "regularized": regularized,
    "custom_train_step": custom_train_step,
    "shared_table_deepfm": shared_table_deepfm,
    "two_tower": two_tower,
    "nested_towers": nested_towers,
    "deepctr_deepfm_defaults": deepctr_deepfm_defaults,
    "deepctr_deepfm": lambda: _deepctr("DeepFM"),
    "deepctr_wdl": lambda: _deepctr("WDL"),
    "deepctr_fnn": lambda: _deepctr("FNN"),
    "deepctr_nfm": lambda: _deepctr("NFM"),
    # readers no rule splits: every table by field rows (rewrite_rules.field_rows)
    "deepctr_dcn": lambda: _deepctr("DCN"),
    "deepctr_xdeepfm": lambda: _deepctr("xDeepFM"),
    "deepctr_autoint": lambda: _deepctr("AutoInt"),
    "deepctr_pnn": lambda: _deepctr("PNN"),
    "deepctr_fibinet": lambda: _deepctr("FiBiNET"),
    "deepctr_ccpm": lambda: _deepctr("CCPM"),
    "deepctr_din": deepctr_din,
    "dlrm_offsets": dlrm_offsets,
    "tfra_one_table": tfra_one_table,
    "big_field_deepfm": big_field_deepfm,
    "big_bag_deepfm": big_bag_deepfm,
}

EXPECTED = {
    "keras_deepfm": ["embed_concat_dense", "fm_interaction", "lr_sum"],
    "keras_fm_stack_square": ["fm_interaction", "lr_sum"],
    "keras_wdl_concat_plus": ["embed_concat_dense", "lr_sum"],
    "keras_lr_reduce_fields": ["lr_sum"],
    "keras_sequential_mlp": ["embed_concat_dense"],
    "keras_nfm": ["bi_interaction"],
    "tfra_deepfm": ["embed_concat_dense", "fm_interaction", "lr_sum"],
    "multi_hot_combiner": ["embed_concat_dense"],
    "dense_feature_into_first_dense": ["embed_concat_dense"],
    "lookup_preprocessing": ["embed_concat_dense", "lr_sum"],
    "regularized": ["embed_concat_dense"],
    "custom_train_step": ["embed_concat_dense"],
    "shared_table_deepfm": ["embed_concat_dense", "fm_interaction", "lr_sum"],
    "two_tower": ["embed_concat_dense", "embed_concat_dense"],
    "nested_towers": ["embed_concat_dense", "embed_concat_dense"],
    "deepctr_deepfm_defaults": ["embed_concat_dense", "fm_interaction", "lr_sum"],
    "deepctr_deepfm": ["embed_concat_dense", "fm_interaction", "lr_sum"],
    "deepctr_wdl": ["embed_concat_dense", "lr_sum"],
    "deepctr_fnn": ["embed_concat_dense", "lr_sum"],
    "deepctr_nfm": ["bi_interaction", "lr_sum"],
    "deepctr_dcn": ["field_rows"] * 4 + ["lr_sum"],
    "deepctr_xdeepfm": ["field_rows"] * 4 + ["lr_sum"],
    "deepctr_autoint": ["field_rows"] * 4 + ["lr_sum"],
    "deepctr_pnn": ["field_rows"] * 4,
    "deepctr_fibinet": ["field_rows"] * 4 + ["lr_sum"],
    "deepctr_ccpm": ["field_rows"] * 4 + ["lr_sum"],
    "deepctr_din": ["field_rows"] * 4,       # user, item, the history twice (its table: item's)
    "dlrm_offsets": ["field_rows"] * 2,      # both tables split by key range, one field per range
    "tfra_one_table": ["field_rows"] * 2,    # both tables split by key stripe (N > 1)
    "big_field_deepfm": ["embed_concat_dense", "fm_interaction", "lr_sum"],
    "big_bag_deepfm": ["embed_concat_dense", "fm_interaction", "lr_sum"],
}


def batches_for(model: tf.keras.Model, steps: int, batch: int, seed: int = 0) -> list:
    """Zipf-skewed ids in [1, V) shaped like each input (multi-hot: trailing 0 padding), strings
    of those ids for string inputs, uniform floats for numeric ones; labels from a planted rule."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x, score = {}, np.zeros(batch)
        for name, inp in zip(model.input_names, model.inputs):
            shape = (batch, *[int(d) for d in inp.shape[1:]])
            if inp.dtype == tf.float32:
                v = rng.uniform(0, 1, shape).astype(np.float32)
                score += v.reshape(batch, -1).sum(1) - 1
                x[name] = tf.constant(v)
                continue
            ids = np.minimum(rng.zipf(1.4, shape), V - 1)
            if len(shape) == 2 and shape[1] > 1:
                ids[np.arange(shape[1])[None, :] >= rng.integers(1, shape[1] + 1, batch)[:, None]] = 0
            score += np.sin(ids + sum(map(ord, name)) % 5).reshape(batch, -1).sum(1)
            x[name] = tf.constant(ids.astype(str) if inp.dtype == tf.string else ids,
                                  dtype=inp.dtype)
        y = (score + rng.normal(0, 1, batch) > 0).astype(np.float32).reshape(batch, 1)
        out.append((x, tf.constant(y)))
    return out


def sliced_batches(model: tf.keras.Model, rows: int, batch: int, seed: int = 4, probe_rows: int = 16,
                   probe_seed: int = 99) -> tuple[list, dict]:
    """(``rows`` rows of batches_for cut into batches of ``batch``, the last one shorter; a probe
    batch of ``probe_rows``)."""
    x, y = batches_for(model, 1, rows, seed=seed)[0]
    batches = [({k: v[i:i + batch] for k, v in x.items()}, y[i:i + batch]) for i in range(0, rows, batch)]
    return batches, batches_for(model, 1, probe_rows, seed=probe_seed)[0][0]


def rows_reordered(batches: list, seed: int) -> list:
    """``batches`` with each batch's rows in another order (a seeded permutation): the same loss,
    other float32 summation orders (the spread one process shows by itself, tests/test_gallery.py)."""
    order = np.random.default_rng(seed)
    out = []
    for x, y in batches:
        p = order.permutation(int(y.shape[0]))
        out.append(({k: tf.gather(v, p) for k, v in x.items()}, tf.gather(y, p)))
    return out


# Every optimizer Keras 2.15 ships for these models, new and legacy, as the tests of saving,
# checkpoints and export train them (des.runtime.saving, des.checkpoint, des.export).
OPTIMIZERS = {
    "adam": lambda: tf.keras.optimizers.Adam(0.02),
    "adagrad": lambda: tf.keras.optimizers.Adagrad(0.05),
    "ftrl": lambda: tf.keras.optimizers.Ftrl(0.05),
    "rmsprop": lambda: tf.keras.optimizers.RMSprop(0.01, momentum=0.5, centered=True),
    "sgd": lambda: tf.keras.optimizers.SGD(0.05, momentum=0.9),
    "legacy_adam": lambda: tf.keras.optimizers.legacy.Adam(0.02),
    "legacy_adagrad": lambda: tf.keras.optimizers.legacy.Adagrad(0.05),
    "legacy_ftrl": lambda: tf.keras.optimizers.legacy.Ftrl(0.05),
    "legacy_rmsprop": lambda: tf.keras.optimizers.legacy.RMSprop(0.01, momentum=0.5, centered=True),
    "legacy_sgd": lambda: tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9),
}


def optimizer_for(model: tf.keras.Model, name: str):
    """A new optimizer ``name`` for ``model``; TFRA's DynamicEmbeddingOptimizer around it when the
    model has TFRA tables (as TFRA requires)."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    opt = OPTIMIZERS[name]()
    if any(isinstance(m, de.keras.layers.Embedding) for m in model.submodules):
        opt = de.DynamicEmbeddingOptimizer(opt)
    return opt

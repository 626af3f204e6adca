"""Reference CTR models as plain tf.keras functional models over a FeatureSpec.

They are what a DeepCTR / TFRA user writes anyway, and the input of des.transform:

    >>> from des.data import criteo_spec
    >>> model = deepfm(criteo_spec(dim=8), hidden=(64, 32), seed=1)
    >>> len(model.inputs), model.output.shape
    (39, TensorShape([None, 1]))

Every categorical field has its own dynamic table (FieldEmbedding); the first-order
(linear) part uses 1-wide tables initialised to zero, the others ``init_scale``-uniform rows.
All initial values depend only on ``seed``.
"""
from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from models.layers import Bias, FieldEmbedding, FMInteraction
from models.spec import FeatureSpec

L = tf.keras.layers


def inputs_for(spec: FeatureSpec) -> dict[str, tf.keras.Input]:
    """One named Input per field: int64 ids [B] (or [B, max_len] for multi), float32 [B] numeric;
    a weighted field also has float32 weights [B, max_len] named ``field.weight_name``."""
    out = {}
    for f in spec:
        if f.kind == "numeric":
            out[f.name] = tf.keras.Input(shape=(), dtype=tf.float32, name=f.name)
        else:
            shape = (f.max_len,) if f.kind == "multi" else ()
            out[f.name] = tf.keras.Input(shape=shape, dtype=tf.int64, name=f.name)
        if f.weighted:
            out[f.weight_name] = tf.keras.Input(shape=(f.max_len,), dtype=tf.float32, name=f.weight_name)
    return out


def _lookup_input(f, x):
    """What a field's table reads: ids, or [ids, weights] for a weighted field."""
    return [x[f.name], x[f.weight_name]] if f.weighted else x[f.name]


def _linear_sum(spec: FeatureSpec, x, seed: int):
    terms = [FieldEmbedding(f.name, 1, seed, init_scale=0.0, linear=True)(_lookup_input(f, x))
             for f in spec.sparse()]
    return L.Add(name="linear_sum")(terms) if len(terms) > 1 else terms[0]


def _embeddings(spec: FeatureSpec, x, seed: int, init_scale: float):
    return [FieldEmbedding(f.name, f.dim, seed, init_scale)(_lookup_input(f, x)) for f in spec.sparse()]


def _mlp(h, hidden: Sequence[int], seed: int, name: str):
    for i, units in enumerate(hidden):
        h = L.Dense(units, activation="relu", name=f"{name}_{i}",
                    kernel_initializer=tf.keras.initializers.GlorotUniform(seed=seed + 101 + i))(h)
    return L.Dense(1, name=f"{name}_out",
                   kernel_initializer=tf.keras.initializers.GlorotUniform(seed=seed + 199))(h)


def _output(logit):
    return L.Activation("sigmoid", name="prob")(logit)


def lr(spec: FeatureSpec, seed: int = 0, **_) -> tf.keras.Model:
    """Logistic regression: sigmoid(sum_f w_f(x_f) + b)."""
    x = inputs_for(spec)
    return tf.keras.Model(x, _output(Bias(name="bias")(_linear_sum(spec, x, seed))), name="lr")


def fm(spec: FeatureSpec, seed: int = 0, init_scale: float = 0.05, **_) -> tf.keras.Model:
    """Factorization machine: sigmoid(linear + 0.5 * sum_k((sum v)^2 - sum v^2) + b)."""
    x = inputs_for(spec)
    stacked = tf.stack(_embeddings(spec, x, seed, init_scale), axis=1)
    logit = L.Add()([_linear_sum(spec, x, seed), FMInteraction(name="fm")(stacked)])
    return tf.keras.Model(x, _output(Bias(name="bias")(logit)), name="fm")


def dnn(spec: FeatureSpec, hidden: Sequence[int] = (128, 64), seed: int = 0,
        init_scale: float = 0.05, **_) -> tf.keras.Model:
    """MLP over the concatenated field embeddings."""
    x = inputs_for(spec)
    h = L.Concatenate(name="embed_concat")(_embeddings(spec, x, seed, init_scale))
    return tf.keras.Model(x, _output(_mlp(h, hidden, seed, "dnn")), name="dnn")


def wdl(spec: FeatureSpec, hidden: Sequence[int] = (128, 64), seed: int = 0,
        init_scale: float = 0.05, **_) -> tf.keras.Model:
    """Wide & Deep: sigmoid(linear sum + MLP(concat embeddings))."""
    x = inputs_for(spec)
    h = L.Concatenate(name="embed_concat")(_embeddings(spec, x, seed, init_scale))
    logit = L.Add()([_linear_sum(spec, x, seed), _mlp(h, hidden, seed, "dnn")])
    return tf.keras.Model(x, _output(logit), name="wdl")


def deepfm(spec: FeatureSpec, hidden: Sequence[int] = (128, 64), seed: int = 0,
           init_scale: float = 0.05, **_) -> tf.keras.Model:
    """DeepFM: linear + FM + MLP, FM and MLP sharing one embedding table per field."""
    x = inputs_for(spec)
    embs = _embeddings(spec, x, seed, init_scale)
    fm_out = FMInteraction(name="fm")(tf.stack(embs, axis=1))
    deep = _mlp(L.Concatenate(name="embed_concat")(embs), hidden, seed, "dnn")
    logit = L.Add()([_linear_sum(spec, x, seed), fm_out, deep])
    return tf.keras.Model(x, _output(Bias(name="bias")(logit)), name="deepfm")


MODELS = {"lr": lr, "fm": fm, "dnn": dnn, "wdl": wdl, "deepfm": deepfm}


def build(name: str, spec: FeatureSpec, **kwargs) -> tf.keras.Model:
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return MODELS[name](spec, **kwargs)

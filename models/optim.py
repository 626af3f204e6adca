"""Optimizers that work with TFRA dynamic tables (TFRA 0.7.2 needs the legacy Adagrad/Ftrl)."""
from __future__ import annotations

import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

OPTIMIZERS = {
    "sgd": lambda lr: tf.keras.optimizers.legacy.SGD(lr),
    "adagrad": lambda lr: tf.keras.optimizers.legacy.Adagrad(lr, initial_accumulator_value=0.1),
    "adam": lambda lr: tf.keras.optimizers.legacy.Adam(lr),
    "ftrl": lambda lr: tf.keras.optimizers.legacy.Ftrl(lr),
}
DEFAULT_LR = {"sgd": 0.5, "adagrad": 0.05, "adam": 0.001, "ftrl": 0.05}


def make_optimizer(name: str, learning_rate: float | None = None):
    """A Keras optimizer wrapped for dynamic embeddings: make_optimizer("adam", 1e-3)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from {sorted(OPTIMIZERS)}")
    lr = DEFAULT_LR[name] if learning_rate is None else learning_rate
    return de.DynamicEmbeddingOptimizer(OPTIMIZERS[name](lr))

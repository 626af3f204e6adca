"""Optimizers that work with TFRA dynamic tables (TFRA 0.7.2 needs the legacy Adagrad/Ftrl).

    make_optimizer("adam", 1e-3)                    # one optimizer for every weight
    make_optimizer("adam", 1e-3, linear="ftrl")     # FTRL on the linear part, Adam on the rest
"""
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


def is_linear(variable) -> bool:
    """True for a weight of the models' linear part: the tables of the sparse linear sum
    (``FieldEmbedding(..., linear=True)``) and the ``Bias`` layer mark their variables."""
    return bool(getattr(variable, "des_linear_part", False))


class LinearAndRestOptimizer(tf.keras.optimizers.legacy.Optimizer):
    """Applies ``linear`` to the linear part's weights and ``rest`` to all others, the way
    Wide&Deep is trained (FTRL on the wide part, Adagrad/Adam on the deep part). Both keep their
    own slots; a checkpoint of this optimizer holds both."""

    def __init__(self, linear, rest, name: str = "LinearAndRest"):
        super().__init__(name)
        self.linear, self.rest = linear, rest
        self._track_trackable(linear, name="linear")
        self._track_trackable(rest, name="rest")

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        pairs = [(g, v) for g, v in grads_and_vars if g is not None]
        joined = [v.name for _, v in pairs if getattr(v, "des_joins_linear", False)]
        if joined:
            raise ValueError(f"{joined[0]} holds linear weights and embeddings in one row (joined tables): one "
                             f"optimizer must train both; des.transform(model, des.Options(tables=\"fused\")) (or "
                             f"compile the model with this optimizer before des.transform; des.train: --tables fused) "
                             f"gives the linear part its own rows")
        linear = [(g, v) for g, v in pairs if is_linear(v)]
        rest = [(g, v) for g, v in pairs if not is_linear(v)]
        updates = [opt.apply_gradients(part, experimental_aggregate_gradients=experimental_aggregate_gradients)
                   for opt, part in ((self.linear, linear), (self.rest, rest)) if part]
        with tf.control_dependencies([u for u in updates if u is not None]):
            return self.iterations.assign_add(1)

    def get_config(self):
        return {"name": self._name, "linear": self.linear.get_config(), "rest": self.rest.get_config()}


def _one(name: str, learning_rate: float | None):
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; choose from {sorted(OPTIMIZERS)}")
    lr = DEFAULT_LR[name] if learning_rate is None else learning_rate
    return de.DynamicEmbeddingOptimizer(OPTIMIZERS[name](lr))


def make_optimizer(name: str, learning_rate: float | None = None, linear: str | None = None,
                   linear_learning_rate: float | None = None):
    """A Keras optimizer wrapped for dynamic embeddings: make_optimizer("adam", 1e-3).

    ``linear``: another optimizer for the linear part (sparse linear sum and bias), e.g. "ftrl".
    """
    if linear is None:
        return apply_without_autograph(_one(name, learning_rate))
    return apply_without_autograph(LinearAndRestOptimizer(_one(linear, linear_learning_rate),
                                                          _one(name, learning_rate)))


def apply_without_autograph(optimizer):
    """``optimizer`` (returned) with its ``apply_gradients`` traced as plain TensorFlow, not converted
    by autograph: Keras's and TFRA's update code has no Python control flow on tensors, and converting
    TFRA's per-variable update functions took ~2.5 s of a 39-field DeepFM's ~16 s to its first step.
    Idempotent.

        >>> opt = apply_without_autograph(make_optimizer("adam"))
        >>> opt.apply_gradients is apply_without_autograph(opt).apply_gradients
        True
    """
    if not getattr(optimizer, "_des_apply_unconverted", False):
        optimizer.apply_gradients = tf.autograph.experimental.do_not_convert(optimizer.apply_gradients)
        optimizer._des_apply_unconverted = True
    return optimizer

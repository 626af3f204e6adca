"""Adapters: map a third-party CTR layer (or a user's own) to the canonical math the rules read.

    >>> @register_adapter("mylib.layers.MyFM")
    ... def _my_fm(layer, args, kwargs):
    ...     return "fm_interaction", args[0], {}          # (kind, operands, attrs)
    >>> ADAPTERS["mylib.layers.MyFM"] is _my_fm
    True

An adapter returns the canonical ``kind`` of one call of the layer, its tensor operands and
attrs (see des.graph.ir), or None when this call is not in a form it understands (then the layer
is an ordinary replicated layer). Registered:

- a layer declaring ``des_substitute = "fm_interaction" | "bi_interaction"`` (its input is
  the [B, F, K] stack of field vectors);
- DeepCTR (0.9.x; never imported here, matched by class path): ``Linear`` -> ``linear``
  (sum over its concatenated 1-wide field vectors, + its bias, + its dense part), ``FM`` ->
  ``fm_interaction``, ``BiInteractionPooling`` -> ``bi_interaction``, ``DNN`` -> ``dense``
  with its first kernel and bias; the rest of the DNN (batch norm, activation, dropout, the
  other layers) stays replicated (``DNNRest``); its layout helpers ``Concat`` -> ``concat``,
  ``NoMask`` -> ``identity`` and ``_Add`` -> ``add``.
"""
from __future__ import annotations

import inspect

from typing import Callable

import tensorflow as tf

ADAPTERS: dict[str, Callable] = {}


def register_adapter(class_path: str):
    """Decorator: ``fn(layer, args, kwargs) -> (kind, operands, attrs) | None`` for layers whose
    class is ``class_path`` (module.Class; the class's own module or any it is re-exported from)."""
    def add(fn):
        ADAPTERS[class_path] = fn
        return fn
    return add


def adapt(layer, args: tuple, kwargs: dict):
    declared = getattr(layer, "des_substitute", None)
    if declared:
        first = args[0] if args else next(iter(kwargs.values()))
        return declared, first, {}
    for cls in type(layer).__mro__:
        fn = ADAPTERS.get(f"{cls.__module__}.{cls.__qualname__}")
        if fn is not None:
            return fn(layer, args, kwargs)
    return None


def _first(args, kwargs):
    return args[0] if args else next(iter(kwargs.values()))


@register_adapter("deepctr.layers.interaction.FM")
def _deepctr_fm(layer, args, kwargs):
    return "fm_interaction", _first(args, kwargs), {}


@register_adapter("deepctr.layers.interaction.BiInteractionPooling")
def _deepctr_bi(layer, args, kwargs):
    return "bi_interaction", _first(args, kwargs), {}


@register_adapter("deepctr.layers.utils.Concat")
def _deepctr_concat(layer, args, kwargs):
    x = _first(args, kwargs)
    xs = x if isinstance(x, (list, tuple)) else [x]
    rank = xs[0].shape.rank
    if rank is None:
        return None
    return "concat", list(xs), {"axis": int(layer.axis) % rank}


@register_adapter("deepctr.layers.utils.NoMask")
def _deepctr_nomask(layer, args, kwargs):
    x = _first(args, kwargs)
    return ("identity", x, {}) if not isinstance(x, (list, tuple)) else None


@register_adapter("deepctr.layers.utils._Add")
def _deepctr_add(layer, args, kwargs):
    x = _first(args, kwargs)
    return ("add", list(x), {}) if isinstance(x, (list, tuple)) and len(x) > 1 else None


@register_adapter("deepctr.layers.utils.Linear")
def _deepctr_linear(layer, args, kwargs):
    """Linear(mode 0): reduce_sum(sparse, -1, keepdims) [+ bias]; mode 2: + tensordot(dense, kernel)."""
    x = _first(args, kwargs)
    bias = layer.bias if getattr(layer, "use_bias", False) else None
    if layer.mode == 0:
        return "linear", [x], {"bias": bias, "dense": None}
    if layer.mode == 2 and isinstance(x, (list, tuple)) and len(x) == 2:
        return "linear", [x[0], x[1]], {"bias": bias, "dense": layer.kernel,
                                        "kernel_regularizer": tf.keras.regularizers.l2(layer.l2_reg)
                                        if layer.l2_reg else None}
    return None


@register_adapter("deepctr.layers.core.DNN")
def _deepctr_dnn(layer, args, kwargs):
    """DNN: its first kernel is the substituted Dense; DNNRest finishes the layer. A DNN with no
    hidden units (MMoE's default gate input) passes its input through: read through it."""
    if not layer.hidden_units:
        return ("identity", [_first(args, kwargs)], {}) if not layer.output_activation else None
    return "dense", _first(args, kwargs), {
        "units": layer.hidden_units[0], "kernel": layer.kernels[0], "bias": layer.bias[0], "activation": None,
        "rest": DNNRest(layer), "kernel_regularizer": tf.keras.regularizers.l2(layer.l2_reg) if layer.l2_reg else None,
        "bias_regularizer": None, "kernel_constraint": None, "trainable": layer.trainable}


def _takes_training(layer) -> bool:
    """Whether ``layer.call`` accepts ``training=`` (a parameter of that name, or **kwargs)."""
    params = inspect.signature(layer.call).parameters.values()
    return any(p.name == "training" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class DNNRest(tf.keras.layers.Layer):
    """DeepCTR DNN from after its first matmul + bias: the first layer's batch norm,
    activation and dropout, then every further layer, with the DNN's own variables."""

    def __init__(self, dnn, **kwargs):
        super().__init__(name=f"{dnn.name}_rest", **kwargs)
        n = len(dnn.hidden_units)
        self.kernels, self.biases = list(dnn.kernels[1:]), list(dnn.bias[1:])
        self.bn_layers = list(dnn.bn_layers) if dnn.use_bn else []
        self.activation_layers = list(dnn.activation_layers)
        self.dropout_layers = list(dnn.dropout_layers)
        self.use_bn, self.layers_count, self.output_activation = dnn.use_bn, n, dnn.output_activation
        self.trainable = dnn.trainable
        if dnn.l2_reg:                          # the DNN's penalty on its other kernels stays replicated
            penalty = tf.keras.regularizers.l2(dnn.l2_reg)
            for k in self.kernels:
                self.add_loss(lambda k=k: penalty(k))

    def call(self, fc, training=None):
        for i in range(self.layers_count):
            if i > 0:
                fc = tf.nn.bias_add(tf.tensordot(fc, self.kernels[i - 1], axes=(-1, 0)), self.biases[i - 1])
            if self.use_bn:
                fc = self.bn_layers[i](fc, training=training)
            if _takes_training(self.activation_layers[i]):
                fc = self.activation_layers[i](fc, training=training)
            else:                               # an activation layer whose call() has no training argument
                fc = self.activation_layers[i](fc)
            fc = self.dropout_layers[i](fc, training=training)
        if self.output_activation:
            fc = tf.keras.layers.Activation(self.output_activation)(fc)
        return fc

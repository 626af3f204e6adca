"""The few Keras-private attributes DES touches outside the graph IR (des.graph.ir): a layer's weight
lists, its registered weight penalties and its cached call signature, an optimizer's slot
creation and hyperparameters. Kept in one place so a Keras upgrade has one file to check.

    >>> import tensorflow as tf
    >>> layer = tf.keras.layers.Dense(2, kernel_regularizer="l2"); layer.build([None, 3])
    >>> penalties = take_weight_penalties(layer)     # the owner adds them to its loss instead
    >>> len(penalties), has_weight_penalties(layer)
    (1, False)
"""
from __future__ import annotations

import tensorflow as tf

# weight penalties that are sums over entries: split by rows or fields, the shares add up to the whole
SEPARABLE_PENALTIES = (tf.keras.regularizers.L1, tf.keras.regularizers.L2, tf.keras.regularizers.L1L2)


def take_weight_penalties(layer) -> list:
    """Remove and return the weight penalties (regularizer losses) ``layer`` registered, so that
    whoever takes them adds them (des_ops.DESFirstLayer: the owner's share of the model's loss)."""
    taken = list(getattr(layer, "_callable_losses", []))
    if taken:
        layer._callable_losses = []
    return taken


def has_weight_penalties(layer) -> bool:
    return bool(getattr(layer, "_callable_losses", []))


def stop_penalty_gradients(layer) -> None:
    """``layer``'s weight penalties keep their value in the loss but give no gradient."""
    losses = getattr(layer, "_callable_losses", None)
    if losses:
        layer._callable_losses = [(lambda fn=fn: tf.stop_gradient(fn())) for fn in losses]


def release_variables(layer, names: list[str]) -> None:
    """Drop ``layer``'s variables ``names`` (a static table a process does not own) so that
    their memory is freed; the layer cannot be called afterwards."""
    for name in names:
        var = getattr(layer, name, None)
        if var is None:
            continue
        layer._trainable_weights = [w for w in layer._trainable_weights if w is not var]
        layer._non_trainable_weights = [w for w in layer._non_trainable_weights if w is not var]
        object.__setattr__(layer, name, None)
    take_weight_penalties(layer)                # their closures would keep the variables alive
    layer.des_released = True




def untrack(layer, name: str) -> None:
    """Delete ``layer.<name>`` and its checkpoint/SavedModel dependency (``del`` alone leaves
    TensorFlow's tracking of it, and a SavedModel would still serialize it)."""
    delattr(layer, name)
    if name in getattr(layer, "_self_unconditional_dependency_names", {}):
        layer._delete_tracking(name)


def compile_args(model) -> dict | None:
    """The arguments ``model`` was compiled with (optimizer, loss, metrics, ...), or None."""
    if not getattr(model, "_is_compiled", False) or getattr(model, "optimizer", None) is None:
        return None
    return model._get_compile_args()


def copy_optimizer(optimizer):
    """(a new optimizer of ``optimizer``'s class and configuration, a note for the report). TFRA's
    ``DynamicEmbeddingOptimizer`` patches the instance it wraps, which ``from_config`` does not
    copy: the copy is wrapped again, with ``synchronous=False`` (DES sums the gradients that need
    it; TFRA's own Horovod allreduce would mix the different kernel blocks the processes own)."""
    copy = type(optimizer).from_config(optimizer.get_config())
    if not hasattr(optimizer, "_custom_sync"):
        return copy, ""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    copy = de.DynamicEmbeddingOptimizer(copy, bp_v2=getattr(optimizer, "_bp_v2", False), synchronous=False)
    return copy, ("; wrapped in TFRA's DynamicEmbeddingOptimizer"
                  + (" (synchronous=False: DES sums the gradients that need summing)" if optimizer._custom_sync else ""))


def input_spec_of(model, sample=None):
    """The nested tf.TensorSpec of ``model``'s inputs: from ``sample`` (a batch), else from the
    spec Keras kept when the model was first called, else None."""
    if sample is not None:
        return tf.nest.map_structure(lambda t: tf.TensorSpec([None, *tf.convert_to_tensor(t).shape[1:]],
                                                             tf.convert_to_tensor(t).dtype), sample)
    spec = getattr(model, "_saved_model_inputs_spec", None)
    return tf.nest.map_structure(lambda s: tf.TensorSpec([None, *s.shape[1:]], s.dtype), spec) if spec else None


def refresh_call_signature(layer) -> None:
    """After ``layer.__class__`` was swapped, let Keras read the new ``call``'s arguments
    (so that it passes ``training``)."""
    layer._init_call_fn_args()


def creates_weights_ahead(optimizer) -> bool:
    """Whether ``create_optimizer_weights`` can create ``optimizer``'s slots before its first step
    (legacy Keras optimizers; the new ones build themselves at their first apply_gradients)."""
    return hasattr(optimizer, "_create_all_weights")


def create_optimizer_weights(optimizer, variables: list) -> None:
    """Create a (legacy) Keras optimizer's slots and hyperparameters for ``variables`` now,
    as its first apply_gradients would."""
    optimizer._create_all_weights(variables)


def plain_sgd_learning_rate(optimizer):
    """The learning-rate tensor of a legacy Keras SGD without momentum or Nesterov, else None."""
    plain = isinstance(optimizer, tf.keras.optimizers.legacy.SGD) and not optimizer._momentum \
        and not optimizer.nesterov
    return optimizer._get_hyper("learning_rate", tf.float32) if plain else None


def autograph_as_keras_decides():
    """A context in which Keras converts a layer's ``call`` with autograph as it does outside any
    function (TF-private: autograph's control status). The DES layer's own ``call`` is plain
    TensorFlow and not converted (converting it, and all it calls, took ~4 s of a DeepFM's first
    step); the user layers it calls (des.compiler.functional.FieldChains) must still be, since their Python
    control flow may depend on tensors."""
    from tensorflow.python.autograph.core import ag_ctx
    return ag_ctx.ControlStatusCtx(status=ag_ctx.Status.ENABLED)

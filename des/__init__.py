"""DES: Distributed Equivalent Substitution for tf.keras CTR models.

    >>> import des
    >>> model, report = des.transform(model)     # under mpirun: Horovod world; else size 1
    >>> print(report)

Backends (TensorFlow, Horovod, TFRA) are imported lazily.
"""
import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"


def transform(model, **kwargs):
    """Substitute the weights-rich first layers of ``model``; see des.compiler.transform."""
    from des.compiler import transform as _transform
    return _transform(model, **kwargs)


def __getattr__(name):
    """Lazily: des.TransformError, des.make_keyed (TFRA tables with key-deterministic new rows),
    des.register_adapter (map a third-party layer to canonical math)."""
    if name == "TransformError":
        from des.compiler import TransformError
        return TransformError
    if name == "make_keyed":
        from des.state import make_keyed
        return make_keyed
    if name == "register_adapter":
        from des.adapters import register_adapter
        return register_adapter
    raise AttributeError(name)

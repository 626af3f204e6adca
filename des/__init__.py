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

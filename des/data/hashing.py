"""Stable 64-bit feature ids.

An id is FarmHash Fingerprint64 of ``"<field>\\x1f<raw value>"`` (TensorFlow's
``to_hash_bucket_fast``), reduced to the non-negative int64 range. It does not depend on
the process, the run or ``PYTHONHASHSEED`` (never Python's ``hash()``), so every
process of a job maps a value to the same id.

    >>> int(feature_id("C1", "68fd1e64")) == int(feature_id("C1", "68fd1e64"))
    True
"""
from __future__ import annotations

import tensorflow as tf

_BUCKETS = 2**63 - 1
SEP = "\x1f"


def feature_ids(field_names, values: tf.Tensor) -> tf.Tensor:
    """ids[..., j] = id of (field_names[j], values[..., j]); values: string tensor [..., F]."""
    prefix = tf.constant([f"{n}{SEP}" for n in field_names])
    return tf.strings.to_hash_bucket_fast(tf.strings.join([tf.broadcast_to(prefix, tf.shape(values)), values]), _BUCKETS)


def feature_id(field: str, value: str) -> tf.Tensor:
    """The id of one (field, raw value) pair, as an int64 scalar tensor."""
    return feature_ids([field], tf.constant([value]))[0]

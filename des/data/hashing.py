"""Stable feature ids (55 bits).

An id is FarmHash Fingerprint64 of ``"<field>\\x1f<raw value>"`` (TensorFlow's
``to_hash_bucket_fast`` into 2**63 - 1 buckets), keeping its low ``ID_BITS`` = 55 bits: ids lie in
[0, 2**55), so a fused table (des_ops.fused) can store up to 256 fields' rows under one int64 key
each (two values of one field collide with probability 2**-55; for 10**8 distinct values of one
field about 0.14 pairs are expected). Checkpoints of format 2 held the 63-bit ids; restoring one
keeps each id's low 55 bits (des.checkpoint), which is this rule. It does not depend on
the process, the run or ``PYTHONHASHSEED`` (never Python's ``hash()``), so every
process of a job maps a value to the same id.

    >>> int(feature_id("C1", "68fd1e64")) == int(feature_id("C1", "68fd1e64"))
    True
"""
from __future__ import annotations

import tensorflow as tf

from models.spec import ID_MASK

_BUCKETS = 2**63 - 1
SEP = "\x1f"


def hash_ids(strings: tf.Tensor) -> tf.Tensor:
    """The ids of already prefixed strings ``"<field>\\x1f<value>"``: int64 in [0, 2**ID_BITS)."""
    return tf.bitwise.bitwise_and(tf.strings.to_hash_bucket_fast(strings, _BUCKETS), tf.constant(ID_MASK, tf.int64))


def feature_ids(field_names, values: tf.Tensor) -> tf.Tensor:
    """ids[..., j] = id of (field_names[j], values[..., j]); values: string tensor [..., F]."""
    prefix = tf.constant([f"{n}{SEP}" for n in field_names])
    return hash_ids(tf.strings.join([tf.broadcast_to(prefix, tf.shape(values)), values]))


def feature_id(field: str, value: str) -> tf.Tensor:
    """The id of one (field, raw value) pair, as an int64 scalar tensor."""
    return feature_ids([field], tf.constant([value]))[0]

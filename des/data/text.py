"""Byte-level checks shared by the text formats."""
from __future__ import annotations

import tensorflow as tf


def utf8_ok(lines: tf.Tensor) -> tf.Tensor:
    """bool [B]: the line is valid UTF-8. ASCII lines (the usual case) cost one RE2 scan; only
    the others are transcoded and compared.

    >>> utf8_ok(tf.constant([b"1 0:a:1", b"caf\\xc3\\xa9", b"\\xff"])).numpy()
    array([ True,  True, False])
    """
    ascii_only = tf.strings.regex_full_match(lines, r"[\x00-\x7f]*")

    def check_others():
        at = tf.where(tf.logical_not(ascii_only))
        others = tf.gather_nd(lines, at)
        fixed = tf.strings.unicode_transcode(others, "UTF-8", "UTF-8", errors="replace",
                                             replacement_char=0xFFFD)
        return tf.tensor_scatter_nd_update(ascii_only, at, tf.equal(fixed, others))

    return tf.cond(tf.reduce_all(ascii_only), lambda: ascii_only, check_others)

"""What the text formats share: byte-level checks and the wanted-inputs rule."""
from __future__ import annotations

import tensorflow as tf

from des.data.hashing import feature_ids
from models.spec import PAD_ID


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


class TextParser:
    """What every text parser shares: ``wanted``, the inputs its caller reads (None: all). Every
    line is still split and checked in full, so every process finds the same bad lines; only the
    wanted inputs' values become ids (the part of a parse that grows with the inputs read), the
    others are PAD_ID (numeric: 0), as the columnar reader fills the columns it does not read."""

    wanted: frozenset[str] | None = None

    def reads(self, name: str) -> bool:
        return self.wanted is None or name in self.wanted

    def ids(self, names: list[str], values: tf.Tensor) -> dict[str, tf.Tensor]:
        """{name: ids [B]} of the string columns ``values`` [B, len(names)]: hashed if wanted."""
        read = [j for j, n in enumerate(names) if self.reads(n)]
        got = feature_ids([names[j] for j in read], tf.gather(values, read, axis=1)) if read else None
        pad = tf.fill(tf.shape(values)[:1], tf.constant(PAD_ID, tf.int64))
        return {n: got[:, read.index(j)] if j in read else pad for j, n in enumerate(names)}

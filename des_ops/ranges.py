"""Key ranges of one static table, held by their owner: a Keras ``Embedding(P * V, K)`` read as
``table(ids + offsets)`` (DLRM / pytorch-fm ports) holds P fields as P key ranges, and
des.transform gives each range to the owner of its field. An owner keeps only the rows of its
ranges, in one [rows, K] variable (ranges in key order), and looks up its positions' ids.

    >>> import numpy as np, tensorflow as tf
    >>> full = np.arange(12, dtype=np.float32).reshape(6, 2)          # 3 fields of 2 keys: [0,2) [2,4) [4,6)
    >>> mine = RangeEmbedding([(4, 6), (0, 2)], np.concatenate([full[4:6], full[0:2]]), name="ranges")  # positions 2, 0
    >>> mine(tf.constant([[5, 1], [4, 0]], tf.int64)).numpy()[:, :, 0].tolist()   # ids + offsets, those positions
    [[10.0, 2.0], [8.0, 0.0]]
    >>> mine.keys().tolist(), mine.embeddings.shape.as_list()                    # held: 4 rows, not 6
    ([0, 1, 4, 5], [4, 2])
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf


class RangeEmbedding(tf.keras.layers.Layer):
    """The rows of ``ranges`` ([start, stop) of global keys, one per owned position, in the order
    the positions are read) of a static table, given as ``rows``: each range's rows in that order
    (``rows_of(full, ranges)``); call on ids [B, len(ranges)]
    (ids + offsets) gives [B, len(ranges), K]. An id outside its position's range is an error
    naming the table: the untouched model would have read another field's row there."""

    des_range_table = True

    def __init__(self, ranges: list[tuple[int, int]], rows: np.ndarray, table: str = "", **kwargs):
        super().__init__(**kwargs)
        ranges = [(int(a), int(b)) for a, b in ranges]
        self._message = (f"des: table {table or self.name} holds one field per key range "
                         f"({' '.join(f'[{a}, {b})' for a, b in ranges)}: ids + offsets) and an id fell outside the "
                         f"range of its field, where the untouched model would read a row of another field: the ids "
                         f"of each field must be below its vocabulary size")
        self.ranges = ranges
        self.table = table or self.name
        self.dim = int(rows.shape[1])
        order = sorted(range(len(self.ranges)), key=lambda i: self.ranges[i][0])
        base, at = [0] * len(self.ranges), 0
        for i in order:                      # rows in key order: a static slot's rows match keys()
            base[i] = at
            at += self.ranges[i][1] - self.ranges[i][0]
        self._starts = np.array([a for a, _ in self.ranges], np.int64)
        self._stops = np.array([b for _, b in self.ranges], np.int64)
        self._shift = np.array(base, np.int64) - self._starts
        at = np.cumsum([0] + [b - a for a, b in self.ranges])
        rows = np.concatenate([rows[at[i]:at[i + 1]] for i in order]) if order else np.zeros([0, self.dim], np.float32)
        # one variable name per table: optimizer slots are found by name (des.runtime.state)
        self.embeddings = self.add_weight(f"{self.name}_rows", shape=rows.shape, dtype=tf.float32,
                                          initializer=tf.keras.initializers.Constant(rows))

    def keys(self) -> np.ndarray:
        """The global keys of the rows held, in the variable's row order."""
        return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in sorted(self.ranges)] or
                              [np.zeros([0], np.int64)])

    def held(self, keys: np.ndarray) -> np.ndarray:
        """Mask of ``keys`` that fall in one of this owner's ranges."""
        keys = np.asarray(keys, np.int64)
        return np.any((keys[:, None] >= self._starts) & (keys[:, None] < self._stops), axis=1)

    def local(self, keys: np.ndarray) -> np.ndarray:
        """Row indices of held global ``keys``."""
        order = np.argsort(self._starts)
        pos = order[np.searchsorted(self._starts[order], keys, side="right") - 1]
        return keys + self._shift[pos]

    def call(self, ids):
        ids = tf.cast(ids, tf.int64)
        outside = tf.logical_or(ids < self._starts, ids >= self._stops)
        check = tf.debugging.Assert(tf.logical_not(tf.reduce_any(outside)), [self._message])
        with tf.control_dependencies([check]):
            return tf.gather(self.embeddings, ids + self._shift)


def rows_of(full: np.ndarray, ranges: list[tuple[int, int]]) -> np.ndarray:
    """The rows of ``ranges`` of the table ``full``, range after range."""
    return np.concatenate([full[a:b] for a, b in ranges] or [np.zeros([0, full.shape[1]], full.dtype)])

"""Layers the reference models are built from.

FieldEmbedding is a TFRA dynamic embedding (unbounded vocabulary) whose new rows are
initialised from (field, key, seed) only, never from insertion order or process:

    >>> emb = FieldEmbedding(field="C1", dim=8, seed=0)
    >>> v = emb(tf.constant([12345, 7], tf.int64))          # [2, 8]
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

from models.spec import PAD_ID

_names_used: dict[str, int] = {}


def table_name(base: str) -> str:
    """``base`` the first time in this process, then ``base_1``, ``base_2``...

    TFRA keys checkpoints by table name and silently shares tables of the same name, so the
    first model built in a process gets stable names (a new process restores them) and
    later ones get unique names."""
    n = _names_used.get(base, 0)
    _names_used[base] = n + 1
    return base if n == 0 else f"{base}_{n}"
_U64 = tf.uint64


def _splitmix64(x: tf.Tensor) -> tf.Tensor:
    x = x + tf.constant(0x9E3779B97F4A7C15, _U64)
    x = (x ^ tf.bitwise.right_shift(x, tf.constant(30, _U64))) * tf.constant(0xBF58476D1CE4E5B9, _U64)
    x = (x ^ tf.bitwise.right_shift(x, tf.constant(27, _U64))) * tf.constant(0x94D049BB133111EB, _U64)
    return x ^ tf.bitwise.right_shift(x, tf.constant(31, _U64))


def table_salt(field: str, dim: int, seed: int) -> int:
    """A 64-bit salt for the rows of one (field, width, seed) table."""
    fp = tf.strings.to_hash_bucket_fast(tf.constant(f"{field}|{dim}|{seed}"), 2**63 - 1)
    return int(fp.numpy())


def key_init(keys: tf.Tensor, salt: int, dim: int, scale: float) -> tf.Tensor:
    """Rows uniform in [-scale, scale) that depend only on (salt, key); keys: int64 [n]."""
    if scale == 0.0:
        return tf.zeros([tf.shape(keys)[0], dim], tf.float32)
    k = tf.bitcast(keys, _U64)
    j = tf.cast(tf.range(dim, dtype=tf.int64), _U64) + tf.constant(salt, _U64)
    x = _splitmix64(_splitmix64(k)[:, None] ^ _splitmix64(j)[None, :])
    u = tf.cast(tf.bitwise.right_shift(x, tf.constant(11, _U64)), tf.float64) * (2.0 ** -53)
    return tf.cast((2.0 * u - 1.0) * scale, tf.float32)


def key_init_rows(keys: tf.Tensor, salts: tf.Tensor, dim: int, scales: tf.Tensor) -> tf.Tensor:
    """``key_init`` with a salt (int64 [n]) and a scale (float64 [n]) per key, for a table that
    holds the rows of several fields: row i has the bits ``key_init(keys[i:i+1], salts[i], dim,
    scales[i])`` gives (zero scales give +0.0, as ``key_init`` does)."""
    k = tf.bitcast(keys, _U64)
    j = tf.cast(tf.range(dim, dtype=tf.int64), _U64)[None, :] + tf.bitcast(salts, _U64)[:, None]
    x = _splitmix64(_splitmix64(k)[:, None] ^ _splitmix64(j))
    u = tf.cast(tf.bitwise.right_shift(x, tf.constant(11, _U64)), tf.float64) * (2.0 ** -53)
    return tf.cast((2.0 * u - 1.0) * scales[:, None] + 0.0, tf.float32)


def only_shapes_wanted(layer) -> bool:
    """True while Keras calls ``layer`` on placeholders only to learn the shape and type of its
    output, to build a functional model: a table then returns zeros of its output's shape instead of
    tracing its lookup (~40 ms a table: ~3 s of building a 39-field DeepFM). Keras-private: Keras 2
    makes that call in a scratch graph it names after the layer."""
    return getattr(tf.compat.v1.get_default_graph(), "name", None) == f"{layer.name}_scratch_graph"


def _read_through_shadow(shadow, ids: tf.Tensor, rows: tf.Tensor) -> tf.Tensor:
    """What TFRA's ``shadow_ops.embedding_lookup(shadow, ids)`` returns in training, ``rows`` read
    through ``shadow`` (so that the optimizer sees the ids and their gradients), with ``rows`` given
    instead of read from the table a second time. TFRA-private: ``ShadowVariable.prefetch_values``
    and ``_reset_ids`` (TFRA 0.7)."""
    with tf.control_dependencies([shadow._reset_ids(ids)]):
        shadow.prefetch_values = lambda update=False: rows        # for this one read
        try:
            return shadow.read_value(do_prefetch=True)
        finally:
            del shadow.prefetch_values


class FieldEmbedding(de.keras.layers.Embedding):
    """One field's dynamic table: ids [B] -> [B, dim]; multi-valued ids [B, L] -> sum-pooled [B, dim];
    ``[ids, weights]`` [B, L] each -> sum_l weights * row(ids).

    In training, keys not yet in the table are inserted with ``key_init`` before the lookup;
    in inference they read ``key_init`` without being inserted.
    """
    des_embedding = True  # des.transform treats it as one field's table

    def __init__(self, field: str, dim: int, seed: int = 0, init_scale: float = 0.05,
                 name: str | None = None, linear: bool = False, **kwargs):
        self.field, self.dim, self.seed, self.init_scale = field, int(dim), int(seed), float(init_scale)
        name = table_name(name or f"emb{dim}_{field}")
        super().__init__(self.dim, initializer=tf.keras.initializers.Zeros(), name=name, **kwargs)
        self.salt = table_salt(field, self.dim, self.seed)
        self.linear = bool(linear)  # a weight of the model's linear part (see models.optim)
        if self.linear:
            self.shadow.des_linear_part = True

    @tf.autograph.experimental.do_not_convert   # plain TF ops: autograph would only slow tracing
    def call(self, inputs, training=None):
        ids, weights = (inputs[0], inputs[1]) if isinstance(inputs, (list, tuple)) else (inputs, None)
        ids = tf.convert_to_tensor(ids, tf.int64)
        if only_shapes_wanted(self):
            return tf.zeros(tf.stack([tf.shape(ids)[0], self.dim]))
        uniq, idx, counts = self.unique_keys(tf.reshape(ids, [-1]), training)
        rows = self.distinct_rows(uniq, training, multi_valued=ids.shape.rank == 2, counts=counts)
        return pool(tf.gather(rows, idx), ids, weights, self.dim)

    des_row_state = None     # des_ops.row_policy.RowState: admission and eviction, when a policy is set

    def unique_keys(self, keys: tf.Tensor, training) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor | None]:
        """(distinct keys, index of each key among them, occurrences of each or None): the
        occurrences only when a row policy counts them (des_ops.row_policy)."""
        if training and self.des_row_state is not None:
            return tf.unique_with_counts(keys)
        uniq, idx = tf.unique(keys)
        return uniq, idx, None

    def distinct_rows(self, uniq: tf.Tensor, training, multi_valued: bool, counts=None) -> tf.Tensor:
        """The lookup hook: rows [n, dim] of the distinct ids ``uniq`` of a batch (in the order
        of its tf.unique; ``counts``: their occurrences, for a row policy). Sharded and cached
        tables override it; ``call`` stays the same."""
        return self.rows(uniq, training, skip_pad=multi_valued, counts=counts)

    def rows(self, uniq: tf.Tensor, training, skip_pad: bool = False, counts=None) -> tf.Tensor:
        """Rows of distinct keys ``uniq`` [n] -> [n, dim]; PAD_ID rows are zero when ``skip_pad``.

        In training, missing keys are first inserted with ``key_init`` (with a row policy: those
        it admits, des_ops.row_policy); in inference they read ``key_init`` and are not inserted."""
        if skip_pad:
            real = tf.where(uniq != PAD_ID)
            found = self.rows(tf.gather_nd(uniq, real), training,
                              counts=None if counts is None else tf.gather_nd(counts, real))
            return tf.scatter_nd(real, found, tf.stack([tf.size(uniq, tf.int64), self.dim]))
        values, exists = self.params.lookup(uniq, return_exists=True)
        missing = tf.where(tf.logical_not(exists))
        new = tf.gather_nd(uniq, missing)
        init = self.new_rows(new)                  # start rows for the keys not held yet only
        rows = tf.tensor_scatter_nd_update(values, missing, init)
        if not training:
            return rows
        if self.des_row_state is not None:
            return self.des_row_state.train_rows(uniq, counts, exists, rows,
                                                 lambda keys, held: _read_through_shadow(self.shadow, keys, held))
        with tf.control_dependencies([self.params.upsert(new, init)]):
            return _read_through_shadow(self.shadow, uniq, rows)

    def new_rows(self, uniq: tf.Tensor) -> tf.Tensor:
        """The rows keys ``uniq`` start from (``key_init`` of this field's salt)."""
        return key_init(uniq, self.salt, self.dim, self.init_scale)

    def compute_output_shape(self, input_shape):
        first = input_shape[0] if isinstance(input_shape, (list, tuple)) else input_shape
        return tf.TensorShape([tf.TensorShape(first)[0], self.dim])

    def get_config(self):
        return {"field": self.field, "dim": self.dim, "seed": self.seed,
                "init_scale": self.init_scale, "name": self.name, "linear": self.linear}


def pool(flat_rows: tf.Tensor, ids: tf.Tensor, weights: tf.Tensor | None, dim: int) -> tf.Tensor:
    """Rows of ``ids`` (flattened, [n, dim]) -> [B, dim]: ids [B] as is; ids [B, L] summed over L,
    times ``weights`` [B, L] if given (padding rows are zero, so they add nothing)."""
    out = tf.reshape(flat_rows, tf.concat([tf.shape(ids), [dim]], 0))
    if ids.shape.rank != 2:
        return out
    if weights is not None:
        out = out * tf.cast(weights, out.dtype)[..., None]
    return tf.reduce_sum(out, axis=1)


class Bias(tf.keras.layers.Layer):
    """x + b with a scalar trainable b (the global bias of LR / FM)."""

    def build(self, input_shape):
        self.b = self.add_weight("b", shape=(1,), initializer="zeros")
        self.b.des_linear_part = True  # see models.optim

    @tf.autograph.experimental.do_not_convert   # plain TF ops: autograph would only slow tracing
    def call(self, x, training=None):   # ``training``: Keras passes it through the decorator
        return x + self.b


class FMInteraction(tf.keras.layers.Layer):
    """FM second order: [B, F, k] -> 0.5 * sum_k((sum_f v)^2 - sum_f v^2), shape [B, 1].

    Declares itself to DES (``des_substitute``) so des.transform can replace it.
    """

    des_substitute = "fm_interaction"

    @tf.autograph.experimental.do_not_convert   # plain TF ops: autograph would only slow tracing
    def call(self, stacked, training=None):   # ``training``: Keras passes it through the decorator
        s = tf.reduce_sum(stacked, axis=1)
        return 0.5 * tf.reduce_sum(tf.square(s) - tf.reduce_sum(tf.square(stacked), axis=1),
                                   axis=1, keepdims=True)

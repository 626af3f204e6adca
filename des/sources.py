"""Table sources: the embedding layers des.transform recognises as one field's table.

    >>> src = source_of(layer)            # None if the layer is not a table
    >>> src.dim(layer), src.rows(layer)   # width, rows held now

A source knows a layer's width, how to read and write its rows as (key -> row) for the
equivalence harness and the rank-0 broadcast, and how a process that does not own the
field releases the rows. Three are registered, first match wins:

- ``FieldEmbedding`` (this project; TFRA dynamic table with key-deterministic new rows);
- TFRA ``de.keras.layers.Embedding``: dynamic table. New rows come from its initializer at
  their first lookup, which is random per draw; ``keyed`` (applied by des.transform) makes
  them depend on (table, key, seed) only, as DES's equivalence needs;
- ``tf.keras.layers.Embedding``: a static [V, K] variable. The owner keeps it (and its
  optimizer slots); the other processes drop it.

A layer of the user's may declare ``des_embedding = True`` and have ``dim`` and ``params``
(a TFRA variable) to be taken as a dynamic table.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

SOURCES: list["TableSource"] = []


class TableSource:
    name = "base"
    dynamic = True

    def claims(self, layer) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def dim(self, layer) -> int:
        return int(layer.dim)

    def field(self, layer) -> str | None:
        """A field name the layer declares (else des.fields names it after the ids input)."""
        return getattr(layer, "field", None)

    def rows(self, layer) -> float:
        return float(layer.params.size().numpy())

    def export(self, layer) -> tuple[np.ndarray, np.ndarray]:
        keys, values = layer.params.export()
        return keys.numpy(), values.numpy()

    def load(self, layer, keys: np.ndarray, values: np.ndarray) -> None:
        """Replace the rows by (keys, values)."""
        layer.params.clear()
        if len(keys):
            layer.params.upsert(tf.constant(keys, layer.params.key_dtype),
                                tf.constant(values, layer.params.value_dtype))

    def release(self, layer) -> None:
        layer.params.clear()

    def keyed(self, layer, seed: int) -> None:
        """Make new rows depend on (table, key, seed) only (already so for FieldEmbedding)."""


def register(cls: type) -> type:
    """Class decorator: add one instance of the source to the registry (first match wins)."""
    SOURCES.append(cls())
    return cls


def source_of(layer) -> TableSource | None:
    for s in SOURCES:
        if s.claims(layer):
            return s
    return None


@register
class _FieldEmbedding(TableSource):
    name = "FieldEmbedding"

    def claims(self, layer):
        return bool(getattr(layer, "des_embedding", False))


def _tfra_embedding_class():
    try:
        from tensorflow_recommenders_addons import dynamic_embedding as de
    except ImportError:  # pragma: no cover - TFRA is a dependency
        return None
    return de.keras.layers.Embedding


@register
class _TFRAEmbedding(TableSource):
    """TFRA ``de.keras.layers.Embedding``: ids of any shape -> ids.shape + [embedding_size]."""
    name = "TFRA Embedding"

    def claims(self, layer):
        cls = _tfra_embedding_class()
        return cls is not None and type(layer) is cls or getattr(layer, "des_keyed_tfra", False)

    def dim(self, layer):
        return int(layer.embedding_size)

    def field(self, layer):
        return None

    def keyed(self, layer, seed: int) -> None:
        make_keyed(layer, seed)


@register
class _KerasEmbedding(TableSource):
    """``tf.keras.layers.Embedding``: a static [input_dim, output_dim] variable."""
    name = "Keras Embedding"
    dynamic = False

    def claims(self, layer):
        return isinstance(layer, tf.keras.layers.Embedding)

    def dim(self, layer):
        return int(layer.output_dim)

    def field(self, layer):
        return None

    def rows(self, layer):
        return float(layer.input_dim)

    def export(self, layer):
        if layer.embeddings is None:
            return np.zeros([0], np.int64), np.zeros([0, layer.output_dim], np.float32)
        values = layer.embeddings.numpy()
        return np.arange(len(values), dtype=np.int64), values

    def load(self, layer, keys, values):
        full = layer.embeddings.numpy()
        full[keys] = values
        layer.embeddings.assign(full)

    def release(self, layer):
        from des.ir import release_variables
        release_variables(layer, ["embeddings"])


def make_keyed(layer, seed: int = 0, scale: float | None = None) -> None:
    """Give a TFRA ``de.keras.layers.Embedding`` key-deterministic new rows: in training a
    missing key is inserted, before the lookup, with a row that depends only on (layer name,
    key, seed), uniform in [-scale, scale) where ``scale`` defaults to the spread of the layer's
    initializer (its maxval, or 2 x stddev); zeros stay zeros. In inference a missing key
    reads that row without being inserted.

        >>> make_keyed(emb, seed=0)       # des.transform does this to every TFRA table
    """
    from des.ir import refresh_call_signature
    from models.layers import key_init, table_salt
    if getattr(layer, "des_keyed_tfra", False):
        return
    init = layer.params.initializer
    if scale is None:
        cfg = init.get_config() if hasattr(init, "get_config") else {}
        if isinstance(init, (tf.keras.initializers.Zeros,)) or type(init).__name__ in ("Zeros", "zeros_initializer"):
            scale = 0.0
        elif "maxval" in cfg:
            scale = float(abs(cfg["maxval"]))
        elif "stddev" in cfg:
            scale = 2.0 * float(cfg["stddev"])
        else:
            scale = 0.05
    base = type(layer)
    salt = table_salt(layer.name, int(layer.embedding_size), seed)
    dim = int(layer.embedding_size)

    class Keyed(base):
        des_keyed_tfra = True

        def call(self, ids, training=None):
            ids = tf.convert_to_tensor(ids)
            flat = tf.cast(tf.reshape(ids, [-1]), tf.int64)
            uniq, idx = tf.unique(flat)
            values, exists = self.params.lookup(uniq, return_exists=True)
            fresh = key_init(uniq, salt, dim, scale)
            shape = tf.concat([tf.shape(ids), [dim]], 0)
            if training:
                missing = tf.logical_not(exists)
                insert = self.params.upsert(tf.boolean_mask(uniq, missing), tf.boolean_mask(fresh, missing))
                with tf.control_dependencies([insert]):
                    return super().call(ids)
            rows = tf.where(exists[:, None], values, fresh)
            return tf.reshape(tf.gather(rows, idx), shape)

    Keyed.__name__ = f"Keyed{base.__name__}"
    layer.__class__ = Keyed
    refresh_call_signature(layer)

"""Table sources: the embedding layers des.transform recognises as one field's table.

    >>> import tensorflow as tf
    >>> from models.layers import FieldEmbedding
    >>> layer = FieldEmbedding(field="C1", dim=8, seed=0)
    >>> _ = layer(tf.constant([12345, 7, 7], tf.int64), training=True)      # training inserts new keys
    >>> src = source_of(layer)            # None if the layer is not a table
    >>> src.name, src.dim(layer), src.rows(layer)   # width, rows held now
    ('FieldEmbedding', 8, 2.0)
    >>> source_of(tf.keras.layers.Embedding(100, 8)).name, source_of(tf.keras.layers.Dense(8))
    ('Keras Embedding', None)

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

from des_ops.keras_internals import refresh_call_signature, release_variables
from models.layers import key_init, table_salt

SOURCES: list["TableSource"] = []


class TableSource:
    name = "base"
    dynamic = True
    partial = False          # holds only some keys of its table: ``held`` says which (a restore keeps those)

    def claims(self, layer) -> bool:  # pragma: no cover - interface
        raise NotImplementedError

    def dim(self, layer) -> int:
        return int(layer.dim)

    def field(self, layer) -> str | None:
        """A field name the layer declares (else des.graph.fields names it after the ids input)."""
        return getattr(layer, "field", None)

    def rows(self, layer) -> float:
        fused = fused_of(layer)
        if fused:
            return float(len(fused[0].field_rows(fused[1])[0]))
        return float(layer.params.size().numpy())

    def declared_rows(self, layer) -> float:
        """The rows the layer was declared to hold (a TFRA table's ``init_capacity``), 0 if none:
        a dynamic table starts empty, so the plan counts at least these."""
        return float(getattr(getattr(layer, "params", None), "init_size", 0) or 0)

    def export(self, layer) -> tuple[np.ndarray, np.ndarray]:
        fused = fused_of(layer)
        if fused:
            return fused[0].field_rows(fused[1])
        if int(layer.params.size()) == 0:             # a new table (a model just built): no export
            return (np.zeros([0], layer.params.key_dtype.as_numpy_dtype),
                    np.zeros([0, self.dim(layer)], layer.params.value_dtype.as_numpy_dtype))
        keys, values = layer.params.export()
        return keys.numpy(), values.numpy()

    def load(self, layer, keys: np.ndarray, values: np.ndarray) -> None:
        """Replace the rows by (keys, values)."""
        fused = fused_of(layer)
        if fused:
            fused[0].load_field(fused[1], keys, values)
            return
        layer.params.clear()
        if len(keys):
            layer.params.upsert(tf.constant(keys, layer.params.key_dtype),
                                tf.constant(values, layer.params.value_dtype))

    def release(self, layer) -> None:
        fused = fused_of(layer)
        self.clear_rows(layer, fused[0].params if fused else layer.params)

    def reacquire(self, layer) -> None:
        """Give a released table its storage back (empty), so that rows can be loaded into it
        (des.runtime.saving gathers a whole model on rank 0). A dynamic table keeps its storage."""

    def trainable(self, layer):
        """The variable the optimizer updates for this table's rows (TFRA: a shadow, maybe of the
        fused table that holds them; Keras: the matrix)."""
        fused = fused_of(layer)
        return fused[0].shadow if fused else layer.shadow

    def slot_rows(self, layer, params, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(rows, exists) of ``keys`` in ``params``, an optimizer slot of this table's rows (a fused
        table: its part of the slot's rows)."""
        fused = fused_of(layer)
        if fused:
            return fused[0].member_slot_rows(fused[1], params, keys)
        found, exists = params.lookup(tf.constant(keys, params.key_dtype), return_exists=True)
        return found.numpy(), exists.numpy()

    def load_slot(self, layer, params, keys: np.ndarray, values: np.ndarray) -> None:
        """Make ``params``, an optimizer slot of this table's rows, hold exactly ``keys`` -> ``values``."""
        fused = fused_of(layer)
        if fused:
            fused[0].load_member(fused[1], params, keys, values, rows=False)
            return
        params.clear()
        if len(keys):
            params.upsert(tf.constant(keys, params.key_dtype), tf.constant(values, params.value_dtype))

    def clear_rows(self, layer, params) -> None:
        """Remove this table's rows from ``params`` (its rows or an optimizer slot of them)."""
        fused = fused_of(layer)
        if fused:
            fused[0].clear_field(params, fused[1])
        else:
            params.clear()

    def held(self, layer, keys: np.ndarray) -> np.ndarray:
        """Mask of ``keys`` this layer holds rows for (a ``partial`` source, or a TFRA table split
        by key stripe, ``des_key_stripe`` (r, N): keys k mod N == r; else every key)."""
        stripe = getattr(layer, "des_key_stripe", None)
        if stripe is not None:
            return np.mod(np.asarray(keys, np.int64), stripe[1]) == stripe[0]
        return np.ones(len(keys), bool)

    def holds_part(self, layer) -> bool:
        """True when ``layer`` holds only some keys of its table (``held`` says which)."""
        return self.partial or getattr(layer, "des_key_stripe", None) is not None

    def keyed(self, layer, seed: int, name: str) -> None:
        """Make new rows depend on (``name``, key, seed) only (already so for FieldEmbedding);
        ``name`` is the table's place in the graph, the same in every build of the model code."""


def fused_of(layer):
    """(fused table, slot) when des.transform moved ``layer``'s rows into a des_ops.fused.FusedTable."""
    return getattr(layer, "des_fused", None)


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


@register
class _TFRAEmbedding(TableSource):
    """TFRA ``de.keras.layers.Embedding``: ids of any shape -> ids.shape + [embedding_size]."""
    name = "TFRA Embedding"

    def claims(self, layer):
        if getattr(layer, "des_keyed_tfra", False):
            return True
        try:
            from tensorflow_recommenders_addons import dynamic_embedding as de
        except ImportError:  # pragma: no cover - TFRA is a dependency
            return False
        return type(layer) in (de.keras.layers.Embedding, de.keras.layers.SquashedEmbedding)

    def dim(self, layer):
        return int(layer.embedding_size)

    def field(self, layer):
        return None

    def keyed(self, layer, seed: int, name: str) -> None:
        _key_layer(layer, seed, name)


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
        release_variables(layer, ["embeddings"])

    def reacquire(self, layer):
        if layer.embeddings is None:
            layer.embeddings = layer.add_weight(shape=(layer.input_dim, layer.output_dim), initializer="zeros",
                                                name="embeddings", dtype=layer.dtype)

    def trainable(self, layer):
        return layer.embeddings


@register
class _RangeEmbedding(TableSource):
    """des_ops.ranges.RangeEmbedding: an owner's key ranges of a static table that holds several
    fields through offsets. Its rows are exported and loaded under the table's global keys (the
    untouched Keras Embedding's row numbers), so saves and checkpoints mean what the untouched
    model's do; ``held`` says which keys of a checkpoint are this owner's."""
    name = "Keras Embedding by key range"
    dynamic = False
    partial = True

    def claims(self, layer):
        return bool(getattr(layer, "des_range_table", False))

    def field(self, layer):
        return None

    def rows(self, layer):
        return float(len(layer.keys()))

    def export(self, layer):
        return layer.keys(), layer.embeddings.numpy()

    def load(self, layer, keys, values):
        keys = np.asarray(keys, np.int64)
        mine = layer.held(keys)
        full = layer.embeddings.numpy()
        full[layer.local(keys[mine])] = np.asarray(values)[mine]
        layer.embeddings.assign(full)

    def held(self, layer, keys: np.ndarray) -> np.ndarray:
        return layer.held(keys)

    def release(self, layer):
        release_variables(layer, ["embeddings"])

    def trainable(self, layer):
        return layer.embeddings


def _scale_of(init) -> float:
    cfg = init.get_config() if hasattr(init, "get_config") else {}
    if type(init).__name__ in ("Zeros", "zeros_initializer"):
        return 0.0
    if "maxval" in cfg:
        return float(abs(cfg["maxval"]))
    if "stddev" in cfg:
        return 2.0 * float(cfg["stddev"])
    return 0.05


def _key_layer(layer, seed: int, name: str) -> None:
    if getattr(layer, "des_keyed_tfra", False):
        return
    scale = _scale_of(layer.params.initializer)
    base = type(layer)
    dim = int(layer.embedding_size)
    salt = table_salt(name, dim, seed)
    squashed = base.__name__ == "SquashedEmbedding"
    layer.des_salt, layer.des_scale, layer.des_squashed = salt, scale, squashed    # des_ops.fused reads them

    class Keyed(base):
        des_keyed_tfra = True

        def call(self, ids, training=None):
            ids = tf.convert_to_tensor(ids)
            flat = tf.cast(tf.reshape(ids, [-1]), tf.int64)
            uniq, idx = tf.unique(flat)
            values, exists = self.params.lookup(uniq, return_exists=True)
            fresh = key_init(uniq, salt, dim, scale)
            if training:
                missing = tf.logical_not(exists)
                insert = self.params.upsert(tf.boolean_mask(uniq, missing), tf.boolean_mask(fresh, missing))
                with tf.control_dependencies([insert]):
                    return super().call(ids)
            rows = tf.where(exists[:, None], values, fresh)
            out = tf.reshape(tf.gather(rows, idx), tf.concat([tf.shape(ids), [dim]], 0))
            if squashed:
                from tensorflow_recommenders_addons.dynamic_embedding.python.keras.layers.embedding import (
                    reduce_pooling
                )
                out = reduce_pooling(out, combiner=self.combiner)
            return out

    Keyed.__name__ = base.__name__          # state keys (des.runtime.state) name layers by class: unchanged
    layer.__class__ = Keyed
    refresh_call_signature(layer)

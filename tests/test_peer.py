"""The TFRA peer of scripts/bench_peer.py (scripts/peer_tfra.py) reads the data as des.train's
models do: one key per (field, id) that never collides across fields, multi-valued fields pooled
with their weights and their padding left out - checked against a plain NumPy pooling."""
import importlib.util
import os

import numpy as np
import tensorflow as tf

from models.spec import PAD_ID, FeatureSpec, Field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_spec = importlib.util.spec_from_file_location("peer_tfra", os.path.join(ROOT, "scripts", "peer_tfra.py"))
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)

SPEC = FeatureSpec((Field("c", "categorical", 2), Field("m", "multi", 2, max_len=3, weighted=True),
                    Field("u", "multi", 2, max_len=2)))


def row_of(key: int, width: int) -> np.ndarray:
    """A row that differs for every key (the stand-in table)."""
    return np.array([np.sin(0.001 * (key % 100_003) + j) + (key >> 55) for j in range(width)], np.float32)


def test_field_keys_and_pooling_equal_a_plain_numpy_pooling():
    x = {"c": np.array([5, 7], np.int64),
         "m": np.array([[5, 9, PAD_ID], [PAD_ID, PAD_ID, PAD_ID]], np.int64),
         "m_weight": np.array([[0.5, 2.0, 3.0], [1.0, 1.0, 1.0]], np.float32),   # padding's weight is ignored
         "u": np.array([[4, 4], [1, PAD_ID]], np.int64)}
    keys, weights = peer.field_keys(SPEC, {k: tf.constant(v) for k, v in x.items()})
    keys = keys.numpy()
    assert keys.shape == (2, 6)
    # the same id in two fields is two keys; the field is the key's top bits
    assert keys[0, 0] != keys[0, 1] and keys[0, 0] >> 55 == 0 and keys[0, 1] >> 55 == 1 and keys[0, 4] >> 55 == 2
    rows = np.stack([[row_of(int(k), 2) for k in line] for line in keys])
    pooled = peer.pool_fields(SPEC, tf.constant(rows), weights).numpy()
    expect = np.zeros((2, 3, 2), np.float32)
    for b in range(2):
        expect[b, 0] = row_of(x["c"][b], 2)
        for i, w in zip(x["m"][b], x["m_weight"][b]):
            if i != PAD_ID:
                expect[b, 1] += w * row_of((1 << 55) | int(i), 2)
        for i in x["u"][b]:
            if i != PAD_ID:
                expect[b, 2] += row_of((2 << 55) | int(i), 2)
    np.testing.assert_allclose(pooled, expect, rtol=1e-6)
    assert not pooled[1, 1].any()          # an all-padding bag pools to zero

"""Shared test data: small specs and seeded in-memory batches with repeated keys."""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from des.data.spec import FeatureSpec, Field


def small_spec(n_fields: int = 6, dim: int = 4) -> FeatureSpec:
    return FeatureSpec(tuple(Field(f"f{i}", "categorical", dim, cardinality=10 * (i + 1))
                             for i in range(n_fields)))


def random_batches(spec: FeatureSpec, steps: int, batch: int, seed: int = 0):
    """Zipf-like ids (keys repeat within and across batches), labels from a planted rule."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = {}
        score = np.zeros(batch)
        for i, f in enumerate(spec.sparse()):
            card = f.cardinality or 50
            ids = np.minimum(rng.zipf(1.3, batch), card).astype(np.int64) * 1000003 + i
            x[f.name] = tf.constant(ids)
            score += np.sin(ids % 7)
        y = (score + rng.normal(0, 1, batch) > 0).astype(np.float32)
        out.append((x, tf.constant(y)))
    return out

"""Data: feature specs, stable feature ids, readers (tf.data) and the synthetic generator."""
from des.data.errors import DataError, SkipReport
from des.data.hashing import feature_id, feature_ids
from models.spec import FeatureSpec, Field, avazu_spec, criteo_spec

__all__ = ["Field", "FeatureSpec", "criteo_spec", "avazu_spec", "feature_ids", "feature_id",
           "DataError", "SkipReport"]

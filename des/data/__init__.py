"""Data: feature specs, stable feature ids, readers (tf.data) and the synthetic generator."""
from des.data.spec import Field, FeatureSpec, criteo_spec, avazu_spec
from des.data.hashing import feature_ids, feature_id
from des.data.errors import DataError, SkipReport

__all__ = ["Field", "FeatureSpec", "criteo_spec", "avazu_spec", "feature_ids", "feature_id",
           "DataError", "SkipReport"]

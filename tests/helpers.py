"""Shared test data (defined in des.verify so the mpirun scripts use the same)."""
from des.verify import random_batches, small_spec  # noqa: F401

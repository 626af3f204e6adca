"""``des.checkpoint.save(folder, model, optimizer)`` and ``restore``: see des.runtime.checkpoint."""
from des.runtime.checkpoint import CheckpointError, Shards, latest, restore, save

__all__ = ["save", "restore", "latest", "Shards", "CheckpointError"]

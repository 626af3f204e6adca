"""The systems DES is compared with, each in one folder: its tables, its model rewrite and its
des.train mode.

- ``ps``: a mesh parameter server, tables sharded by key over the processes, ids and rows moved
  by all-to-all (tables.py: ShardedFieldEmbedding, ShardedFusedTable, KeyExchange; rewrite.py:
  ``shard``; mode.py: ``--mode ps``).
- ``cache``: the PS plus HET's bounded-staleness embedding cache on every process (tables.py:
  CachedFieldEmbedding, CachedFusedTable; rewrite.py: ``cache``; mode.py: ``--mode cache``).
- ``allocate``: which process trains which sample of a global batch (Herald's locality-aware
  allocation and its simpler peers), for both.
"""

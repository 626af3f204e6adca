"""The parameter-server baseline: tables sharded by key (tables), the model rewrite (rewrite:
``shard``), ``--mode ps`` (mode)."""

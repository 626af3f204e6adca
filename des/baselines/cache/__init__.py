"""HET's bounded-staleness embedding cache on the PS: cached tables (tables), the model rewrite
(rewrite: ``cache``), ``--mode cache`` (mode)."""

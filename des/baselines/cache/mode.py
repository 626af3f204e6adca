"""``--mode cache``: the PS plus HET's bounded-staleness embedding cache on every process (des.baselines.cache.rewrite).

    mpirun -np 4 python -m des.train --mode cache --staleness 100 --cache-size 10% --data train.txt
    mpirun -np 2 python -m des.train --mode cache --staleness 0 --on-demand --allocate laia --data train.txt
    mpirun -np 2 python -m des.train --mode cache --staleness 0 --on-demand --plan-pushes --optimizer sgd --data train.txt

Everything the PS mode does (slices, allocation, all-to-all accounting), with cached tables:
a flush at every epoch's end (before checkpoints and evaluation), the laia allocator simulating
the caches at their capacity, and the cache's counters (queries, clocks, fetches, pushes, hits)
in the summary. With ``--allocate laia`` the simulation decides the evictions (one set of lines:
des.baselines.allocate), and each epoch's flush also empties the caches, as the new epoch's allocator
starts with empty ones.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from des.baselines.cache import rewrite as cache
from des.baselines.ps.mode import PS
from des.jobs.modes.base import ModeError
from models.spec import PAD_ID


class Cache(PS):
    name = "cache"

    def check(self) -> None:
        try:
            self.staleness = cache.parse_staleness(self.config.cache.staleness)
            self.capacity = cache.parse_cache_size(self.config.cache.size)
        except ValueError as e:
            raise ModeError(str(e)) from None
        self._check_top_k()
        self._check_options_of_other_modes()
        a = self.config
        if a.cache.plan_pushes and not (a.cache.on_demand and a.sgd_everywhere):
            raise ModeError("--plan-pushes keeps updates in the workers' cache lines until another process reads "
                            "them: it needs --on-demand (--staleness 0) and plain SGD (--optimizer sgd)")
        if self.config.allocation.strategy == "laia" and self.config.cache.eviction != "lru":
            raise ModeError(f"--allocate laia simulates LRU caches and decides their evictions: "
                            f"--eviction {self.config.cache.eviction} does not apply")
        if a.tables == "fused" and self._per_field_plan():
            raise ModeError(f"--tables fused: {self._per_field_plan()} name each field's keys; they need "
                            f"--tables per-field (their default)")

    def _per_field_plan(self) -> str:
        """What needs one cached table per field ('' if nothing): laia's simulated caches and the
        on-demand plan name the keys of each field's input."""
        a = self.config
        return " and ".join(x for x, on in (("--allocate laia", a.allocation.strategy == "laia"),
                                            ("--on-demand", a.cache.on_demand)) if on)

    def _fuse(self) -> bool:
        """Fused tables (one table and one cache per width) unless --tables per-field or a
        per-field plan."""
        return self.config.tables != "per-field" and not self._per_field_plan()

    def _planned(self) -> bool:
        return self.config.allocation.strategy == "laia"

    SEEN_LINES = 100_000

    def _spec_with_cardinalities(self):
        """The data's spec; with a --cache-size fraction, a field of no known cardinality (a plain
        Criteo or libsvm file, no metadata) takes the count of its distinct ids in the first
        100,000 training lines (the same lines on every process, so every cache is alike)."""
        spec = self.run.spec
        unknown = [f.name for f in spec if not f.cardinality]
        if not isinstance(self.capacity, float) or not unknown or self.run.read_lines is None:
            return spec
        ids = self.run.read_lines(self.SEEN_LINES)
        seen = {f: int(np.unique(v[v != PAD_ID]).size) or 1
                for f in unknown for v in [np.asarray(ids[f]).reshape(-1)]}
        lines = int(np.asarray(next(iter(ids.values()))).shape[0])
        self.run.log(f"cache: {len(unknown)} field(s) of no known cardinality ({', '.join(unknown[:3])}"
                     f"{', ...' if len(unknown) > 3 else ''}): --cache-size {self.config.cache.size} of the distinct "
                     f"ids in the first {lines:,} training lines ({min(seen.values()):,}..{max(seen.values()):,})")
        return spec.with_cardinalities(seen)

    def _shard(self, model):
        a = self.config
        try:
            model = cache.cache(model, self.exchange, self.staleness, self.capacity, a.cache.eviction,
                                spec=self._spec_with_cardinalities(), on_demand=a.cache.on_demand,
                                plan_pushes=a.cache.plan_pushes, fuse=self._fuse())
        except ValueError as e:
            raise ModeError(str(e)) from None
        self._tables = model.cached_tables()
        for line in model.fused_lines:
            self.run.log(line + ", with one cache")
        sizes = sorted({layer.config.capacity for layer, _ in self._tables})
        what = "fused tables" if self._fuse() else "tables (one per field)"
        self.run.log(f"cache: {len(self._tables)} {what} sharded by key over {self.world_size} "
                     f"process(es), each cached on every process (staleness {a.cache.staleness}, {a.cache.eviction}, "
                     f"{sizes[0]}..{sizes[-1]} rows per table); global batch {self.global_batch}")
        return model

    def _capacity(self):
        return {ids: layer.config.capacity for layer, ids in self._tables}

    def _counters(self, model) -> dict:
        counters = super()._counters(model)
        counters.update(self._tables[0][0].counters)
        return counters

    def callbacks(self, model) -> list:
        return super().callbacks(model) + [_FlushAtEpochEnd(clear=self._planned())]

    def flush(self, model) -> None:
        """Push every pending update (before the owners' rows are saved)."""
        model.flush()

    def summarise(self, model, summary: dict) -> None:
        self._summarise_allocation(summary)
        a = self.config
        summary.update(cache.traffic_summary(self.traffic.steps, self.rank, self.world_size),
                       staleness=a.cache.staleness, cache_size=a.cache.size, eviction=a.cache.eviction)
        self.run.log(f"cache bytes/step sent per process: measured {summary['sent_bytes_per_step']:.0f} (all-to-all "
                     f"{summary['alltoall_bytes_per_step']:.0f}, analytic "
                     f"{summary['analytic_alltoall_bytes_per_step']:.0f}; equal in {summary['bytes_exact_steps']} "
                     f"steps); rows fetched {summary['rows_fetched_per_step']:.0f}, pushed "
                     f"{summary['rows_pushed_per_step']:.0f} of {summary['remote_lookups_per_step']:.0f} remote "
                     f"lookups per step; hit rate {summary['hit_rate']:.3f}")


def _FlushAtEpochEnd(clear: bool = False):
    """Every epoch ends with a flush (a sync point), before checkpoints and evaluation;
    ``clear``: the caches are emptied too."""

    class Flush(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.flush(clear=clear)
    return Flush()

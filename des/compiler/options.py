"""des.Options: how des.transform splits a model, one frozen, checked object.

    >>> import des
    >>> opts = des.Options(tail="data_parallel", tables="fused")
    >>> opts.tail, opts.tables_for(None), des.Options().tables_for(None)    # "auto", not compiled: fused
    ('data_parallel', 'fused', 'fused')
    >>> print(opts)
    plan=balanced tail=data_parallel first_dense=auto tables=fused micro_batches=1 wire_dtype=float32 seed=0
    >>> des.Options(tail="sideways")
    Traceback (most recent call last):
    ...
    ValueError: des.Options: tail='sideways'; choose from auto, replicated, data_parallel

des.train builds its Options from its command line (des.jobs.config.RunConfig.options), so the
library and the CLI cannot drift apart.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from des_ops.wire import WIRE_DTYPES


@dataclasses.dataclass(frozen=True)
class AutoTail:
    """What ``des.Options(tail="auto", first_dense="auto", costs=AutoTail(...))`` assumes when the
    cost model weighs the data-parallel tail (des_ops.tail) against the replicated one
    (des.compiler.cost.choose_tail) and the first Dense by rows against partials.

    ``batch_size``: the global batch the model will train on. ``flops``: float32 operations per
    second one process spends on the tail's matrix products (5e10: the 400,400,400 tail on this
    project's machine, one thread; reports/tail.md). ``bandwidth``: effective bytes/s per process
    and direction (1.25e9: 10 Gbit/s; None: measured at transform under a launcher, as with
    ``costs=None``, the other fields as given: des.train's ``--link auto``). ``per_collective``: the seconds an extra collective costs a
    step beyond its bytes (3 ms: the 128,64 tail at N=4 on one machine, reports/tail.md).
    ``distinct``: the share of a process's slice whose rows travel when rows travel once per
    distinct id (des.Options(distinct_rows=True)): 1.0 assumes every sample's; des.train measures
    it on its first batch (des.compiler.cost.distinct_share).
    """
    batch_size: int = 4096
    flops: float = 5e10
    bandwidth: float | None = 1.25e9
    per_collective: float = 3e-3
    distinct: float = 1.0


@dataclasses.dataclass(frozen=True)
class RowPolicy:
    """Bounds on a model's TFRA tables (des.Options(row_policy=...), des.train's --admit-min-count,
    --evict-idle-steps, --max-rows, --evict-every; the state and its exactness: des_ops.row_policy).

    ``admit_min_count`` C: a key gets a trainable row at its C-th occurrence (0 or 1: at the
    first). ``evict_idle_steps`` S: a row not read for S steps is removed (0: never).
    ``max_rows`` R: at most R rows per table, the least recently read go first (0: unbounded).
    ``every``: the cadence of eviction, in steps."""
    admit_min_count: int = 0
    evict_idle_steps: int = 0
    max_rows: int = 0
    every: int = 10

    def __post_init__(self):
        for name in ("admit_min_count", "evict_idle_steps", "max_rows", "every"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise ValueError(f"des.RowPolicy: {name}={value!r}; a whole number >= 0")
        if self.every < 1:
            raise ValueError(f"des.RowPolicy: every={self.every}; a whole number of steps >= 1")

    @property
    def active(self) -> bool:
        return self.admit_min_count > 1 or self.evict_idle_steps > 0 or self.max_rows > 0

    @property
    def threshold(self) -> int:
        """The occurrences a key needs for a row (at least 1)."""
        return max(1, self.admit_min_count)

    def __str__(self) -> str:
        parts = [f"admit at {self.admit_min_count} occurrences" if self.admit_min_count > 1 else "admit every key"]
        if self.evict_idle_steps:
            parts.append(f"evict rows idle {self.evict_idle_steps} steps")
        if self.max_rows:
            parts.append(f"at most {self.max_rows:,} rows a table (least recently read out first)")
        if self.evict_idle_steps or self.max_rows:
            parts.append(f"evicting every {self.every} steps")
        return ", ".join(parts)


TAILS = ("auto", "replicated", "data_parallel")
FIRST_DENSE = ("auto", "partials", "rows")
FIELD_ROWS = ("auto", "partials", "samples")
FIRST_LAYER = ("auto", "operators", "rows")
MODES = ("des", "ps", "auto")
TABLES = ("auto", "per-field", "fused", "joined")


@dataclasses.dataclass(frozen=True)
class Options:
    """How des.transform splits a model. Every choice is exact except ``wire_dtype="float16"``.

    ``mode``: "des" (the substitutions), "ps" (no substitution: every table sharded by key, a
    parameter server; des.baselines.ps.user) or "auto" (whichever moves fewer bytes on the
    ``sample`` given to des.transform, as ``des.train --mode auto``: des.jobs.auto.choose).
    ``plan``: "balanced" (fields spread by cost), "mod" (field i on process i mod N) or a
    des.compiler.plan.FieldPlan. ``first_layer``: "operators" (the rules split the sum, FM, the
    first Dense... into sub-operators whose partial results are summed), "rows" (no operator is
    split: every field vector's rows go to the processes of its samples, once per distinct id, and
    the first layers run in the data-parallel tail on them; des_ops.rows) or "auto" (rows where the
    cost model says they move fewer bytes: des.compiler.cost.choose_first_layer). ``tail``: "replicated" (every process runs the layers after the
    first one on the whole batch), "data_parallel" (each on its own rows of the batch: partials
    reduce-scattered, outputs all-gathered, the tail's gradients summed; des_ops.tail) or "auto"
    (the cost model picks with ``costs``; des.compiler.cost.choose_tail, the report says why).
    ``first_dense`` (data-parallel tail): "partials" ([B, units] sums reduce-scattered), "rows"
    (the owners send their fields' rows to the processes of the samples; des_ops.rows) or "auto"
    (per layer, by cost). ``field_rows`` (data-parallel tail): the field vectors no rule splits (read
    by Cross, attention, gates, ...) as "partials" in the reduce-scatter, by "samples" (each owner
    sends its vectors' rows to the processes of their samples, one all-to-all;
    des_ops.rows.rows_to_samples) or "auto" (by cost, des.compiler.cost.choose_field_rows).
    ``distinct_rows``: where rows travel (the first Dense by rows, field rows by samples), a field
    vector decided by one id per sample goes once per distinct id and process (des_ops.rows.Block;
    the receiver reads the same ids and puts it back at every sample); False: once per sample. ``tables``: "per-field" (one TFRA table per field), "fused" (a process
    keeps its tables of one width in one TFRA table: one lookup and one update per width and
    step; des_ops.fused), "joined" (fused, and a field's linear weight in its embedding's row:
    exact when one optimizer trains both parts) or "auto" (joined for a model compiled with one
    optimizer, else fused: ``tables_for``). ``micro_batches`` K > 1: the partials of K
    slices are allreduced one by one, each while the next is computed. ``wire_dtype="float16"``:
    half the bytes, summed in 16 bits, not exact. ``costs``: the batch size, FLOP rate, bandwidth
    and per-collective cost the auto choices assume (des.AutoTail). ``seed``: new TFRA rows
    depend on (table, key, seed) only. ``strict``: raise TransformError where a table or a
    candidate operator was not substituted. ``release_unowned``: drop the rows of tables this
    process does not own. ``sync_weights``: every process first takes rank 0's weights and rows.
    ``scope``: prefix of the collective's name (des.transform sets it per tower). ``row_policy``
    (des.RowPolicy): admission and eviction of the rows of every TFRA table this process holds.
    ``stripe_min_rows``: a field whose rows exceed an even share of all fields' rows (their sum / N)
    and at least this many is too big for one owner: its tables are split by key stripe over every
    process (des.compiler.big_tables; 0: whenever above the share; None: never).
    """
    mode: str = "des"
    plan: Any = "balanced"
    first_layer: str = "auto"
    tail: str = "auto"
    first_dense: str = "auto"
    field_rows: str = "auto"
    distinct_rows: bool = True
    tables: str = "auto"
    micro_batches: int = 1
    wire_dtype: str = "float32"
    costs: AutoTail | None = None
    seed: int = 0
    row_policy: RowPolicy = RowPolicy()
    stripe_min_rows: int | None = 1_000_000
    strict: bool = False
    release_unowned: bool = True
    sync_weights: bool = True
    scope: str = ""

    def __post_init__(self):
        for name, allowed in (("mode", MODES), ("first_layer", FIRST_LAYER), ("tail", TAILS), ("first_dense", FIRST_DENSE), ("field_rows", FIELD_ROWS), ("tables", TABLES),
                              ("wire_dtype", WIRE_DTYPES)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"des.Options: {name}={getattr(self, name)!r}; choose from {', '.join(allowed)}")
        if isinstance(self.plan, str) and self.plan not in ("balanced", "mod"):
            raise ValueError(f"des.Options: plan={self.plan!r}; 'balanced', 'mod' or a FieldPlan")
        if not isinstance(self.micro_batches, int) or isinstance(self.micro_batches, bool) or self.micro_batches < 1:
            raise ValueError(f"des.Options: micro_batches={self.micro_batches!r}; a whole number >= 1")
        if self.first_dense == "rows" and self.tail != "data_parallel":
            raise ValueError(f"des.Options(first_dense='rows'): needs the data-parallel tail (tail='data_parallel', "
                             f"not {self.tail!r})")
        if self.first_layer == "rows" and self.tail == "replicated":
            raise ValueError("des.Options(first_layer='rows'): the rows go to their samples' processes, which needs "
                             "the data-parallel tail (tail='data_parallel' or 'auto', not 'replicated')")
        if self.field_rows == "samples" and self.tail != "data_parallel":
            raise ValueError(f"des.Options(field_rows='samples'): needs the data-parallel tail (tail='data_parallel', "
                             f"not {self.tail!r})")
        if self.tail == "data_parallel" and (self.micro_batches > 1 or self.wire_dtype != "float32"):
            raise ValueError("des.Options: micro_batches and a 16-bit wire_dtype are for the replicated tail; the "
                             "data-parallel tail reduce-scatters the whole batch in float32")
        if self.stripe_min_rows is not None and (not isinstance(self.stripe_min_rows, numbers.Integral) or
                                                 isinstance(self.stripe_min_rows, bool) or self.stripe_min_rows < 0):
            raise ValueError(f"des.Options: stripe_min_rows={self.stripe_min_rows!r}; a whole number >= 0 or None")
        if not isinstance(self.row_policy, RowPolicy):
            raise ValueError(f"des.Options: row_policy={self.row_policy!r}; a des.RowPolicy")
        if self.costs is not None and not isinstance(self.costs, AutoTail):
            raise ValueError(f"des.Options: costs={self.costs!r}; a des.AutoTail")

    def tables_for(self, model) -> str:
        """The table layout: ``tables``, or for "auto" the fastest one known to be exact for
        ``model``: "joined" when it is compiled with one optimizer for every part, else "fused"
        (not compiled yet, or a separate optimizer for its linear part,
        models.optim.LinearAndRestOptimizer, which joined rows cannot have)."""
        if self.tables != "auto":
            return self.tables
        optimizer = getattr(model, "optimizer", None)
        return "joined" if optimizer is not None and not hasattr(optimizer, "rest") else "fused"

    @property
    def assumed(self) -> AutoTail:
        """What the auto choices assume (``costs``, else des.AutoTail's defaults; a bandwidth to be
        measured as the default until it is)."""
        costs = self.costs or AutoTail()
        return costs if costs.bandwidth is not None else dataclasses.replace(costs, bandwidth=AutoTail().bandwidth)

    def __str__(self) -> str:
        plan = self.plan if isinstance(self.plan, str) else "given"
        shown = [f"plan={plan}", f"tail={self.tail}", f"first_dense={self.first_dense}", f"tables={self.tables}",
                 f"micro_batches={self.micro_batches}", f"wire_dtype={self.wire_dtype}", f"seed={self.seed}"]
        shown += [f"{k}={getattr(self, k)}" for k in ("mode", "first_layer", "field_rows", "distinct_rows",
                                                       "stripe_min_rows", "strict",
                                                       "release_unowned", "sync_weights")
                  if getattr(self, k) != getattr(Options, k)]
        if self.costs is not None:
            shown.append(f"costs={self.costs}")
        if self.row_policy.active:
            shown.append(f"row_policy=({self.row_policy})")
        return " ".join(shown)

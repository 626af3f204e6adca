"""The interface every training mode implements; ``des.train`` calls it and nothing else.

    mode = des.jobs.modes.make("ps", run)                 # what des.train does, in short
    model = mode.prepare(run.reference_model())
    model.fit(dataset(shard=mode.train_shard(epoch)), callbacks=mode.callbacks(model))
    mode.summarise(model, summary)

A mode decides four things: which processes there are and what each one reads (``rank``,
``world_size``, ``global_batch``, ``train_shard``, ``eval_shard``, ``read_inputs``), what the model becomes
(``prepare``), what is measured while it trains (``callbacks``) and what its summary and log
say (``evaluate``, ``summarise``). Options that do not apply to it are refused by ``check``.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from des.jobs.config import RunConfig


class ModeError(ValueError):
    """A mode's options do not fit together (des.train prints it and exits with status 2)."""


@dataclasses.dataclass
class Run:
    """What a mode is given: the run's configuration (des.jobs.config.RunConfig), the data's
    FeatureSpec, a log that prints on rank 0 only (set once the mode knows its rank), the first
    global batch of training ids and the untouched reference model (each made lazily, at most once)."""
    config: RunConfig
    spec: Any
    read_first_batch: Callable[[], dict]
    build_model: Callable[[], Any]
    log: Callable[..., None] = lambda *m: None
    read_lines: Callable[[int], dict] | None = None     # the first n training lines' ids, in one batch

    def first_batch(self) -> dict:
        if not hasattr(self, "_first"):
            self._first = self.read_first_batch()
        return self._first

    def reference_model(self):
        if not hasattr(self, "_model"):
            self._model = self.build_model()
        return self._model


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch (epoch 0: ``seed`` itself)."""
    return seed + 1_000_003 * epoch


class Mode:
    """Defaults: one process that reads everything and trains the model unchanged."""

    name = "single"
    sharded = False            # data parallel: each process trains its own slice of a global batch

    def __init__(self, run: Run):
        self.run, self.config = run, run.config
        self.comm = self._communicator()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.auto = None       # des.jobs.auto.Choice when --mode auto chose this mode
        self.report = None     # des.compiler's report (des mode)

    def _communicator(self):
        from des_ops.mpi import default_communicator
        return default_communicator("local")

    @property
    def global_batch(self) -> int:
        return self.config.batch

    def check(self) -> None:
        """Refuse options this mode does not have (ModeError)."""
        if self.config.allocation.strategy != "contiguous":
            raise ModeError(f"--allocate {self.config.allocation.strategy} is for --mode ps and cache "
                            f"(under {self.name} {self._reads})")
        cache = self.config.cache
        if cache.on_demand or cache.plan_pushes:
            raise ModeError(f"--{'on-demand' if cache.on_demand else 'plan-pushes'} is a plan of --mode cache "
                            f"--staleness 0")
        if self.config.allocation.top_k is not None:
            raise ModeError("--allocate-top-k is an option of --allocate laia (--mode ps and cache)")
        self._check_options_of_other_modes()

    def _check_options_of_other_modes(self) -> None:
        """Refuse the options that belong to other modes (every mode's check calls this)."""
        a = self.config
        if a.tail == "data_parallel" and self.name != "des":
            raise ModeError(f"--tail {a.tail} is an option of --mode des")
        if a.micro_batches != 1 and self.name != "des":
            raise ModeError("--micro-batches is an option of --mode des")
        if a.wire_dtype != "float32" and self.name not in ("des", "ps"):
            raise ModeError(f"--wire-dtype {a.wire_dtype} is an option of --mode des (the partials) and ps (the "
                            f"rows and gradient rows)")
        if a.row_policy.active and self.name == "cache":
            raise ModeError("--admit-min-count, --evict-idle-steps and --max-rows are for --mode single, des and ps "
                            "(the cache's lines keep rows of their own)")
        if a.row_policy.max_rows and self.name == "ps":
            raise ModeError("--max-rows with --mode ps: each process holds a slice of every table by key, so a "
                            "per-table bound would need a global order of its rows; use --evict-idle-steps")
        if a.tables == "fused" and self.name not in ("single", "des", "ps", "cache"):
            raise ModeError(f"--tables fused is built by --mode single, des, ps and cache; --mode {self.name} keeps "
                            f"one table per field")

    _reads = "there is one process"

    def train_shard(self, epoch: int):
        """The readers' ``shard=`` for epoch ``epoch``'s training batches (None: all of each)."""
        return None

    def eval_shard(self):
        return None

    def read_inputs(self) -> list[str] | None:
        """The inputs this process reads (None: all); set by ``prepare`` for columnar data."""
        return None

    def prepare(self, model):
        """The model this mode trains, built from the untouched reference ``model`` (one process:
        with its tables of one width in one TFRA table, unless --tables per-field)."""
        if self.config.tables == "per-field":
            return model
        from des.compiler.fusion import fuse_model
        model, lines = fuse_model(model, join_linear=self.config.join_linear)
        for line in lines:
            self.run.log(line)
        return model

    def callbacks(self, model) -> list:
        """Keras callbacks that measure this mode's traffic (called once, after compile)."""
        return []

    def sum_across(self, values: list[float]) -> list[float]:
        """The sums over every process of ``values`` (each passes its own): one small allreduce,
        which every process calls at the same step; with one process, the values."""
        return list(values)

    def barrier(self) -> Callable[[], Any] | None:
        """Waits for every process (checkpoints are written together); None with one process."""
        return None if self.world_size == 1 else (lambda: self.sum_across([0.0]))

    def flush(self, model) -> None:
        """Make the model's state whole before it is saved (the cache pushes pending updates)."""

    def evaluate(self, model, data) -> dict:
        return model.evaluate(data, verbose=0, return_dict=True)

    def summarise(self, model, summary: dict) -> None:
        """Add this mode's measurements to ``summary`` and log them (rank 0)."""

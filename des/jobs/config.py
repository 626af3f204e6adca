"""The configuration of one ``des.train`` run: typed, frozen, parsed and checked once.

    >>> config = RunConfig.parse(["--data", "train.txt", "--mode", "cache", "--staleness", "10"])
    >>> config.mode, config.cache.staleness, config.allocation.strategy, config.hidden_units
    ('cache', '10', 'contiguous', (128, 64))
    >>> config.to_argv()                      # what des.compare and the benchmarks hand to des.train
    ['--mode', 'cache', '--staleness', '10', '--data', 'train.txt']
    >>> RunConfig.parse(config.replace(batch=256).to_argv()).batch
    256

Every option is declared once, in ``OPTIONS`` (flag, where its value lives, argparse's
arguments); the parser, the typed record and ``to_argv`` all come from that table, so an option
added there reaches des.train, des.compare (which builds its runs' command lines with
``to_argv``) and the modes (which read ``config.<field>`` or ``config.<part>.<field>``). What a
run learns later (the data's format, a restored seed, the mode ``--mode auto`` chose) makes a new
record with ``replace``; nothing changes a record in place.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Optional

from des.cluster.timemodel import parse_rate
from des.compiler.options import AutoTail, Options, RowPolicy

OPTIMIZERS = ["sgd", "adagrad", "adam", "ftrl"]
MODEL_NAMES = ["lr", "fm", "dnn", "wdl", "deepfm"]

# --mode's choices: name -> the mode's class, or "module:Class" where it lives (des.jobs.modes.mode_class
# loads it, so that reading the options does not load TensorFlow). A test or a plugin adds one entry.
MODES: dict[str, Any] = {
    "single": "des.jobs.modes.single:Single",
    "des": "des.jobs.modes.des:DES",
    "ps": "des.baselines.ps.mode:PS",
    "cache": "des.baselines.cache.mode:Cache",
}


@dataclass(frozen=True)
class CacheOptions:
    """--mode cache: HET's bounded-staleness embedding cache (des.baselines.cache.rewrite)."""
    staleness: str = "100"        # a whole number or "inf", parsed by des.baselines.cache.rewrite.parse_staleness
    size: str = "10%"             # rows, or a fraction of each field's cardinality (des.baselines.cache.rewrite.parse_cache_size)
    eviction: str = "lru"
    on_demand: bool = False
    plan_pushes: bool = False


@dataclass(frozen=True)
class AllocationOptions:
    """--mode ps and cache: which process trains which sample of a global batch (des.baselines.allocate)."""
    strategy: str = "contiguous"  # contiguous | random | laia
    top_k: Optional[int] = None
    ps_batch: str = "global"      # global | per-process


@dataclass(frozen=True)
class NetworkOptions:
    """The collectives and the network the cost model assumes."""
    comm: str = "auto"
    link: str = "auto"            # auto (measured at start) or tc units (des.cluster.timemodel.parse_rate)

    @property
    def link_bytes_per_second(self) -> float | None:
        """The rate --link gives, in bytes/s; None for auto (des.transform measures it at start)."""
        return None if self.link == "auto" else parse_rate(self.link)


@dataclass(frozen=True)
class Every:
    """How often to save: every ``steps`` training steps, or every ``seconds`` of training (both 0:
    only at epochs' ends). Written ``500`` (steps), ``90s``, ``10min`` or ``2h``.

        >>> Every.parse("10min"), str(Every.parse("10min")), Every.parse("500").steps, bool(Every())
        (Every(steps=0, seconds=600.0), '10min', 500, False)
    """
    steps: int = 0
    seconds: float = 0.0

    UNITS = {"s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0}

    @classmethod
    def parse(cls, text: str) -> "Every":
        found = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*(s|min|m|h)?\s*", text)
        if not found or (found[2] is None and "." in found[1]):
            raise argparse.ArgumentTypeError(f"{text!r}: a whole number of steps (500) or a time (90s, 10min, 2h)")
        if found[2] is None:
            return cls(steps=int(found[1]))
        return cls(seconds=float(found[1]) * cls.UNITS[found[2]])

    def __bool__(self) -> bool:
        return bool(self.steps or self.seconds)

    def __str__(self) -> str:
        if not self.seconds:
            return str(self.steps)
        for unit in ("h", "min", "s"):
            if self.seconds % self.UNITS[unit] == 0:
                return f"{self.seconds / self.UNITS[unit]:g}{unit}"
        return f"{self.seconds:g}s"


@dataclass(frozen=True)
class RunConfig:
    """One des.train run. ``cache``, ``allocation`` and ``network`` hold those options' parts."""
    data: list = field(default_factory=list)
    mode: str = "single"
    model: str = "deepfm"
    format: Optional[str] = None
    libsvm_layout: str = "auto"
    holdout: float = 0.1
    eval_data: Optional[list] = None
    batch: int = 1024
    epochs: int = 1
    steps: Optional[int] = None
    optimizer: str = "adam"
    lr: Optional[float] = None
    linear_optimizer: Optional[str] = None
    linear_lr: Optional[float] = None
    dim: int = 8
    hidden: str = "128,64"
    seed: int = 0
    shuffle_buffer: int = 50_000
    skip_bad_lines: bool = False
    plan: str = "balanced"
    tables: Optional[str] = None
    tail: str = Options.tail
    first_dense: str = Options.first_dense
    micro_batches: int = 1
    wire_dtype: str = "float32"
    stripe_min_rows: Optional[int] = Options.stripe_min_rows
    replica_check: int = 100
    checkpoint: Optional[str] = None
    checkpoint_every: Every = Every()
    restore: Optional[str] = None
    check_bytes: int = 20
    threads: int = 0
    summary_json: Optional[str] = None
    fail_at_step: Optional[int] = None
    cache: CacheOptions = CacheOptions()
    allocation: AllocationOptions = AllocationOptions()
    network: NetworkOptions = NetworkOptions()
    row_policy: RowPolicy = RowPolicy()

    @property
    def hidden_units(self) -> tuple[int, ...]:
        return tuple(int(h) for h in self.hidden.split(",") if h)

    @property
    def join_linear(self) -> bool:
        """A field's linear weight in its embedding's row (``--tables joined``, the default when one
        optimizer trains every part, except for the cache)."""
        if self.tables == "joined":
            return True
        return self.tables is None and self.linear_optimizer is None and self.mode != "cache"

    def options(self, plan=None, distinct: float = 1.0) -> Options:
        """The des.Options this run's DES mode transforms with (``plan``: a restored FieldPlan;
        ``distinct``: AutoTail.distinct, measured on the first batch): des.train and the library
        share one record of the choices, and its defaults."""
        tables = self.tables or ("joined" if self.join_linear else "fused")
        return Options(plan=plan or self.plan, tail=self.tail, first_dense=self.first_dense, tables=tables,
                       micro_batches=self.micro_batches, wire_dtype=self.wire_dtype,
                       stripe_min_rows=self.stripe_min_rows,
                       costs=AutoTail(batch_size=self.batch, bandwidth=self.network.link_bytes_per_second,
                                      distinct=distinct), row_policy=self.row_policy)

    @property
    def sgd_everywhere(self) -> bool:
        """Plain SGD on every part (what the cache's local update and plan pushes need)."""
        return self.optimizer == "sgd" and self.linear_optimizer in (None, "sgd")

    def replace(self, **changes: Any) -> "RunConfig":
        """A new record with ``changes``; a part's field as ``"cache.staleness"``-style keys
        is not accepted: pass the part, e.g. ``allocation=dataclasses.replace(c.allocation, ...)``."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse(cls, argv: list[str] | None = None, description: str | None = None) -> "RunConfig":
        """des.train's command line -> a checked RunConfig (argparse's one-line error and exit 2)."""
        ap = parser(description)
        ns = ap.parse_args(argv)
        if ns.link != "auto":
            try:
                parse_rate(ns.link)
            except ValueError as e:
                ap.error(f"--link: {e}, or auto (measured at start)")
        if ns.micro_batches < 1:
            ap.error(f"--micro-batches {ns.micro_batches}: a whole number >= 1")
        if ns.holdout < 0 or (ns.holdout >= 1 and ns.holdout != int(ns.holdout)):
            ap.error(f"--holdout {ns.holdout:g}: a fraction of the lines in [0, 1) or a whole number of lines")
        if ns.first_dense == "rows" and ns.tail != "data_parallel":
            ap.error(f"--first-dense rows: the first Dense by rows needs --tail data_parallel (not {ns.tail})")
        if ns.tables == "joined" and ns.linear_optimizer:
            ap.error(f"--tables joined puts the linear weights in the embeddings' rows: they cannot have their "
                     f"own --linear-optimizer {ns.linear_optimizer} (use --tables fused)")
        if ns.tables == "joined" and ns.mode == "cache":
            ap.error("--tables joined: the cache mode fuses by width only (--tables fused)")
        for flag in ("admit_min_count", "evict_idle_steps", "max_rows"):
            if getattr(ns, flag) < 0:
                ap.error(f"--{flag.replace('_', '-')} {getattr(ns, flag)}: a whole number >= 0 (0: off)")
        if ns.evict_every < 1:
            ap.error(f"--evict-every {ns.evict_every}: a whole number of steps >= 1")
        flat, parts = {}, {"cache": {}, "allocation": {}, "network": {}, "row_policy": {}}
        for opt in OPTIONS:
            value = getattr(ns, opt.dest)
            if "." in opt.path:
                part, name = opt.path.split(".")
                parts[part][name] = value
            else:
                flat[opt.path] = value
        return cls(**flat, cache=CacheOptions(**parts["cache"]),
                   allocation=AllocationOptions(**parts["allocation"]), network=NetworkOptions(**parts["network"]),
                   row_policy=RowPolicy(**parts["row_policy"]))

    def get(self, path: str) -> Any:
        """The value at ``path`` ("batch", "cache.staleness")."""
        value: Any = self
        for name in path.split("."):
            value = getattr(value, name)
        return value

    def to_argv(self) -> list[str]:
        """The command line that parses back to this record (options at their default left out)."""
        default = RunConfig()
        argv: list[str] = []
        for opt in OPTIONS:
            value = self.get(opt.path)
            if value == default.get(opt.path) and opt.flag != "--data":
                continue
            if opt.kwargs.get("action") == "store_true":
                argv += [opt.flag] if value else []
            elif value is None:
                continue
            elif opt.kwargs.get("nargs") == "+":
                argv += [opt.flag, *map(str, value)]
            else:
                argv += [opt.flag, str(value)]
        return argv


@dataclass(frozen=True)
class Option:
    flag: str
    path: str                     # the field of RunConfig ("batch") or of a part ("cache.staleness")
    kwargs: dict

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")


def _o(flag: str, path: str | None = None, **kwargs) -> Option:
    return Option(flag, path or flag[2:].replace("-", "_"), kwargs)


def _stripe_min_rows(text: str) -> int | None:
    """--stripe-min-rows: a whole number >= 0, or "off" (None: no field is split)."""
    if text == "off":
        return None
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number >= 0, or off")
    return int(text)


OPTIONS: list[Option] = [
    _o("--mode", choices=lambda: [*MODES, "auto"], default="single",      # the modes registered when parsed
       help="des: field-partitioned first layers; ps: tables sharded by key (baseline); "
            "cache: ps plus HET's bounded-staleness embedding cache on every worker; "
            "auto: des or ps, whichever moves fewer bytes on the first batch (des.jobs.auto)"),
    _o("--staleness", "cache.staleness", default="100", metavar="S",
       help="cache: a cached row is read while it lacks at most S of its owner's updates, and "
            "a row's updates are pushed every max(S, 1) of them; 0: exact (= ps); inf: never "
            "re-read (the asynchronous limit)"),
    _o("--cache-size", "cache.size", default="10%", metavar="ROWS|FRACTION",
       help="cache: rows per table and process (e.g. 5000), or a fraction (0.1 / 10%%) of each "
            "field's cardinality"),
    _o("--eviction", "cache.eviction", choices=["lru", "lfu"], default="lru",
       help="cache: which rows leave a full cache"),
    _o("--ps-batch", "allocation.ps_batch", choices=["global", "per-process"], default="global",
       help="ps, cache: each process reads batch/N rows of every global batch (global), "
            "or batch rows of a global batch of N*batch (per-process)"),
    _o("--allocate", "allocation.strategy", choices=["contiguous", "random", "laia"], default="contiguous",
       help="ps, cache: which process trains which sample of a global batch (des.baselines.allocate): "
            "contiguous slices, a seeded random split, or laia (Herald's locality-aware "
            "allocation: samples go where their keys are owned or cached); exact in every case"),
    _o("--allocate-top-k", "allocation.top_k", type=int, default=None, metavar="K",
       help="laia: score only the K inputs with the most distinct ids in the first batch "
            "(Herald's top-k; faster on data with many inputs, a little less locality)"),
    _o("--on-demand", "cache.on_demand", action="store_true",
       help="cache at --staleness 0: no queries; every process knows from the allocation which "
            "keys the others update, and asks only for rows it lacks or holds outdated (exact)"),
    _o("--plan-pushes", "cache.plan_pushes", action="store_true",
       help="with --on-demand and plain SGD: Herald's plan pushes - an update stays in its worker's "
            "cache line until another process reads the key (exact, fewer rows pushed)"),
    _o("--model", default="deepfm", choices=MODEL_NAMES),
    _o("--data", required=True, nargs="+", help="input files (.gz allowed)"),
    _o("--format", default=None, choices=["criteo", "avazu", "libsvm", "libffm", "columnar"],
       help="default: columnar for a folder written by des.data.convert (a DES process then "
            "reads only its own fields' columns), else the format in <data>.meta.json, else criteo"),
    _o("--libsvm-layout", default="auto", choices=["auto", "positional", "bag"],
       help="libsvm: positional (the k-th feature of a line is field k), bag (one field of all "
            "features) or auto (positional when every line has as many features, else stop and ask)"),
    _o("--holdout", type=float, default=0.1, help="held-out lines at the end: a fraction (<1) or a count"),
    _o("--eval-data", nargs="+", default=None,
       help="evaluate on these files (same format) instead of holding out lines of --data"),
    _o("--batch", type=int, default=1024),
    _o("--epochs", type=int, default=1,
       help="epochs in total: with --restore, training continues from the saved epoch/step"),
    _o("--steps", type=int, default=None, help="stop each epoch after this many steps"),
    _o("--optimizer", default="adam", choices=OPTIMIZERS),
    _o("--lr", type=float, default=None),
    _o("--linear-optimizer", default=None, choices=OPTIMIZERS,
       help="another optimizer for the linear part (sparse linear sum, bias), e.g. ftrl"),
    _o("--linear-lr", type=float, default=None),
    _o("--dim", type=int, default=8),
    _o("--hidden", default="128,64"),
    _o("--seed", type=int, default=0),
    _o("--shuffle-buffer", type=int, default=50_000,
       help="each epoch's lines are shuffled within consecutive windows of this many lines, a seeded order "
            "per window (des.data.readers.order); 0: in file order"),
    _o("--skip-bad-lines", action="store_true", help="drop and count malformed lines"),
    _o("--plan", default="balanced", choices=["balanced", "mod"]),
    _o("--tables", default=None, choices=["joined", "fused", "per-field"],
       help="a process keeps its fields' rows of one width in one TFRA table (fused; the PS "
            "and the cache then do one set of all-to-alls per width and step, the cache keeps one cache per "
            "width); joined (the default when one optimizer trains every part; not the cache): fused, and "
            "a field's linear weight sits in its embedding's row, one lookup for both; or one table per "
            "field (per-field: single trains the model untouched; the cache's default with --allocate "
            "laia or --on-demand, which name each field's keys)"),
    _o("--tail", default=Options.tail, choices=["replicated", "data_parallel", "auto"],
       help="des: every process runs the layers after the first one on the whole batch (replicated) "
            "or on its own rows of it (data_parallel: less computation per process, two all-gathers "
            "and one gradient allreduce more; the same results); auto (the default, as des.Options): the "
            "cost model picks one for --batch and --link and the report says why"),
    _o("--first-dense", default=Options.first_dense, choices=["partials", "rows", "auto"],
       help="des with --tail data_parallel: the first Dense layer by partials (each process multiplies its "
            "fields' rows by its kernel rows; the [B, units] sums are reduce-scattered) or by rows (each process "
            "sends its fields' rows to the processes of their samples, which multiply them by the all-gathered "
            "kernel: fewer bytes for a wide layer and many processes; the same results); auto (the default): the cost "
            "model picks for --batch and --link (with --tail auto it weighs the data-parallel tail with it)"),
    _o("--micro-batches", type=int, default=1, metavar="K",
       help="des: cut each batch into K slices after the lookups and allreduce each slice's partials while the "
            "next slice's are computed (the same results; K collectives per step instead of one)"),
    _o("--wire-dtype", default="float32", choices=["float32", "float16"],
       help="des: the partials' type on the wire; float16 halves the bytes and is summed in 16 bits by the "
            "collective (NOT exact; float32 is); ps: the type rows and gradient rows travel in (float16: half "
            "their bytes, rounded to 16 bits; ids and dense gradients unchanged)"),
    _o("--stripe-min-rows", type=_stripe_min_rows, default=Options.stripe_min_rows, metavar="ROWS|off",
       help="des: a field with more rows than all fields' rows / N and at least ROWS (the data's cardinalities) "
            f"is split by key stripe over every process instead of one owner holding it (default "
            f"{Options.stripe_min_rows:,}; off: never; the same results either way)"),
    _o("--link", "network.link", default="auto",
       help="--tail auto, --first-dense auto: each process's network rate (tc units, e.g. 100mbit) the cost model "
            "assumes; auto: measured at start with a few timed allreduces and rounded to 10 Mbit/s, 100 Mbit/s, "
            "1 Gbit/s or 10 Gbit/s (every process on one machine: 10 Gbit/s, not timed), as des.transform does"),
    _o("--comm", "network.comm", default="auto",
       choices=["auto", "horovod", "mpi4py", "local", "noop", "sync", "meet"],
       help="auto: under a launcher, DES's collectives by mpi4py, each wait sleeping where Horovod's and MPI's "
            "poll a core, for the replicated tail and the first layer by rows, and by Horovod for the "
            "data-parallel tail's partials or a 16-bit wire "
            "(des.transform settles it; the PS and the cache: Horovod), else one process; horovod, mpi4py: "
            "that one for every tail (mpi4py: a float32 wire; docs/netbed.md); "
            "noop: the launcher's rank and size but no collective (times the computation "
            "alone, for des.cluster.timemodel; results are not the model's); sync: the same, but each "
            "step waits for every process (one 4-byte allreduce), as training does; meet: "
            "every collective is a real call without its payload (the PS's all-to-alls of no "
            "rows): the computation with every meeting and wait, but no bytes"),
    _o("--replica-check", type=int, default=100, metavar="K",
       help="DES: every K steps check that replicated weights agree and that every process "
            "read the same batch, in one small allreduce (0: off)"),
    _o("--admit-min-count", "row_policy.admit_min_count", type=int, default=0, metavar="C",
       help="a key gets a trainable row at its C-th occurrence; before that it reads an unseen key's row and "
            "gets no update (counted by the table that holds it: exact on any N; des_ops.row_policy); 0: off"),
    _o("--evict-idle-steps", "row_policy.evict_idle_steps", type=int, default=0, metavar="S",
       help="remove a row (with its optimizer slots and count) not read for S steps; 0: never"),
    _o("--max-rows", "row_policy.max_rows", type=int, default=0, metavar="R",
       help="at most R rows per table (per field), the least recently read removed first; 0: unbounded"),
    _o("--evict-every", "row_policy.every", type=int, default=10, metavar="K",
       help="with --evict-idle-steps or --max-rows: evict after every K-th step (the same steps in every mode)"),
    _o("--checkpoint", default=None, help="save to this folder at every epoch's end"),
    _o("--checkpoint-every", type=Every.parse, default=Every(), metavar="K",
       help="also save every K training steps (500), or every so much training time (90s, 10min, 2h; "
            "the processes agree when in a few small sums per interval); needs --checkpoint"),
    _o("--restore", default=None,
       help="start from this checkpoint (any mode, any number of processes) and continue "
            "at its epoch and step"),
    _o("--check-bytes", type=int, default=20, metavar="K",
       help="ps: recompute the analytic bytes of the first K steps and compare"),
    _o("--threads", type=int, default=0, help="TF intra/inter-op threads (0: TF default)"),
    _o("--summary-json", default=None,
       help="write the results here (with several processes: PATH.rank<r> each)"),
    _o("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS),
]


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """des.train's argument parser, built from OPTIONS (``description``: the --help text's head)."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for opt in OPTIONS:
        kwargs = dict(opt.kwargs)
        if callable(kwargs.get("choices")):
            kwargs["choices"] = kwargs["choices"]()
        ap.add_argument(opt.flag, **kwargs)
    return ap

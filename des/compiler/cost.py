"""Cost model: bytes one process sends per step for each substitutable operator, under DES
and under the parameter-server baseline, from batch statistics - the first step of knowing
when NOT to substitute.

    >>> import dataclasses, des, models
    >>> from des.jobs.verify import random_batches, small_spec
    >>> spec = small_spec(n_fields=3, dim=4)
    >>> first_batch, _ = random_batches(spec, steps=1, batch=4096)[0]
    >>> uniq = unique_ids_per_slice(first_batch, spec, world_size=4)
    >>> uniq                                                  # every id occurs in each quarter
    {'f0': 10.0, 'f1': 20.0, 'f2': 30.0}
    >>> _, report = des.transform(models.deepfm(spec, hidden=(8,)))
    >>> report = dataclasses.replace(report, world_size=4)   # as if transformed on 4 processes
    >>> for c in estimate(report, batch_size=4096, unique_per_slice=uniq): print(c)
      cost lr_sum               at 'add': DES 24,576 B/step, PS 720 B/step -> a PS would move 34.1x fewer
      cost fm_interaction       at 'fm': DES 122,880 B/step, PS 1,800 B/step -> a PS would move 68.3x fewer
      cost embed_concat_dense   at 'dnn_0': DES 196,608 B/step, PS 2,424 B/step -> a PS would move 81.1x fewer

DES sends, for an operator whose partial is w floats per sample, 2(N-1)/N * 4*B*w (ring
allreduce). A PS sends, for each table the operator reads, the distinct ids of a process's
slice that live elsewhere - u*(N-1)/N of them - as 8-byte keys, gets 4*dim-byte rows back
and returns 4*dim-byte gradient rows; plus, for embed->Dense, the allreduce of the Dense
kernel's gradient (2(N-1)/N * 4 * params), which DES never sends (the kernel is split by
field). Tables shared by two operators (DeepFM's FM and DNN) are counted for each.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from des_ops.rows import wire_floats
from des_ops.wire import ring_share
from models.spec import PAD_ID
from des.compiler.options import AutoTail  # noqa: F401 - des.compiler.cost.AutoTail, as before


@dataclasses.dataclass
class OperatorCost:
    rule: str
    layer: str
    des_bytes: float
    ps_bytes: float

    @property
    def verdict(self) -> str:
        if self.des_bytes <= 0 or self.ps_bytes <= 0:
            return "no traffic"
        r = self.ps_bytes / self.des_bytes
        return f"DES moves {r:.1f}x fewer bytes" if r >= 1 else f"a PS would move {1 / r:.1f}x fewer"

    def __str__(self) -> str:
        return (f"  cost {self.rule:<20} at {self.layer!r}: DES {self.des_bytes:,.0f} B/step, "
                f"PS {self.ps_bytes:,.0f} B/step -> {self.verdict}")


def unique_ids_per_slice(feats: dict, spec, world_size: int, parts: list | None = None) -> dict[str, float]:
    """Mean over processes of the distinct non-padding ids per field in a process's share of
    a global batch: ``parts[r]``, the row indices an allocator (des.baselines.allocate) gives process r;
    default the rows ``[b*r//N, b*(r+1)//N)``, as the readers' ``shard=`` gives.
    ``spec``: a FeatureSpec (its sparse fields) or the id input names."""
    names = [f.name for f in spec.sparse()] if hasattr(spec, "sparse") else list(spec)
    out = {}
    for name in names:
        ids = np.asarray(feats[name])
        b = ids.shape[0]
        counts = []
        for r in range(world_size):
            rows = parts[r] if parts is not None else slice(b * r // world_size, b * (r + 1) // world_size)
            part = ids[rows].reshape(-1)
            counts.append(len(np.unique(part[part != PAD_ID])))
        out[name] = float(np.mean(counts))
    return out


def distinct_share(feats: dict, spec, world_size: int) -> float:
    """The share of a process's slice whose rows travel in a rows exchange with distinct rows
    (des_ops.rows.Block): per one-id field, its distinct ids over the slice's rows, averaged over
    fields (a multi-valued field's rows travel per sample: 1). AutoTail.distinct for the cost model.

    >>> from des.data import FeatureSpec, Field
    >>> spec = FeatureSpec((Field("user"), Field("item")))
    >>> feats = {"user": np.array([1, 1, 1, 2]), "item": np.array([5, 6, 7, 8])}
    >>> distinct_share(feats, spec, 2)       # user: 1 and 2 distinct ids in slices of 2 rows (0.75), item 1
    0.875
    """
    fields = list(spec.sparse())
    b = len(np.asarray(feats[fields[0].name]))
    unique = unique_ids_per_slice(feats, [f.name for f in fields if f.kind != "multi"], world_size)
    shares = [min(1.0, unique[f.name] / max(1.0, b / world_size)) if f.kind != "multi" else 1.0 for f in fields]
    return float(np.mean(shares))


def estimate(report, batch_size: int, unique_per_slice: dict[str, float]) -> list[OperatorCost]:
    """One OperatorCost per substitution in a des.transform report."""
    n = report.world_size
    ring = ring_share(n)
    remote = (n - 1) / n
    out = []
    for m in report.substitutions:
        width = report.widths.get(m.root.layer.name, 0)
        des_bytes = ring * report.bytes_per_float * batch_size * width
        ps = 0.0
        for v in m.vectors:
            if v.key_stripe is not None and v.key_stripe[0] > 0:
                continue                # a field split by key stripe: its ids once, as its stripe 0's
            u = unique_per_slice.get(v.unstriped_field, 0.0)
            ps += u * remote * (8 + 8 * v.width)
        ps += ring * 4 * m.dense_parameters
        out.append(OperatorCost(m.rule, m.root.layer.name, des_bytes, ps))
    return out


def choose_tail(dense_weights: int, tail_weights: int, output_floats: int, world_size: int,
                auto: AutoTail, obstacles: list[str] = (), first_dense: list[tuple[int, int]] = (),
                field_rows: int = 0) -> tuple[str, str]:
    """("replicated" | "data_parallel", why). The data-parallel tail saves each process
    (N-1)/N of the tail's matrix products, 6 x ``dense_weights`` operations per sample (forward
    2, backward 4), and costs three collectives more per step: the all-gather of the outputs
    (``output_floats`` per sample), the allreduce of the tail's ``tail_weights`` gradients, the
    backward all-gather of the partials (whose bytes the reduce-scatter saves against the
    allreduce it replaces). ``first_dense``: (input width, units) of each first Dense layer that
    may go by rows under the data-parallel tail (des_ops.rows; ``choose_first_dense`` decides per
    layer): where rows win, their time replaces the partials' in the data-parallel tail's cost.
    ``field_rows``: floats per sample of field vectors no rule splits, which the data-parallel tail
    sends by samples where ``choose_field_rows`` says so (their time replaces their partials').

    >>> choose_tail(320_400, 320_401, 1, 4, AutoTail())[0]      # DeepFM, hidden 400,400,400
    'data_parallel'
    >>> print(choose_tail(8_256, 8_257, 1, 4, AutoTail())[1])   # hidden 128,64
    replicated: the tail's products would save 3.0 ms per step (6 x 8,256 weights x B 4,096 x 3/4 at 5e+10 FLOP/s), 3 more collectives cost 9.0 ms (3 x 3.0 ms + 0.1 MB at 1.2e+09 B/s)
    >>> print(choose_tail(320_400, 320_401, 1, 4, AutoTail(bandwidth=1.25e7), first_dense=[(312, 400)])[1])  # 100 Mbit/s
    data_parallel: the tail's products would save 118.1 ms per step (6 x 320,400 weights x B 4,096 x 3/4 at 5e+10 FLOP/s), 3 more collectives cost 163.8 ms (3 x 3.0 ms + 1.9 MB at 1.2e+07 B/s); the first Dense by rows / field rows by samples add -561.2 ms to that (rows: 2.67 MB against 9.83 MB of partials, 4 more collectives)
    """
    n = world_size
    if n <= 1:
        return "replicated", "replicated: one process, nothing to share"
    if obstacles:
        return "replicated", "replicated: the tail cannot run data-parallel: " + "; ".join(obstacles)
    b = auto.batch_size
    saved = 6.0 * dense_weights * b * (n - 1) / n / auto.flops
    extra_bytes = ring_share(n) / 2 * 4 * b * output_floats + ring_share(n) * 4 * tail_weights
    extra = 3 * auto.per_collective + extra_bytes / auto.bandwidth
    by_rows, rows_bytes, partial_bytes = 0.0, 0.0, 0.0
    for width, units in first_dense:
        if choose_first_dense(b, width, units, n, auto)[0] == "rows":
            rows, partials = (4 * f for f in wire_floats(b, width, units, n, auto.distinct))
            by_rows += 4 * auto.per_collective + (rows - partials) / auto.bandwidth
            rows_bytes, partial_bytes = rows_bytes + rows, partial_bytes + partials
    if field_rows and choose_field_rows(b, field_rows, n, auto)[0] == "samples":
        share = (n - 1) / n
        samples, partials = 4 * 2 * share * b * field_rows / n * auto.distinct, 4 * 2 * share * b * field_rows
        by_rows += 2 * auto.per_collective + (samples - partials) / auto.bandwidth
        rows_bytes, partial_bytes = rows_bytes + samples, partial_bytes + partials
    choice = "data_parallel" if saved > extra + by_rows else "replicated"
    return choice, (f"{choice}: the tail's products would save {saved * 1e3:.1f} ms per step (6 x {dense_weights:,} "
                    f"weights x B {b:,} x {n - 1}/{n} at {auto.flops:.0e} FLOP/s), 3 more collectives cost "
                    f"{extra * 1e3:.1f} ms (3 x {auto.per_collective * 1e3:.1f} ms + {extra_bytes / 1e6:.1f} MB at "
                    f"{auto.bandwidth:.1e} B/s)"
                    + (f"; the first Dense by rows / field rows by samples add {by_rows * 1e3:+.1f} ms to that "
                       f"(rows: {rows_bytes / 1e6:.2f} MB "
                       f"against {partial_bytes / 1e6:.2f} MB of partials, 4 more collectives)" if rows_bytes else ""))


def choose_first_dense(batch_size: int, width: int, units: int, world_size: int,
                       auto: AutoTail | None = None) -> tuple[str, str]:
    """("rows" | "partials", why) for a first Dense layer of ``width`` input floats (the fields'
    rows) and ``units`` outputs under the data-parallel tail: the one whose bytes per process and
    step (des_ops.rows.wire_floats) take less time at ``auto``'s bandwidth, rows paying for their 4
    more collectives (``auto.per_collective`` each). Both are exact.

    >>> choose_first_dense(4096, 39 * 8, 400, 4, AutoTail(bandwidth=1.25e7))[0]   # criteo-like DeepFM at 100 Mbit/s
    'rows'
    >>> print(choose_first_dense(4096, 39 * 8, 400, 4)[1])                        # at 10 Gbit/s
    partials: 9.83 MB of partials take 7.9 ms per step, 2.67 MB of rows 14.1 ms with 4 more collectives (B 4,096, 312 input floats, 400 units, N 4, 1.2e+09 B/s)
    """
    auto = auto or AutoTail()
    rows, partials = (4 * f for f in wire_floats(batch_size, width, units, world_size, auto.distinct))
    t_rows, t_partials = 4 * auto.per_collective + rows / auto.bandwidth, partials / auto.bandwidth
    choice = "rows" if t_rows < t_partials else "partials"
    return choice, (f"{choice}: {partials / 1e6:.2f} MB of partials take {t_partials * 1e3:.1f} ms per step, "
                    f"{rows / 1e6:.2f} MB of rows {t_rows * 1e3:.1f} ms with 4 more collectives (B {batch_size:,}, "
                    f"{width} input floats, {units} units, N {world_size}, {auto.bandwidth:.1e} B/s{_distinct(auto)})")


def choose_field_rows(batch_size: int, width: int, world_size: int, auto: AutoTail | None = None) -> tuple[str, str]:
    """("samples" | "partials", why) for the ``width`` floats per sample of field vectors no rule
    splits (des_ops.suboperators.FieldRowsSubOp) under the data-parallel tail: by samples, each
    owner sends only its own vectors' rows of the other processes' samples (one all-to-all, and
    one back: 2 more collectives); as partials, every process hands the reduce-scatter all
    ``width`` columns of the whole batch, mostly zeros. Both are exact (x + 0 = x; a copy).

    >>> choose_field_rows(4096, 26 * 8, 4, AutoTail(bandwidth=1.25e7))[0]      # 26 fields of 8 at 100 Mbit/s
    'samples'
    >>> print(choose_field_rows(4096, 16, 2)[1])                               # 2 fields of 8 at 10 Gbit/s
    partials: 0.26 MB of partials take 0.2 ms per step, 0.13 MB by samples 6.1 ms with 2 more collectives (B 4,096, 16 floats, N 2, 1.2e+09 B/s)
    """
    auto = auto or AutoTail()
    share = (world_size - 1) / world_size
    partials = 4 * 2 * share * batch_size * width            # reduce-scatter forward, all-gather back
    samples = 4 * 2 * share * batch_size * width / world_size * auto.distinct
    t_samples, t_partials = 2 * auto.per_collective + samples / auto.bandwidth, partials / auto.bandwidth
    choice = "samples" if t_samples < t_partials else "partials"
    return choice, (f"{choice}: {partials / 1e6:.2f} MB of partials take {t_partials * 1e3:.1f} ms per step, "
                    f"{samples / 1e6:.2f} MB by samples {t_samples * 1e3:.1f} ms with 2 more collectives "
                    f"(B {batch_size:,}, {width} floats, N {world_size}, {auto.bandwidth:.1e} B/s{_distinct(auto)})")


def _distinct(auto: AutoTail) -> str:
    return f", {auto.distinct:.0%} of a slice's rows distinct" if auto.distinct < 1 else ""


# the link classes the measured bandwidth is rounded to (bytes/s per process and direction: 10 Mbit/s
# to 10 Gbit/s): a measurement that wobbles from run to run must not change the choices, or the same
# job would give other bits. Nothing above 10 Gbit/s: processes on one machine measured 1e9 to 1e15 B/s
# from launch to launch (shared memory, a busy machine), and all of it is "fast"
LINK_CLASSES = (1.25e6, 1.25e7, 1.25e8, 1.25e9)


@dataclasses.dataclass(frozen=True)
class MeasuredLink:
    """What ``measure_link`` timed: the medians over every process of a small and a 1 MiB
    allreduce, the bandwidth they imply, and the class it was rounded to."""
    small_seconds: float
    large_seconds: float
    bytes_per_second: float
    assumed: float

    def __str__(self) -> str:
        return (f"link measured at start: allreduce of 4 B {self.small_seconds * 1e3:.2f} ms, of 1 MiB "
                f"{self.large_seconds * 1e3:.1f} ms -> {self.bytes_per_second:.2e} B/s per process; assumed "
                f"{link_text(self.assumed)}")


def link_text(bytes_per_second: float) -> str:
    """A link's speed as the reports say it.

    >>> link_text(1.25e9)
    '1.25e+09 B/s (10,000 Mbit/s)'
    """
    return f"{bytes_per_second:.2e} B/s ({bytes_per_second * 8 / 1e6:,.0f} Mbit/s)"


def link_class(bytes_per_second: float) -> float:
    """The LINK_CLASSES entry nearest ``bytes_per_second`` on a log scale.

    >>> link_class(9.1e6), link_class(2.3e9), link_class(1e15), link_class(4e5)
    (12500000.0, 1250000000.0, 1250000000.0, 1250000.0)
    """
    return min(LINK_CLASSES, key=lambda c: abs(np.log(c) - np.log(max(bytes_per_second, 1.0))))


def measure_link(comm, repeats: int = 3) -> MeasuredLink:
    """Time ``repeats`` allreduces of 4 bytes and of 1 MiB on ``comm`` (every process calls it at
    the same point), each process's median summed over processes and divided by N so that every
    process holds the same numbers, and the per-process bandwidth a ring allreduce implies:
    2 (N-1)/N x 1 MiB / (t_large - t_small), rounded to a link class. Eager, once, at transform."""
    import time

    import tensorflow as tf
    n = comm.world_size
    timings = []
    for size, label in ((1, "small"), (1 << 18, "large")):
        x = tf.zeros([size])
        comm.allreduce(x, f"des_link_probe_{label}")                    # the first call sets things up
        took = []
        for _ in range(repeats):
            start = time.perf_counter()
            comm.allreduce(x, f"des_link_probe_{label}").numpy()
            took.append(time.perf_counter() - start)
        timings.append(float(np.median(took)))
    agreed = comm.allreduce(tf.constant(timings, tf.float64), "des_link_probe_agree").numpy() / n
    small, large = float(agreed[0]), float(agreed[1])
    rate = 2 * (n - 1) / n * 4 * (1 << 18) / max(large - small, 1e-9)
    return MeasuredLink(small, large, rate, link_class(rate))


def choose_first_layer(width: int, partials: list[int], dense: list[tuple[int, int]], world_size: int,
                       auto: AutoTail | None = None) -> tuple[str, str]:
    """("rows" | "operators", why) under the data-parallel tail, for des.Options(first_layer="auto").
    ``width``: floats per sample of every field vector; ``partials``: the widths of the split
    operators' partials other than the first Dense layers; ``dense``: (input width, units) of each
    first Dense layer. Per process and step, the operators move their partials by reduce-scatter
    and all-gather (2 collectives) and each first Dense by partials or rows (``choose_first_dense``,
    4 more collectives by rows); by rows, each owner sends its vectors' rows of the other
    processes' samples and gets their gradients back (the share ``auto.distinct`` of them), and the
    first Dense kernels join the tail's gradient allreduce (ring: 2 (N-1)/N of them) - 2 collectives.

    >>> auto = AutoTail(bandwidth=1.25e7, distinct=0.3)      # 100 Mbit/s, a third of the rows distinct
    >>> print(choose_first_layer(39 * 9, [1, 9], [(312, 128)], 4, auto)[1])   # criteo-like DeepFM, 128,64
    rows: 0.89 MB of rows and kernel gradients take 76.9 ms per step, the operators 1.06 MB 102.8 ms (partials 0.25 MB, first Dense by rows 0.81 MB; B 4,096, N 4, 1.2e+07 B/s, 30% of a slice's rows distinct)
    """
    auto = auto or AutoTail()
    n, b = world_size, auto.batch_size
    share = (n - 1) / n
    partial_bytes = 4 * 2 * share * b * sum(partials)
    dense_bytes, dense_calls = 0.0, 0
    for w, units in dense:
        choice = choose_first_dense(b, w, units, n, auto)[0]
        rows, parts = (4 * f for f in wire_floats(b, w, units, n, auto.distinct))
        dense_bytes += rows if choice == "rows" else parts
        dense_calls += 4 if choice == "rows" else 0
    ops_bytes = partial_bytes + dense_bytes
    t_ops = (2 + dense_calls) * auto.per_collective + ops_bytes / auto.bandwidth
    rows_bytes = 4 * 2 * share * b * width / n * auto.distinct + 4 * 2 * share * sum(w * u for w, u in dense)
    t_rows = 2 * auto.per_collective + rows_bytes / auto.bandwidth
    choice = "rows" if t_rows < t_ops else "operators"
    return choice, (f"{choice}: {rows_bytes / 1e6:.2f} MB of rows and kernel gradients take {t_rows * 1e3:.1f} ms "
                    f"per step, the operators {ops_bytes / 1e6:.2f} MB {t_ops * 1e3:.1f} ms (partials "
                    f"{partial_bytes / 1e6:.2f} MB, first Dense by {'rows' if dense_calls else 'partials'} "
                    f"{dense_bytes / 1e6:.2f} MB; B {b:,}, N {n}, {auto.bandwidth:.1e} B/s{_distinct(auto)})")

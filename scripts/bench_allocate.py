"""The allocators alone (des.baselines.allocate): their samples/s as N and the global batch grow, and the
remote ids a PS step fetches under each (distinct ids of a process's samples owned by another
process, summed over processes: the rows the all-to-all moves, by the formula the PS mode's
measured bytes equal).

    .venv/bin/python scripts/bench_allocate.py --preset criteo-like --np 2,4,8,16 --batch 1024,4096,16384
    .venv/bin/python scripts/bench_allocate.py --preset wide --rows 20000 --np 4 --batch 2048 --top-k all,10,5 \
        --baseline /tmp/allocate_before.py      # git show HEAD~1:des/baselines/allocate.py > /tmp/allocate_before.py

``--top-k``: one laia row per k (laia's ``top_k``: the score reads only the k inputs with the most
distinct ids of the first batch; ``all``: every input). ``--baseline``: another des/baselines/allocate.py
(e.g. an older commit's), whose laia is timed on the same batches in the same run (``before``
columns). One process, this machine; the allocator runs in the input pipeline of every process, so its
samples/s is to be set against the training's samples/s (``des.jobs.train --allocate laia`` reports
both in its summary). ``--cache-rows``: the simulated cache per input of the cache mode (0: PS;
``10%``: a tenth of each input's cardinality, as ``des.jobs.train --cache-size 10%``); ``--sgd``: plain
SGD (a process's own update keeps its copy valid). Wide, N = 4, the cache mode's set-up:

    .venv/bin/python scripts/bench_allocate.py --preset wide --rows 20000 --np 4 --batch 2048 \
        --top-k all,10 --cache-rows 10% --sgd --baseline /tmp/allocate_before.py
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
from types import ModuleType
from typing import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def remote_ids(feats: dict, keys: list[str], parts: list, n: int) -> int:
    """Summed over processes: the PS's remote distinct ids of each one's share (des.baselines.ps.rewrite.analytic_bytes)."""
    from des.baselines.ps.rewrite import analytic_bytes
    tables = [(k, None, 1) for k in keys]
    return sum(analytic_bytes({k: np.asarray(feats[k])[idx] for k in keys}, tables, w, n, 0)["remote_ids"]
               for w, idx in enumerate(parts))


def parse_args() -> argparse.Namespace:
    """The command line's options."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="criteo-like", choices=["criteo-like", "wide", "tiny"])
    ap.add_argument("--rows", type=int, default=40_000)
    ap.add_argument("--np", default="2,4,8,16")
    ap.add_argument("--batch", default="1024,4096,16384")
    ap.add_argument("--cache-rows", default="0", help="rows per input, or a percentage of its cardinality")
    ap.add_argument("--sgd", action="store_true", help="plain SGD: keeps_own_updates")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top-k", default="all", help="comma-separated laia top_k values; all: every input")
    ap.add_argument("--baseline", default=None, help="path of another des/baselines/allocate.py to time alongside")
    ap.add_argument("--out", default="reports/allocate")
    return ap.parse_args()


def load_baseline(path: str | None) -> ModuleType | None:
    """The other allocate.py of ``--baseline`` as a module, or None without one."""
    before = None
    if path:
        spec_ = importlib.util.spec_from_file_location("allocate_baseline", path)
        before = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(before)
    return before


def start_report(a: argparse.Namespace, keys: list[str], command: str) -> list[str]:
    """Prints the run's heading and the console table's header; returns the report's heading and
    table header (``command``: how the report was made)."""
    print(f"{a.preset}: {len(keys)} id inputs, {a.rows} rows; cache rows per input: {a.cache_rows}; "
          f"median of {a.repeats}")
    report = [f"# The allocators alone - {a.preset}, {len(keys)} id inputs, {a.rows} rows, cache rows per input "
              f"{a.cache_rows}, median of {a.repeats}", "", command, "",
              "laia samples/s: one process of this machine allocating every global batch (every process of a run "
              "does the same work). Remote ids: distinct ids of a process's samples owned by another process, "
              "summed over processes, per step (the rows a PS step moves, by the formula its measured bytes "
              "equal).", "",
              "| N | batch | top-k | laia samples/s | before samples/s | random samples/s | remote ids: contiguous "
              "| random | laia | laia vs contiguous |", "|---|---|---|---|---|---|---|---|---|---|"]
    print(f"{'N':>3} {'batch':>6} {'top-k':>5} | {'laia samples/s':>14} {'before':>10} {'ratio':>6} {'random':>10} | "
          f"remote ids per step: {'contiguous':>10} {'random':>8} {'laia':>8} {'before':>8} {'laia vs contiguous':>18}")
    return report


def cache_capacity(cache_rows: str, spec, keys: list[str]) -> dict[str, int]:
    """The simulated cache rows per input: ``cache_rows`` rows, or ``N%`` of each input's cardinality."""
    if cache_rows.endswith("%"):
        share = float(cache_rows[:-1]) / 100
        return {f.name: max(1, int(share * (f.cardinality or 0))) for f in spec.sparse()}
    return {k: int(cache_rows) for k in keys}


def timed(make: Callable, n: int, batches: list, keys: list[str], repeats: int) -> tuple[float, float]:
    """(samples/s, the median of ``repeats`` timings; remote ids per step, of the last) of the
    allocators ``make()`` returns, over ``batches``."""
    times = []
    for _ in range(repeats):
        alloc = make()
        start = time.perf_counter()
        parts = [alloc(feats, size) for feats, size in batches]
        times.append(time.perf_counter() - start)
    moved = sum(remote_ids(feats, keys, p, n) for (feats, _), p in zip(batches, parts))
    return sum(size for _, size in batches) / float(np.median(times)), moved / len(batches)


def measure(allocate: ModuleType, before: ModuleType | None, a: argparse.Namespace, keys: list[str],
            capacity: dict[str, int], tops: list[int | None], n: int, b: int, batches: list) -> list[str]:
    """Times contiguous, random and (per top-k) laia, and the baseline's laia, for N = ``n`` on the
    global batches of ``b`` samples; prints a console row per top-k and returns the report's rows."""
    report = []
    speed, remote = {}, {}
    for kind in ("contiguous", "random"):
        speed[kind], remote[kind] = timed(lambda: allocate.make(kind, n, keys, capacity, seed=1,
                                                                 keeps_own_updates=a.sgd),
                                          n, batches, keys, a.repeats)
    for k in tops:       # the baseline's laia with the same top_k (an old one without: all inputs)
        laia = dict(keeps_own_updates=a.sgd, **({} if k is None else {"top_k": k}))
        speed["before"], remote["before"] = (timed(lambda: before.make("laia", n, keys, capacity, **laia),
                                                   n, batches, keys, a.repeats)
                                             if before else (float("nan"), float("nan")))
        speed["laia"], remote["laia"] = timed(lambda: allocate.make("laia", n, keys, capacity, **laia),
                                              n, batches, keys, a.repeats)
        cut = 100.0 * (1 - remote["laia"] / remote["contiguous"]) if remote["contiguous"] else 0.0
        print(f"{n:>3} {b:>6} {k or 'all':>5} | {speed['laia']:>14,.0f} {speed['before']:>10,.0f} "
              f"{speed['laia'] / speed['before']:>6.2f} {speed['random']:>10,.0f} | {'':>20}"
              f"{remote['contiguous']:>10,.0f} {remote['random']:>8,.0f} {remote['laia']:>8,.0f} "
              f"{remote['before']:>8,.0f} {cut:>17.1f}%", flush=True)
        report.append(f"| {n} | {b} | {k or 'all'} | {speed['laia']:,.0f} | "
                      f"{format(speed['before'], ',.0f') if before else '-'} | "
                      f"{speed['random']:,.0f} | {remote['contiguous']:,.0f} | {remote['random']:,.0f} | "
                      f"{remote['laia']:,.0f} | {-cut:+.1f} % |")
    return report


def main() -> None:
    a = parse_args()
    import des  # noqa: F401
    from des.baselines import allocate
    from bench_des import write_report
    from des.jobs.compare import command_line, ensure_data
    from des.data.readers import make_dataset
    from des.data.resolve import metadata, spec_for

    data = ensure_data(a.preset, a.rows, 0, os.path.join(a.out, "data"))
    meta = metadata(data)
    spec = spec_for(meta.get("format", "criteo"), [data], 8, meta, [])
    keys = [f.name for f in spec.sparse()]
    tops = [None if k == "all" else int(k) for k in a.top_k.split(",")]
    before = load_baseline(a.baseline)
    report = start_report(a, keys, command_line("python scripts/bench_allocate.py"))
    capacity = cache_capacity(a.cache_rows, spec, keys)
    for b in [int(x) for x in a.batch.split(",")]:
        batches = [({k: v.numpy() for k, v in x.items()}, len(y))
                   for x, y in make_dataset([data], meta.get("format", "criteo"), spec, b, drop_remainder=True)]
        for n in [int(x) for x in a.np.split(",")]:
            report += measure(allocate, before, a, keys, capacity, tops, n, b, batches)
    write_report(os.path.join(a.out, "allocate.md"), report)


if __name__ == "__main__":
    main()

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

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def remote_ids(feats: dict, keys: list[str], parts: list, n: int) -> int:
    """Summed over processes: the PS's remote distinct ids of each one's share (des.baselines.ps.rewrite.analytic_bytes)."""
    from des.baselines.ps.rewrite import analytic_bytes
    tables = [(k, None, 1) for k in keys]
    return sum(analytic_bytes({k: np.asarray(feats[k])[idx] for k in keys}, tables, w, n, 0)["remote_ids"]
               for w, idx in enumerate(parts))


def main() -> None:
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
    a = ap.parse_args()
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
    before = None
    if a.baseline:
        spec_ = importlib.util.spec_from_file_location("allocate_baseline", a.baseline)
        before = importlib.util.module_from_spec(spec_)
        spec_.loader.exec_module(before)
    print(f"{a.preset}: {len(keys)} id inputs, {a.rows} rows; cache rows per input: {a.cache_rows}; "
          f"median of {a.repeats}")
    report = [f"# The allocators alone - {a.preset}, {len(keys)} id inputs, {a.rows} rows, cache rows per input "
              f"{a.cache_rows}, median of {a.repeats}", "", command_line("python scripts/bench_allocate.py"), "",
              "laia samples/s: one process of this machine allocating every global batch (every process of a run "
              "does the same work). Remote ids: distinct ids of a process's samples owned by another process, "
              "summed over processes, per step (the rows a PS step moves, by the formula its measured bytes "
              "equal).", "",
              "| N | batch | top-k | laia samples/s | before samples/s | random samples/s | remote ids: contiguous "
              "| random | laia | laia vs contiguous |", "|---|---|---|---|---|---|---|---|---|---|"]
    print(f"{'N':>3} {'batch':>6} {'top-k':>5} | {'laia samples/s':>14} {'before':>10} {'ratio':>6} {'random':>10} | "
          f"remote ids per step: {'contiguous':>10} {'random':>8} {'laia':>8} {'before':>8} {'laia vs contiguous':>18}")

    def run(make, n, batches):
        times = []
        for _ in range(a.repeats):
            alloc = make()
            start = time.perf_counter()
            parts = [alloc(feats, size) for feats, size in batches]
            times.append(time.perf_counter() - start)
        moved = sum(remote_ids(feats, keys, p, n) for (feats, _), p in zip(batches, parts))
        return sum(size for _, size in batches) / float(np.median(times)), moved / len(batches)

    if a.cache_rows.endswith("%"):
        share = float(a.cache_rows[:-1]) / 100
        capacity = {f.name: max(1, int(share * (f.cardinality or 0))) for f in spec.sparse()}
    else:
        capacity = {k: int(a.cache_rows) for k in keys}
    for b in [int(x) for x in a.batch.split(",")]:
        batches = [({k: v.numpy() for k, v in x.items()}, len(y))
                   for x, y in make_dataset([data], meta.get("format", "criteo"), spec, b, drop_remainder=True)]
        for n in [int(x) for x in a.np.split(",")]:
            speed, remote = {}, {}
            for kind in ("contiguous", "random"):
                speed[kind], remote[kind] = run(lambda: allocate.make(kind, n, keys, capacity, seed=1,
                                                                           keeps_own_updates=a.sgd), n, batches)
            for k in tops:       # the baseline's laia with the same top_k (an old one without: all inputs)
                laia = dict(keeps_own_updates=a.sgd, **({} if k is None else {"top_k": k}))
                speed["before"], remote["before"] = (run(lambda: before.make("laia", n, keys, capacity, **laia),
                                                         n, batches) if before else (float("nan"), float("nan")))
                speed["laia"], remote["laia"] = run(lambda: allocate.make("laia", n, keys, capacity, **laia),
                                                    n, batches)
                cut = 100.0 * (1 - remote["laia"] / remote["contiguous"]) if remote["contiguous"] else 0.0
                print(f"{n:>3} {b:>6} {k or 'all':>5} | {speed['laia']:>14,.0f} {speed['before']:>10,.0f} "
                      f"{speed['laia'] / speed['before']:>6.2f} {speed['random']:>10,.0f} | {'':>20}"
                      f"{remote['contiguous']:>10,.0f} {remote['random']:>8,.0f} {remote['laia']:>8,.0f} "
                      f"{remote['before']:>8,.0f} {cut:>17.1f}%", flush=True)
                report.append(f"| {n} | {b} | {k or 'all'} | {speed['laia']:,.0f} | "
                              f"{format(speed['before'], ',.0f') if before else '-'} | "
                              f"{speed['random']:,.0f} | {remote['contiguous']:,.0f} | {remote['random']:,.0f} | "
                              f"{remote['laia']:,.0f} | {-cut:+.1f} % |")
    write_report(os.path.join(a.out, "allocate.md"), report)


if __name__ == "__main__":
    main()

"""The allocators alone (des.allocate): their samples/s as N and the global batch grow, and the
remote ids a PS step fetches under each (distinct ids of a process's samples owned by another
process, summed over processes: the rows the all-to-all moves, by the formula the PS mode's
measured bytes equal).

    .venv/bin/python scripts/bench_allocate.py --preset criteo-like --np 2,4,8,16 --batch 1024,4096,16384

One process, this machine; the allocator runs in the input pipeline of every process, so its
samples/s is to be set against the training's samples/s (``des.train --allocate laia`` reports
both in its summary). ``--cache-rows``: the simulated cache per input of the cache mode (0: PS).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def remote_ids(feats: dict, keys: list[str], parts: list, n: int) -> int:
    """Summed over processes: the PS's remote distinct ids of each one's share (des.ps.analytic_bytes)."""
    from des.ps import analytic_bytes
    tables = [(k, None, 1) for k in keys]
    return sum(analytic_bytes({k: np.asarray(feats[k])[idx] for k in keys}, tables, w, n, 0)["remote_ids"]
               for w, idx in enumerate(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="criteo-like", choices=["criteo-like", "wide", "tiny"])
    ap.add_argument("--rows", type=int, default=40_000)
    ap.add_argument("--np", default="2,4,8,16")
    ap.add_argument("--batch", default="1024,4096,16384")
    ap.add_argument("--cache-rows", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="reports/allocate")
    a = ap.parse_args()
    import des  # noqa: F401
    from des import allocate
    from des.compare import ensure_data
    from des.data.readers import make_dataset
    from des.data.resolve import metadata, spec_for

    data = ensure_data(a.preset, a.rows, 0, os.path.join(a.out, "data"))
    meta = metadata(data)
    spec = spec_for(meta.get("format", "criteo"), [data], 8, meta, [])
    keys = [f.name for f in spec.sparse()]
    print(f"{a.preset}: {len(keys)} id inputs, {a.rows} rows; cache rows per input: {a.cache_rows}")
    print(f"{'N':>3} {'batch':>6} | {'laia samples/s':>14} {'random':>10} | remote ids per step: "
          f"{'contiguous':>10} {'random':>8} {'laia':>8} {'laia vs contiguous':>18}")
    for b in [int(x) for x in a.batch.split(",")]:
        batches = [({k: v.numpy() for k, v in x.items()}, len(y))
                   for x, y in make_dataset([data], meta.get("format", "criteo"), spec, b, drop_remainder=True)]
        for n in [int(x) for x in a.np.split(",")]:
            speed, remote = {}, {}
            for kind in ("contiguous", "random", "laia"):
                times, moved = [], 0
                for _ in range(a.repeats):
                    alloc = allocate.make(kind, n, keys, {k: a.cache_rows for k in keys}, seed=1)
                    start = time.perf_counter()
                    parts = [alloc(feats, size) for feats, size in batches]
                    times.append(time.perf_counter() - start)
                moved = sum(remote_ids(feats, keys, p, n) for (feats, _), p in zip(batches, parts))
                speed[kind] = len(batches) * b / float(np.median(times))
                remote[kind] = moved / len(batches)
            cut = 100.0 * (1 - remote["laia"] / remote["contiguous"]) if remote["contiguous"] else 0.0
            print(f"{n:>3} {b:>6} | {speed['laia']:>14,.0f} {speed['random']:>10,.0f} | {'':>20}"
                  f"{remote['contiguous']:>10,.0f} {remote['random']:>8,.0f} {remote['laia']:>8,.0f} {cut:>17.1f}%",
                  flush=True)


if __name__ == "__main__":
    main()

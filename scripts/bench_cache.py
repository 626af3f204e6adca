"""HET cache grid: AUC, bytes and rows moved over staleness x cache size, next to DES and the PS.

    .venv/bin/python scripts/bench_cache.py --preset criteo-like --np 4 --staleness 0,10,100,inf \
        --sizes 1%,10%,100% --model deepfm --rows 20000 --batch 1024

Runs ``des.jobs.train`` (through des.jobs.compare.run, the same runs as ``des.jobs.compare``) once for DES,
once for the PS and once per (staleness, size), under mpirun -np N, and prints one table:
held-out AUC and log loss, bytes sent per step and process (measured from the tensors handed
to collectives), its ratio to the PS, HET's measure (rows fetched + pushed per remote lookup)
and the hit rate after the cache first filled. Writes ``cache_grid.md`` / ``.json`` and
``auc_vs_bytes.png`` to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from des.jobs.compare import Cell, _fmt, command_line, ensure_data, run, train_config  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line's options, with what des.jobs.compare.train_config also reads: the held-out
    lines, one epoch of steps unless --steps, no data format or eval data (a generated preset)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="criteo-like", choices=["criteo-like", "tiny", "wide"])
    ap.add_argument("--model", default="deepfm")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--staleness", default="0,10,100,inf")
    ap.add_argument("--sizes", default="1%,10%,100%")
    ap.add_argument("--grid", choices=["full", "cross"], default="cross",
                    help="full: every (staleness, size); cross: every staleness at the first size of "
                         "--sizes, every size at the last staleness but one (fewer runs)")
    ap.add_argument("--rows", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=None,
                    help="training steps of every run (default: one epoch of the training lines)")
    ap.add_argument("--optimizer", default="sgd", help="sgd: HET's setting (workers update cached rows)")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--shuffle-buffer", type=int, default=20_000)
    ap.add_argument("--out", default="reports/cache")
    ap.add_argument("--dry-run", action="store_true",
                    help="print every run's des.jobs.train arguments and stop (no data, no runs)")
    a = ap.parse_args(argv)
    a.holdout = max(1, a.rows // 10)
    if a.steps is None:                      # des.jobs.train's --steps counts steps over epochs: one epoch here
        a.steps = max(1, (a.rows - a.holdout) // a.batch)
    a.format = a.eval_data = None            # des.jobs.compare.train_config's options: a generated preset
    a.cache_size = "10%"                     # unused by the DES and PS runs; each cache run sets its own
    return a


def plan(a: argparse.Namespace, out: str) -> tuple[list[str], list[tuple[str, str, str, str]]]:
    """(the cache sizes, every run): a run is (label in the table, des.jobs.compare cell, cache
    size, folder of its summaries); DES, the PS, then the cache runs of the --grid."""
    stale = [s for s in a.staleness.split(",") if s]
    sizes = [s for s in a.sizes.split(",") if s]
    if a.grid == "full":
        grid = [(s, z) for z in sizes for s in stale]
    else:
        pivot = stale[-2] if len(stale) > 1 else stale[0]
        grid = [(s, sizes[0] if len(sizes) == 1 else sizes[1]) for s in stale]
        grid += [(pivot, z) for z in sizes if (pivot, z) not in grid]
    runs = [("des", "des", a.cache_size, out), ("ps", "ps", a.cache_size, out)] + [
        (f"cache s={s} size={z}", f"cache s={s}", z, os.path.join(out, z.replace("%", "pct"))) for s, z in grid]
    return sizes, runs


def once(a: argparse.Namespace, key: str, data: str, folder: str) -> dict:
    """A run, or its summaries from an earlier invocation (same --out) if they are all there."""
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, f"{a.model}-{key.replace(' ', '-').replace('=', '')}.json")
    paths = [f"{base}.rank{r}" for r in range(a.np)]
    if all(os.path.exists(p) for p in paths):
        ranks = [json.load(open(p)) for p in paths]
        return dict(ranks[0], peak_rss_mib=max(r["peak_rss_mib"] for r in ranks))
    return run(key, a.model, data, a, folder)


def write_tables(a: argparse.Namespace, results: dict[str, dict], out: str) -> None:
    """Prints the grid's table and writes it to cache_grid.md, the runs' numbers to cache_grid.json."""
    ps_sent = results["ps"]["sent_bytes_per_step"]
    head = ["run", "AUC", "log loss", "bytes/step/proc", "vs PS", "rows moved/remote lookup (HET)",
            "hit rate after fill", "samples/s"]
    lines = [f"# HET cache grid - {a.preset}, {a.model}, N={a.np}, global batch {a.batch}, {a.optimizer} "
             f"lr {a.lr}, {a.rows} rows, {a.steps} steps", "",
             command_line("python scripts/bench_cache.py"), "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, r in results.items():
        lines.append("| " + " | ".join([key, _fmt(r["auc"], ".4f"), _fmt(r["logloss"], ".4f"),
                                         _fmt(r["sent_bytes_per_step"]),
                                         _fmt(r["sent_bytes_per_step"] / ps_sent, ".3f"),
                                         _fmt(r.get("het_rows_per_lookup"), ".3f"),
                                         _fmt(r.get("hit_rate_after_fill"), ".3f"),
                                         _fmt(r["samples_per_second"])]) + " |")
    md = "\n".join(lines) + "\n"
    print(md)
    with open(os.path.join(out, "cache_grid.md"), "w") as fh:
        fh.write(md)
    with open(os.path.join(out, "cache_grid.json"), "w") as fh:
        json.dump({k: {f: v.get(f) for f in ("auc", "logloss", "sent_bytes_per_step", "het_rows_per_lookup",
                                              "hit_rate", "hit_rate_after_fill", "samples_per_second",
                                              "rows_fetched_per_step", "rows_pushed_per_step",
                                              "remote_lookups_per_step", "bytes_exact_steps")}
                   for k, v in results.items()}, fh, indent=1)


def plot(a: argparse.Namespace, results: dict[str, dict], sizes: list[str], out: str) -> None:
    """auc_vs_bytes.png: held-out AUC against bytes per step, a line per cache size, DES and the PS marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for i, z in enumerate(sizes):
        pts = [(r["sent_bytes_per_step"], r["auc"], k.split()[1]) for k, r in results.items()
               if k.startswith("cache") and k.endswith(f"size={z}")]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", color=f"C{i}", label=f"cache {z}")
            for x, y, s in pts:
                ax.annotate(s, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for mode, mark in (("des", "*"), ("ps", "s")):
        ax.plot([results[mode]["sent_bytes_per_step"]], [results[mode]["auc"]], mark, color="k", markersize=11,
                label=mode.upper())
    ax.set(xscale="log", xlabel="bytes sent / step / process (measured)", ylabel="held-out AUC",
           title=f"{a.model}, {a.preset}, N={a.np}")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "auc_vs_bytes.png"), dpi=110)


def main(argv=None) -> int:
    a = parse_args(argv)
    out = os.path.join(a.out, a.preset)
    sizes, runs = plan(a, out)
    if a.dry_run:
        for _, key, size, _ in runs:
            a.cache_size = size
            print(key, " ".join(train_config(Cell.parse(key), a.model, "<data>", a, "<summary>").to_argv()))
        return 0
    os.makedirs(out, exist_ok=True)
    data = ensure_data(a.preset, a.rows, a.seed, os.path.join(a.out, "data"))
    results = {}
    for label, key, size, folder in runs:
        a.cache_size = size
        results[label] = once(a, key, data, folder)
    write_tables(a, results, out)
    plot(a, results, sizes, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

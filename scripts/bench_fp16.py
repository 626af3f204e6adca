"""What float16 partials cost in accuracy: DES on N processes with ``--wire-dtype float32`` (exact:
the single-process model) and ``float16`` (half the bytes on the wire, the partials summed in 16
bits), the same data, seed and steps, over several data/initialisation seeds. Prints a Markdown
table of held-out AUC and log loss per seed and the largest and mean differences, and writes it
to ``--report``.

    .venv/bin/python scripts/bench_fp16.py --models deepfm,wdl --seeds 0,1,2
"""
import argparse
import os
import sys
import time

import numpy as np

from bench_des import ROOT, run, write_report

sys.path.insert(0, ROOT)
from des.jobs.compare import ensure_data  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="deepfm,wdl")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--preset", default="criteo-like")
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--report", default=os.path.join(ROOT, "reports", "fp16.md"))
    a = ap.parse_args()
    seeds = [int(s) for s in a.seeds.split(",")]
    lines = [f"# What float16 partials cost in accuracy ({a.preset} preset, {a.rows} rows, N = {a.np})", "",
             f"`scripts/bench_fp16.py --models {a.models} --seeds {a.seeds} --np {a.np} --preset {a.preset} "
             f"--rows {a.rows} --batch {a.batch} --steps {a.steps} --dim {a.dim} --hidden {a.hidden}`, "
             f"{time.strftime('%Y-%m-%d')}: `des.train --mode des` under mpirun on one machine, --threads 1, "
             f"Adam (des.train's default), {a.steps} steps of {a.batch} rows; the data of each seed generated "
             f"with that seed, the model initialised with it; AUC and log loss on the last 10% of the rows, held "
             f"out. float32 partials are exact (the single-process model); float16 ones halve the bytes.", "",
             "| model | seed | AUC float32 | AUC float16 | ΔAUC | log loss float32 | log loss float16 | Δ log loss |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    tmp = os.path.join(ROOT, "reports", "compare", "fp16_runs")
    os.makedirs(tmp, exist_ok=True)
    summary = []
    for model in a.models.split(","):
        deltas = []
        for seed in seeds:
            data = ensure_data(a.preset, a.rows, seed, os.path.join(ROOT, "reports", "compare", "data"))
            r = {wire: run(a.np, "des", model, data, a, os.path.join(tmp, f"{model}_{seed}_{wire}.json"),
                           extra=("--holdout", "0.1", "--seed", str(seed), "--wire-dtype", wire))
                 for wire in ("float32", "float16")}
            d_auc = r["float16"]["auc"] - r["float32"]["auc"]
            d_loss = r["float16"]["logloss"] - r["float32"]["logloss"]
            deltas.append((d_auc, d_loss))
            lines.append(f"| {model} | {seed} | {r['float32']['auc']:.4f} | {r['float16']['auc']:.4f} | {d_auc:+.5f} "
                         f"| {r['float32']['logloss']:.4f} | {r['float16']['logloss']:.4f} | {d_loss:+.5f} |")
            print(lines[-1], flush=True)
        d = np.abs(np.array(deltas))
        summary.append(f"- {model}: largest |ΔAUC| {d[:, 0].max():.5f}, mean {d[:, 0].mean():.5f}; largest "
                       f"|Δ log loss| {d[:, 1].max():.5f}, mean {d[:, 1].mean():.5f} over {len(seeds)} seeds.")
    lines += ["", *summary]
    print("\n".join(summary))
    write_report(a.report, lines)


if __name__ == "__main__":
    main()

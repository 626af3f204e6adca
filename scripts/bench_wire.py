"""Benchmark DES past the wire-byte bound on the emulated cluster: the PS against DES as it is,
DES with K micro-batches (each slice's allreduce while the next slice's partials are computed;
exact) and DES with float16 partials on the wire (half the bytes; not exact), per model. One run
per cell (the same data and seed), N processes on the netbed (des.netbed: one host each, a link
of ``--rate``, a CPU budget of ``--cpus``); prints a Markdown table and writes it to ``--report``.

    .venv/bin/python scripts/bench_wire.py --models wdl,deepfm --np 4 --rate 1gbit --ks 4
"""
import argparse
import json
import os
import sys
import time

from bench_des import ROOT, run, write_report

sys.path.insert(0, ROOT)
from des.jobs.compare import ensure_columnar, ensure_data  # noqa: E402
from des.cluster.netbed import Netbed  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="wdl,deepfm")
    ap.add_argument("--np", type=int, default=4)
    ap.add_argument("--preset", default="wide")
    ap.add_argument("--rows", type=int, default=60_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--ks", default="4", help="micro-batch counts to run besides K = 1")
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--cpus", default="share")
    ap.add_argument("--columnar", action="store_true", help="read a columnar copy of the data (des.data.columnar)")
    ap.add_argument("--report", default=os.path.join(ROOT, "reports", "wire.md"))
    a = ap.parse_args()
    data = ensure_data(a.preset, a.rows, 0, os.path.join(ROOT, "reports", "compare", "data"))
    reader = ()
    if a.columnar:
        meta = json.load(open(data + ".meta.json"))
        data, _ = ensure_columnar([data], meta["format"], None, meta)
        reader = ("--format", "columnar")
    f16 = ("--wire-dtype", "float16")
    ks = [k for k in a.ks.split(",") if k]
    cells = [("ps", "PS", ()), ("des", "DES", ())]
    cells += [("des", f"DES, {k} micro-batches", ("--micro-batches", k)) for k in ks]
    cells += [("ps", "PS, float16 rows", f16), ("des", "DES, float16 partials", f16)]
    cells += [("des", f"DES, {k} micro-batches, float16 partials", ("--micro-batches", k, *f16)) for k in ks]
    lines = [f"# DES past the wire-byte bound: micro-batches and 16-bit partials ({a.preset} preset, "
             f"{a.rows} rows)", "",
             f"`scripts/bench_wire.py --models {a.models} --np {a.np} --preset {a.preset} --rows {a.rows} --batch "
             f"{a.batch} --steps {a.steps} --ks {a.ks} --rate {a.rate} --cpus {a.cpus}{' --columnar' * a.columnar}`, {time.strftime('%Y-%m-%d')}: "
             f"the netbed (des.netbed: one host per process at {a.rate}, CPU budget {a.cpus} each), --threads 1, "
             f"dim {a.dim}, hidden {a.hidden}, global batch {a.batch}. One run per cell; samples/s = global batch / "
             f"median step; \"vs PS\" is against the PS with the same wire dtype (float32 or float16 rows); wire = bytes rank 0's host put on its interface per step (median); AUC and log loss "
             f"on the last 10% of the rows, held out.", "",
             "| model | run | samples/s | vs PS | step ms | wire B/step (host 1) | held-out AUC | log loss |",
             "|---|---|---|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    tmp = os.path.join(ROOT, "reports", "compare", "wire_runs")
    os.makedirs(tmp, exist_ok=True)
    for model in a.models.split(","):
        ps_speed = {}
        with Netbed(a.np, rate=a.rate, cpus=a.cpus) as bed:
            for i, (mode, label, extra) in enumerate(cells):
                s = run(a.np, mode, model, data, a, os.path.join(tmp, f"{model}_{i}.json"),
                        extra=("--holdout", "0.1", *reader, *map(str, extra)), launcher=bed.mpirun(a.np))
                sps = s["samples_per_second"]
                wire = "float16" if "float16" in extra else "float32"
                ps_speed.setdefault(wire, sps)     # the PS of each wire dtype runs before DES's
                line = (f"| {model} | {label} | {sps:,.0f} | {sps / ps_speed[wire]:.2f}x | {1e3 * a.batch / sps:.1f} | "
                        f"{s.get('wire_bytes_per_step', float('nan')):,.0f} | {s['auc']:.4f} | {s['logloss']:.4f} |")
                lines.append(line)
                print(line, flush=True)
    write_report(a.report, lines)


if __name__ == "__main__":
    main()

"""Benchmark the data-parallel tail against the replicated one (and, with ``--rows-variant``, the
data-parallel tail with its first Dense by moving rows, des_ops.rows): CPU seconds per step per
process and samples/second of DES DeepFM under mpirun, for each (N, hidden) given; on the netbed
also the bytes each host sent per step. One run, medians of
``--repeats`` launches, and what ``--tail auto`` picks; prints a Markdown table and writes it to
``--report``. ``--netbed RATE``: on the emulated cluster (des.netbed: one host per process, each
with a CPU budget of its own, ``--cpus``), else on this machine's shared cores.

    .venv/bin/python scripts/bench_tail.py --rows 60000 --batch 4096 --steps 12 --repeats 2
    .venv/bin/python scripts/bench_tail.py --netbed 100mbit --configs '4:400,400,400;4:128,64' --report reports/tail_netbed.md

``--preset wide`` (~950 features per sample) reads a columnar copy of the data (as bench_peer).
"""
import contextlib
import os
import statistics
import sys
import time

from bench_des import ROOT, config_parser, preset_data, run, write_report

sys.path.insert(0, ROOT)
from des.cluster.netbed import Netbed  # noqa: E402


def horovod_settings() -> str:
    """The HOROVOD_* variables of this run (the netbed passes them to every host), for the report."""
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("HOROVOD_")}
    cycle = "" if "HOROVOD_CYCLE_TIME" in knobs else "HOROVOD_CYCLE_TIME unset (1 ms)"
    return ", ".join([f"{k}={v}" for k, v in knobs.items()] + ([cycle] if cycle else []))


def main():
    ap = config_parser("2:400,400,400;4:400,400,400;4:128,64", "tail.md")
    ap.add_argument("--netbed", default=None, metavar="RATE", help="run on the emulated cluster at this rate")
    ap.add_argument("--cpus", default="share", help="--netbed: each host's CPU budget")
    ap.add_argument("--preset", default="criteo-like", choices=["criteo-like", "wide"])
    ap.add_argument("--rows-variant", action="store_true",
                    help="also the data-parallel tail with --first-dense rows (the 'data_parallel+rows' lines)")
    a = ap.parse_args()
    variants = {"replicated": ("--tail", "replicated"), "data_parallel": ("--tail", "data_parallel", "--first-dense",
                                                                          "partials")}
    if a.rows_variant:
        variants["data_parallel+rows"] = ("--tail", "data_parallel", "--first-dense", "rows")
    data, reader, tmp = preset_data(a.preset, a.rows, "tail_runs")
    data_name = ("wide synthetic data, ~950 features per sample, read from a columnar copy" if a.preset == "wide"
                 else "criteo-like synthetic data")
    link = a.netbed or "10gbit"
    where = (f"the netbed (des.netbed: one host per process at {a.netbed}, CPU budget {a.cpus} each)" if a.netbed
             else "this machine (2 shared cores; N processes oversubscribe them)")
    lines = [f"# Data-parallel vs replicated tail (DES DeepFM, {data_name}, {a.rows} rows)", "",
             f"`scripts/bench_tail.py --preset {a.preset} --rows {a.rows} --batch {a.batch} --steps {a.steps} --repeats {a.repeats} "
             f"--configs '{a.configs}'" + (f" --netbed {a.netbed} --cpus {a.cpus}" if a.netbed else "")
             + (" --rows-variant" if a.rows_variant else "")
             + f"`, {time.strftime('%Y-%m-%d')}, {where}, --threads 1, {horovod_settings()}. Global batch {a.batch}, "
             f"dim {a.dim}; median "
             f"over launches of each launch's median step. 'auto picks': what `des.train --tail auto --link {link}"
             + (" --first-dense auto" if a.rows_variant else "") + "` chose (des.compiler.cost.choose_tail"
             + (", choose_first_dense" if a.rows_variant else "") + "), with its reason below the table.", "",
             "| N | hidden | tail | CPU s/step/process | samples/s | wire B/step/host | train AUC at the last step | "
             "CPU ratio vs replicated | samples/s ratio | auto picks |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    reasons = []
    print("\n".join(lines), flush=True)
    for config in a.configs.split(";"):
        n, hidden = config.split(":")
        a.hidden = hidden
        got = {}
        bed = Netbed(int(n), rate=a.netbed, cpus=a.cpus) if a.netbed else contextlib.nullcontext()
        with bed:
            launch = lambda name, k, *more: run(int(n), "des", "deepfm", data, a, os.path.join(tmp, f"{n}_{name}_{k}.json"),  # noqa: E731
                                                 extra=("--link", link, *reader, *more),
                                                 launcher=bed.mpirun(int(n)) if a.netbed else None)
            auto = launch("auto", 0, "--tail", "auto", "--steps", "1",
                          "--first-dense", "auto" if a.rows_variant else "partials")
            picked = auto["tail"] + ("+rows" if auto.get("first_dense_by_rows") else "")
            reasons.append(f"- N={n}, hidden {hidden}: {auto['tail_reason']}"
                           + (f"; first Dense: {auto['first_dense_reason']}" if auto.get("first_dense_reason") else ""))
            runs_by_tail = {name: [] for name in variants}
            for k in range(a.repeats):          # round-robin: a drift in the machine's load hits every variant
                for name, args in variants.items():
                    runs_by_tail[name].append(launch(name, k, *args))
        for tail, runs in runs_by_tail.items():
            got[tail] = (statistics.median(r["cpu_seconds_per_step"] for r in runs),
                         statistics.median(r["samples_per_second"] for r in runs), runs[0]["train_auc_by_step"][-1][1],
                         statistics.median(r.get("wire_bytes_per_step", float("nan")) for r in runs))
        for tail, (cpu, sps, auc, wire) in got.items():
            ratio = (f"{cpu / got['replicated'][0]:.2f}x | {sps / got['replicated'][1]:.2f}x") \
                if tail != "replicated" else " | "
            line = (f"| {n} | {hidden} | {tail} | {cpu:.3f} | {sps:,.0f} | {'' if wire != wire else f'{wire:,.0f}'} | "
                    f"{auc:.4f} | {ratio} | {'**yes**' if tail == picked else ''} |")
            lines.append(line)
            print(line, flush=True)
    lines += ["", "What the cost model weighed (`--tail auto`):", "", *reasons]
    print("\n".join(lines[-len(reasons) - 3:]))
    write_report(a.report, lines)


if __name__ == "__main__":
    main()

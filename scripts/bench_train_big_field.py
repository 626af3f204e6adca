"""des.train's own DeepFM on data whose largest field is too big for one owner (the
criteo-big-field preset: C26 has 1,000,000 values, about 80% of all fields' values), under
mpirun at each N: the table rows each process holds after training, its peak memory, samples/s
and the held-out AUC, with the field whole (``--stripe-min-rows off``: one owner) and split by key
stripe (the default). Prints a Markdown table and writes it to ``--report``:

    .venv/bin/python scripts/bench_train_big_field.py --rows 200000 --batch 4096 --worlds 4 --repeats 2

``--columnar``: every run reads a columnar copy (python -m des.data.convert): from the text, each
process parses and hashes the columns of the fields it holds, and a split C26 is every process's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from bench_des import ROOT, launch, synth_data, write_report

FIELD = "emb8_C26/emb1_C26"       # the joined table of C26 in des.train's report of rows held


def train(n: int, data: str, reader: tuple, a, out: str, stripe_min_rows: str) -> list[dict]:
    """des.train --mode des on ``n`` processes; every rank's summary."""
    args = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", sys.executable, "-m", "des.train",
            "--mode", "des", "--model", "deepfm", "--data", data, "--batch", str(a.batch), "--holdout", str(a.holdout),
            "--threads", "1", "--dim", "8", "--hidden", a.hidden, "--shuffle-buffer", "0",
            "--stripe-min-rows", stripe_min_rows, "--summary-json", out, *reader]
    launch(args)
    return [json.load(open(f"{out}.rank{r}")) for r in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=200_000)
    ap.add_argument("--holdout", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--worlds", default="4")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--columnar", action="store_true", help="every run reads a columnar copy of the text")
    ap.add_argument("--report", default=None, help="default: reports/train_big_field[_columnar].md")
    a = ap.parse_args()
    report = a.report or os.path.join(ROOT, "reports", f"train_big_field{'_columnar' if a.columnar else ''}.md")
    data = synth_data(a.rows, "criteo-big-field")
    runs, reader = os.path.dirname(data), ()
    if a.columnar:
        sys.path.insert(0, ROOT)
        from des.jobs.compare import ensure_columnar
        data, reader = ensure_columnar([data], "criteo", None, json.load(open(data + ".meta.json")))[0], \
            ("--format", "columnar")
    lines = ["# des.train with a field too big for one owner: whole or split by key stripe", "",
             f"`scripts/bench_train_big_field.py --rows {a.rows} --batch {a.batch} --worlds {a.worlds} "
             f"--repeats {a.repeats}{' --columnar' if a.columnar else ''}`, {time.strftime('%Y-%m-%d %H:%M')}, this machine (2 cores; N processes "
             f"share them). des.train --mode des --model deepfm (dim 8, hidden {a.hidden}, Adam) on "
             f"{a.rows:,} generated lines of the criteo-big-field preset (C26: 1,000,000 values)"
             f"{', read from a columnar copy' if a.columnar else ' (text)'}, one epoch less "
             f"the last {a.holdout:,} lines (held out). whole: `--stripe-min-rows off` (C26 has one owner); "
             f"split: the default (C26 split by key stripe over every process). Rows: the table rows each "
             f"process holds after training (embedding and linear weight joined in one row); C26's share of them "
             f"in brackets. Launches alternate whole / split; samples/s and peak RSS: the median over launches.",
             "", "| N | C26 | rows per process, min - max (C26's) | largest / (all / N) | peak RSS MiB, max over "
             "processes | samples/s | held-out AUC |", "|---|---|---|---|---|---|---|"]
    for n in [int(w) for w in a.worlds.split(",")]:
        got: dict[str, list] = {"whole": [], "split": []}
        for k in range(a.repeats):
            for name, smr in (("whole", "off"), ("split", "1000000")):
                got[name].append(train(n, data, reader, a, os.path.join(runs, f"{name}{n}_{k}.json"), smr))
                print(f"N = {n} {name} launch {k + 1}: {got[name][-1][0]['samples_per_second']:,.0f} samples/s",
                      flush=True)
        for name, launches in got.items():
            ranks = launches[0]
            held = [r["table_rows"]["held"] for r in ranks]
            c26 = [r["table_rows"]["tables"].get(FIELD, {}).get("held", 0) for r in ranks]
            aucs = {round(r["auc"], 6) for rs in launches for r in rs}
            lines.append(f"| {n} | {name} | {min(held):,} ({c26[held.index(min(held))]:,}) - {max(held):,} "
                         f"({c26[held.index(max(held))]:,}) | {max(held) / (sum(held) / n):.2f}x | "
                         f"{statistics.median(max(r['peak_rss_mib'] for r in rs) for rs in launches):,.0f} | "
                         f"{statistics.median(rs[0]['samples_per_second'] for rs in launches):,.0f} | "
                         f"{', '.join(f'{x:.6f}' for x in sorted(aucs))} |")
            print(lines[-1], flush=True)
    write_report(report, lines)


if __name__ == "__main__":
    main()

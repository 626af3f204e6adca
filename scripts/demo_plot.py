"""The demo's summary: one process vs DES on 2 (a user-style Keras DeepFM, examples/byom.py) and
the bytes per step each process sends, DES against the parameter server (des.train --mode ps),
as a table on stdout, one bar chart and, with ``--report``, a markdown report (date, machine,
conditions, the table) for the README to link.

    python scripts/demo_plot.py data/demo/single.json data/demo/des.json data/demo/ps.json.rank0 data/demo/demo.png
"""
from __future__ import annotations

import json
import sys


def main(single: str, des: str, ps: str, out: str, report: str | None = None, conditions: str = "") -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s, d, p = (json.load(open(f)) for f in (single, des, ps))
    for path, r in ((des, d), (ps, p)):
        if not r.get("sent_bytes_per_step"):
            sys.exit(f"error: {path}: no bytes per step were counted (sent_bytes_per_step "
                     f"{r.get('sent_bytes_per_step')!r}); is it the summary of a run on 2 processes?")
    rows = [("Keras DeepFM, 1 process", s, "-"),
            ("Keras DeepFM, DES on 2 (mpirun)", d, f"{d['sent_bytes_per_step']:,.0f}"),
            ("DeepFM, parameter server on 2", p, f"{p['sent_bytes_per_step']:,.0f}")]
    first = lambda r: f"{r['seconds_to_first_step']:.1f}" if r.get("seconds_to_first_step") else "-"  # noqa: E731
    table = ["| run | held-out AUC | log loss | bytes sent / step / process | first step done (s after start) |",
             "|---|---|---|---|---|"]
    table += [f"| {name} | {r['auc']:.4f} | {r['logloss']:.4f} | {b} | {first(r)} |" for name, r, b in rows]
    print("\n".join(table))
    ratio = p["sent_bytes_per_step"] / d["sent_bytes_per_step"]
    verdict = f"{ratio:.1f}x fewer" if ratio >= 1 else f"{1 / ratio:.1f}x more"
    line = (f"DES sends {verdict} bytes per step than the parameter server (global batch {d['batch']}): DES's "
            f"bytes grow with batch x partial width, the server's with distinct ids x embedding width")
    print(line)
    if report:
        import datetime
        import os
        import platform
        with open(report, "w") as fh:
            fh.write(f"# make demo\n\nWritten by `scripts/demo_plot.py` at the end of `make demo` on "
                     f"{datetime.date.today()}, {platform.node() or 'this machine'}: {os.cpu_count()} cores, "
                     f"{platform.platform()}.\n\nConditions: {conditions}\n\n" + "\n".join(table) + f"\n\n{line}.\n")
        print(f"report: {report}")
    fig, ax = plt.subplots(figsize=(5, 3.2))
    ax.bar(["DES", "parameter server"], [d["sent_bytes_per_step"] / 1e6, p["sent_bytes_per_step"] / 1e6],
           color=["tab:blue", "tab:gray"])
    ax.set_ylabel("MB sent per step per process")
    ax.set_title(f"DeepFM, 2 processes, batch {d['batch']}: DES sends {verdict} bytes\n"
                 f"AUC 1 process {s['auc']:.4f} = DES {d['auc']:.4f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


if __name__ == "__main__":
    main(*sys.argv[1:7])

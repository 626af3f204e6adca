"""The demo's summary: one process vs DES on 2 (a user-style Keras DeepFM, examples/byom.py) and
the bytes per step each process sends, DES against the parameter server (des.train --mode ps),
as a table on stdout and one bar chart.

    python scripts/demo_plot.py data/demo/single.json data/demo/des.json data/demo/ps.json.rank0 data/demo/demo.png
"""
from __future__ import annotations

import json
import sys


def main(single: str, des: str, ps: str, out: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s, d, p = (json.load(open(f)) for f in (single, des, ps))
    print(f"{'run':<34} {'held-out AUC':>12} {'log loss':>9} {'bytes sent / step / process':>28}")
    print(f"{'Keras DeepFM, 1 process':<34} {s['auc']:>12.4f} {s['logloss']:>9.4f} {'-':>28}")
    print(f"{'Keras DeepFM, DES on 2 (mpirun)':<34} {d['auc']:>12.4f} {d['logloss']:>9.4f} "
          f"{d['sent_bytes_per_step']:>28,.0f}")
    print(f"{'DeepFM, parameter server on 2':<34} {p['auc']:>12.4f} {p['logloss']:>9.4f} "
          f"{p['sent_bytes_per_step']:>28,.0f}")
    ratio = p["sent_bytes_per_step"] / d["sent_bytes_per_step"]
    verdict = f"{ratio:.1f}x fewer" if ratio >= 1 else f"{1 / ratio:.1f}x more"
    print(f"DES sends {verdict} bytes per step than the parameter server (global batch {d['batch']}): DES's bytes "
          f"grow with batch x partial width, the server's with distinct ids x embedding width")
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
    main(*sys.argv[1:5])

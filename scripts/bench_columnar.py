"""Input cost of one DES process vs N: text parsing (every process parses every field) against the
columnar layout (a process reads the labels, its own fields' columns and the first field's).

    .venv/bin/python scripts/bench_columnar.py --rows 10000 --batch 2048 --np 1,2,4,8 --repeats 3   # -> reports/columnar.md

Generates the wide preset (~950 features per line), converts it once (python -m des.data.convert,
timed), then times a pass of each reader (steady state: the clock starts after the first batch;
median of --repeats) as rank 0 of N would read it, with rank 0's fields under the balanced plan
(des.compiler.plan over each field's rows x width and lookups). One process, this machine: rows/s per
process, which is what each host would see on a cluster.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--np", default="1,2,4,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--preset", default="wide", choices=["wide", "criteo-like"])
    ap.add_argument("--report", default=os.path.join(ROOT, "reports", "columnar.md"))
    a = ap.parse_args()
    import des  # noqa: F401
    from bench_des import write_report
    from bench_readers import time_reader
    from des.jobs.compare import command_line
    from des.data import columnar
    from des.data.readers import make_dataset
    from des.data.resolve import spec_for
    from des.compiler.plan import FieldCost, make_plan

    tmp = tempfile.mkdtemp()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    text = os.path.join(tmp, "data.ffm" if a.preset == "wide" else "data.txt")
    subprocess.run([sys.executable, "-m", "des.data.synth", "--preset", a.preset, "--rows", str(a.rows),
                    "--out", text], env=env, cwd=ROOT, check=True, capture_output=True)
    meta = json.load(open(text + ".meta.json"))
    fmt = meta["format"]
    spec = spec_for(fmt, [text], 8, meta)
    cols = os.path.join(tmp, "data.cols")
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "des.data.convert", "--data", text, "--out", cols], env=env, cwd=ROOT,
                   check=True, capture_output=True)
    convert_s = time.perf_counter() - t0
    text_rate = time_reader(lambda: make_dataset([text], fmt, spec, a.batch), a.repeats)
    lines = [f"# Reader rows/s per DES process, {a.preset} preset ({meta.get('active_features_per_sample', '?')} "
             f"features/line), {a.rows:,} rows, batch {a.batch}, medians of {a.repeats}", "",
             command_line("python scripts/bench_columnar.py") + " One process, page cache warm; the clock starts "
             "after the first batch. Rank 0's inputs under the balanced plan of N processes.", "",
             f"Conversion (once, one process): {convert_s:.1f} s = {a.rows / convert_s:,.0f} rows/s.", "",
             "| N | inputs read by rank 0 | text rows/s (any N) | columnar rows/s | columnar ÷ text |",
             "|---|---|---|---|---|"]
    print("\n".join(lines), flush=True)
    first = spec.sparse()[0].name
    for n in [int(x) for x in a.np.split(",")]:
        plan = make_plan([FieldCost(f.name, rows=f.cardinality or 1, width=f.dim + 1, lookups=f.max_len)
                          for f in spec.sparse()], n)
        fields = [f for f in spec if plan.owner.get(f.name) == 0 or f.name == first or f.kind == "numeric"]
        inputs = [x for f in fields for x in ([f.name, f.weight_name] if f.weighted else [f.name])]
        rate = time_reader(lambda: columnar.make_dataset(cols, spec, a.batch, inputs=inputs), a.repeats)
        lines.append(f"| {n} | {len(inputs)} of {len(spec.input_names())} | {text_rate:,.0f} | {rate:,.0f} | "
                     f"{rate / text_rate:.1f}x |")
        print(lines[-1], flush=True)
    write_report(a.report, lines)


if __name__ == "__main__":
    main()

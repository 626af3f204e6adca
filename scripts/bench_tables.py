"""Fused (and joined) vs per-field tables: time to the first training step and samples/s of des.train on a
39-field criteo-like file (one id per field) or on the wide preset (26 one-id fields and 20
multi-valued ones, ~950 ids a sample), for the single process, DES and the PS on 2 processes with
each table layout (per-field; fused: one table per width; joined: fused, each field's linear weight
in its embedding's row, des.train's default), and the cache mode on 2 processes (per-field, fused); with the
single process, a control: two single processes started at once (what sharing the cores costs). Medians
of ``--repeats`` rounds, each running every layout once (a slow spell of the shared machine then
hits all layouts alike), and per layout the lowest and highest ratio to per-field within a round;
writes reports/tables.md (criteo-like) or reports/tables_wide.md; ``--modes`` runs some modes only
(then give ``--out``, e.g. reports/tables_cache.md). ``--columnar``: every run reads a columnar copy
of the data (des.data.convert; a DES process then reads its own fields' columns only, where from
text it checks every line in full), so the table layout, not the text parser, sets the pace.

    .venv/bin/python scripts/bench_tables.py --rows 100000 --batch 4096 --steps 20 --repeats 3 --threads 1
    .venv/bin/python scripts/bench_tables.py --preset wide --rows 20000 --batch 1024 --steps 10 --repeats 3 --threads 1

Each run is a whole des.train process (mpirun for N > 1): "first step" is from the start of
des.train's main() to the end of its first training step (reading the first batch, building the
model, des.transform, tracing fit's train function), as a user waits for it.
"""
import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2")
RUNS = [("single", 1, "per-field"), ("single", 1, "fused"), ("single", 1, "joined"),
        ("single", 2, "joined"),   # the control: two single processes at once (see ``train``)
        ("des", 2, "per-field"), ("des", 2, "fused"), ("des", 2, "joined"),
        ("ps", 2, "per-field"), ("ps", 2, "fused"), ("ps", 2, "joined"),
        ("cache", 2, "per-field"), ("cache", 2, "fused")]
MODES = list(dict.fromkeys(mode for mode, _, _ in RUNS))
DATA = {"criteo-like": "39 one-id fields", "wide": "26 one-id and 20 multi-valued fields, ~950 ids a sample"}


def train(mode: str, n: int, tables: str, data: str, a, out: str) -> dict:
    def command(out: str) -> list[str]:
        return [sys.executable, "-m", "des.train", "--mode", mode, "--model", a.model, "--data", data,
                *(("--format", "columnar") if a.columnar else ()),
                "--batch", str(a.batch), "--steps", str(a.steps), "--holdout", "2000", "--dim", str(a.dim),
                "--hidden", a.hidden, "--threads", str(a.threads), "--summary-json", out, "--tables", tables,
                "--check-bytes", "2"]    # the PS's and the cache's byte check on 2 steps (scripts/bench_des.py says why)
    args = command(out)
    if mode == "single" and n > 1:     # n single processes at once, each alone: what sharing the cores costs
        logs = [open(out + f".{k}.log", "w+") for k in range(n)]    # a file, not a pipe nobody reads
        procs = [subprocess.Popen(command(out + f".{k}"), env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=log) for k, log in enumerate(logs)]
        for p, log in zip(procs, logs):
            if p.wait():
                log.seek(0)
                raise SystemExit(f"{' '.join(p.args)} failed:\n{log.read()[-2000:]}")
        got = [json.load(open(out + f".{k}")) for k in range(n)]
        return dict(got[0], seconds_to_first_step=max(g["seconds_to_first_step"] for g in got),
                    samples_per_second=min(g["samples_per_second"] for g in got))
    if n > 1:
        args = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none"] + args
    p = subprocess.run(args, env=ENV, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(args)} failed:\n{p.stderr[-2000:]}")
    return json.load(open(out if n == 1 else out + ".rank0"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="criteo-like", choices=["criteo-like", "wide"])
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--model", default="deepfm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="TF threads per process (0: TF's default; 2 processes x "
                    "TF's default oversubscribe 2 cores)")
    ap.add_argument("--modes", default=",".join(MODES), help="which modes to run, comma-separated")
    ap.add_argument("--out", help="default: reports/tables.md, reports/tables_wide.md for --preset wide")
    ap.add_argument("--columnar", action="store_true", help="read a columnar copy of the data (then give --out)")
    a = ap.parse_args()
    modes = a.modes.split(",")
    if set(modes) - set(MODES):
        raise SystemExit(f"--modes {a.modes}: a comma-separated subset of {','.join(MODES)}")
    if (set(modes) != set(MODES) or a.columnar) and not a.out:
        raise SystemExit("--modes (some modes only) or --columnar: give --out, so that the text report is not "
                         "overwritten")
    a.out = a.out or os.path.join(ROOT, "reports", "tables.md" if a.preset == "criteo-like" else "tables_wide.md")
    tmp = tempfile.mkdtemp()
    data = os.path.join(tmp, "train.txt" if a.preset == "criteo-like" else "train.ffm")
    subprocess.run([sys.executable, "-m", "des.data.synth", "--preset", a.preset, "--rows", str(a.rows),
                    "--out", data], env=ENV, cwd=ROOT, check=True, capture_output=True)
    if a.columnar:
        subprocess.run([sys.executable, "-m", "des.data.convert", "--data", data, "--out", data + ".cols"],
                       env=ENV, cwd=ROOT, check=True, capture_output=True)
        data += ".cols"
    rows, began = [], time.time()
    runs = [r for r in RUNS if r[0] in modes]
    got: dict[tuple, list[dict]] = {run: [] for run in runs}
    for r in range(a.repeats):        # round by round, every layout once a round: a slow spell of the
        for mode, n, tables in runs:  # shared machine hits all layouts alike, not one layout's repeats
            got[(mode, n, tables)].append(train(mode, n, tables, data, a, os.path.join(tmp, f"{mode}{n}{tables}{r}.json")))
            print(f"round {r + 1}: {mode} N={n} {tables}: {got[(mode, n, tables)][-1]['samples_per_second']:.0f} "
                  f"samples/s", flush=True)
    for mode, n, tables in runs:
        g = got[(mode, n, tables)]
        first = statistics.median(x["seconds_to_first_step"] for x in g)
        speed = statistics.median(x["samples_per_second"] for x in g)
        per_field = got.get((mode, n, "per-field"), [])
        spread = [x["samples_per_second"] / b["samples_per_second"] for x, b in zip(g, per_field)]
        rows.append((mode, n, tables, first, speed, g[0]["auc"], g[0]["logloss"], spread))
    base = {(m, n): (f, s) for m, n, t, f, s, *_ in rows if t == "per-field"}
    lines = [f"# Fused vs per-field tables: {a.model}, {a.preset} ({DATA[a.preset]}), dim {a.dim}, hidden {a.hidden}, "
             f"global batch {a.batch}",
             "",
             f"Written by `scripts/bench_tables.py --preset {a.preset} --rows {a.rows} --batch {a.batch} --steps {a.steps} "
             f"--repeats {a.repeats} --threads {a.threads} --modes {a.modes}" + (" --columnar" if a.columnar else "")
             + f" --out {os.path.relpath(a.out, ROOT)}` on {platform.node()} "
             f"({os.cpu_count()} cores, shared), "
             f"{time.strftime('%Y-%m-%d %H:%M', time.gmtime(began))} UTC. Medians of {a.repeats} runs, run round by "
             f"round (every layout once a round, so that a slow spell of the shared machine hits all alike); "
             f"first step = from des.train's start to the end of its first training step."
             + (" Every run reads a columnar copy of the data (des.data.convert)." if a.columnar else ""),
             "",
             "| mode | N | tables | first step (s) | samples/s | first step vs per-field | samples/s vs per-field "
             "| same round's ratio, min-max | held-out AUC | log loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for mode, n, tables, first, speed, auc, loss, spread in rows:
        ref = base.get((mode, n))
        vs = (f"{ref[0] / first:.2f}x faster", f"{speed / ref[1]:.2f}x") if ref and tables != "per-field" else ("", "")
        rng = f"{min(spread):.2f}-{max(spread):.2f}" if spread and tables != "per-field" else ""
        label = f"{mode}, {n} at once" if mode == "single" and n > 1 else mode
        lines.append(f"| {label} | {n} | {tables} | {first:.1f} | {speed:.0f} | {vs[0]} | {vs[1]} | {rng} | {auc:.6f} | "
                     f"{loss:.6f} |")
    if any(m == "single" and n > 1 for m, n, *_ in rows):
        lines += ["", "single, 2 at once: the control. Two single processes started together, each training "
                  "its own copy alone (its first step: the later of the two; samples/s: the slower): what two "
                  "processes sharing the machine's cores cost with no collective at all, the floor under the "
                  "2-process modes' first step."]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written to {a.out}")


if __name__ == "__main__":
    main()

"""Every test tolerance next to what the code achieves: runs the tests behind the bounds listed in
issue 63 (pytest -s; each bound is checked by tests/helpers.py ``within``, which prints
``MEASURED <test id> <name> <value> <bound>``), collects those lines and writes a table of
test, assertion, bound, measured values, ratio bound / largest measured and the command. Then it
measures, in one process, why Adam's bound on rows and weights is wider than SGD's: the
untouched model trained twice on the same batches with their rows in another order (the same
sums in another float32 order, no DES at all) against DES on 1 and 3 simulated processes, over
5 build seeds.

    .venv/bin/python scripts/tolerances.py                      # about 20 minutes on 2 cores
    .venv/bin/python scripts/tolerances.py --only mpi_microbatch,tail --repeat 2 --out /tmp/t.md
    .venv/bin/python scripts/tolerances.py --adam-only          # the order experiment alone

``--repeat R`` runs every case R times (the table keeps every value); the mpirun cases should be
trusted only after a few runs."""
import argparse
import datetime
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = os.path.join(ROOT, ".venv", "bin", "python")

# (short name, pytest arguments, what the bounds stand for); one pytest process each, in this order
CASES = [
    # (issue 60's two newest checks, kept_tables_whole and by_samples, are left to that issue)
    ("mpi", ["tests/test_mpi.py", "-k", "not disagree and not kept_tables_whole and not by_samples"],
     "DES, PS, cache and laia under a real mpirun against one process"),
    ("mpi_microbatch", ["tests/test_mpi_microbatch.py"], "micro-batches and float16 partials under mpirun"),
    ("cache", ["tests/test_cache.py", "-k", "cache_cli_under_mpirun"], "a cache run's checkpoint restored by one process"),
    ("predict", ["tests/test_predict.py", "-k", "under_mpirun"], "DES checkpoints predicting like one process's"),
    ("compare_data", ["tests/test_compare_data.py", "-k", "user_files"], "des.compare's DES AUC against one process's"),
    ("tail", ["tests/test_tail.py", "-k", "equals_one_process or adaptive or same_bits"],
     "the data-parallel tail in the simulated world"),
    ("microbatch", ["tests/test_microbatch.py", "-k", "float16"], "float16 partials and PS float16 rows"),
    ("gallery", ["tests/test_gallery.py", "-k", "build_seeds or substituted_and_equivalent"],
     "every gallery model (Adam N = 1, 3; SGD N = 2) and DeepCTR's DeepFM over 5 build seeds"),
]
# tests/test_netbed.py's |AUC DES - AUC PS| < 1e-3 prints nothing: its two jobs are run here instead,
# under a plain mpirun (the emulated link changes the time a step takes, not what it sums)
NETBED = ("test_netbed.py::test_des_and_ps_jobs_across_two_emulated_hosts",
          "|AUC DES - AUC PS| (the test's jobs, run by this script under a plain mpirun -np 2)", 1e-7)
MEASURED = re.compile(r"^MEASURED (\S+) (\S+:\d+) (.+) (\S+) (\S+)$")


def run_case(args: list[str]) -> tuple[list[tuple[str, str, str, float, float]], str, float]:
    """pytest -s on ``args``: the MEASURED lines as (test id, file:line, name, value, bound), the
    summary line and the seconds it took."""
    t0 = time.time()
    cmd = [PY, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", *args]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    rows = []
    for line in done.stdout.splitlines():
        m = MEASURED.match(line.strip())
        if m:
            rows.append((m.group(1), m.group(2), m.group(3), float(m.group(4)), float(m.group(5))))
    summary = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
    if done.returncode not in (0, 5):
        summary = "FAILED: " + summary + " " + "; ".join(
            line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR")))[:600]
    return rows, summary, time.time() - t0


def netbed_auc_gap() -> float:
    """tests/test_netbed.py's two jobs (its TRAIN, 12,000 lines of write_small_ffm seed 2) under
    mpirun -np 2 on this machine: |held-out AUC of DES - that of the PS|."""
    import json
    import tempfile
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import mpirun, write_small_ffm
    from test_netbed import TRAIN
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "train.ffm")
        write_small_ffm(data, 12_000, seed=2)
        auc = {}
        for mode in ("des", "ps"):
            run = mpirun(2, *TRAIN, "--mode", mode, "--data", data, "--summary-json", os.path.join(tmp, f"{mode}.json"))
            assert run.returncode == 0, run.stderr[-3000:]
            ranks = [json.load(open(os.path.join(tmp, f"{mode}.json.rank{r}"))) for r in range(2)]
            assert ranks[0]["auc"] == ranks[1]["auc"]
            auc[mode] = ranks[0]["auc"]
    return abs(auc["des"] - auc["ps"])


def fmt(v: float) -> str:
    return "0" if v == 0 else f"{v:.1e}"


def adam_order_experiment(seeds=(0, 1, 2, 3, 4), name: str = "deepctr_deepfm_defaults") -> list[str]:
    """The gallery's case (20 steps of 32 rows, its learning rates), per build seed and optimizer:
    the untouched model against (a) itself trained on the same batches with each batch's rows
    permuted (the same mean loss; only float32 summation order differs), (b) DES on 1 simulated
    process, (c) DES on 3. Max over rows and weights, and over predictions (tests' compare)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import tensorflow as tf

    import des
    from des.jobs.verify import compare, copy_state, fit_and_snapshot, run_in_process_world
    from gallery import BUILDERS, batches_for, rows_reordered

    tf.config.threading.set_inter_op_parallelism_threads(64)
    build = BUILDERS[name]
    lines = ["| optimizer | build seed | quantity | rows permuted, one process | DES N = 1 | DES N = 3 |",
             "|---|---|---|---|---|---|"]
    top: dict = {}                # (optimizer, column) -> the largest rows-and-weights difference
    for optimizer, lr in (("adam", 0.02), ("sgd", 0.5)):
        for seed in seeds:
            tf.keras.utils.set_random_seed(seed)
            base = build()
            des.make_keyed(base, seed=0)
            batches = batches_for(base, 20, 32, seed=4)
            probe = batches_for(base, 1, 16, seed=99)[0][0]
            permuted = rows_reordered(batches, seed)

            def fresh():
                m = build()
                copy_state(base, m)
                des.make_keyed(m, seed=0)
                return m
            fit = lambda m, b=batches: fit_and_snapshot(m, b, probe, optimizer=optimizer, learning_rate=lr)  # noqa: E731
            ref = fit(fresh())
            diffs = [compare(ref, [fit(fresh(), permuted)])]
            for n in (1, 3):
                diffs.append(compare(ref, run_in_process_world(n, build, fit, init_from=base)))
            state = [max(d["tables"], d["owned"], d["weights"]) for d in diffs]
            for column, v in zip(("reordered", "N=1", "N=3"), state):
                top[optimizer, column] = max(top.get((optimizer, column), 0.0), v)
            preds = [d["predictions"] for d in diffs]
            lines.append(f"| {optimizer} | {seed} | rows and weights | " + " | ".join(fmt(v) for v in state) + " |")
            lines.append(f"| {optimizer} | {seed} | predictions | " + " | ".join(fmt(v) for v in preds) + " |")
            print(lines[-2], lines[-1], sep="\n", flush=True)
    lines += ["", f"Largest over the {len(seeds)} seeds, rows and weights: Adam {fmt(top['adam', 'reordered'])} "
              f"with the rows reordered on one process, {fmt(top['adam', 'N=1'])} DES N = 1, {fmt(top['adam', 'N=3'])} "
              f"DES N = 3; SGD {fmt(top['sgd', 'reordered'])}, {fmt(top['sgd', 'N=1'])}, {fmt(top['sgd', 'N=3'])}. "
              "Under Adam a change of float32 order alone, with no DES in the run, moves rows and weights as far "
              "as DES does, and the seed that gives DES its largest difference gives the reorder its largest too; "
              "under SGD the same changes stay at float32's resolution. So Adam's wider bound is float32 order "
              "amplified by Adam's step m / (sqrt(v) + eps) (about +-lr wherever a coordinate's gradients are near "
              "zero), not a DES error; summing the partials in float64 or in another fixed order would still "
              "leave DES a float32 order away from the untouched model, whose own spread under a reorder is this "
              "large. tests/test_gallery.py holds DES to 1e-4 and to 3x that one-process spread at each seed."]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="comma-separated case names (default: all): "
                    + ", ".join(c[0] for c in CASES) + ", netbed")
    ap.add_argument("--repeat", type=int, default=1, help="runs of every case (default 1)")
    ap.add_argument("--adam-only", action="store_true", help="only the Adam order experiment")
    ap.add_argument("--no-adam", action="store_true", help="skip the Adam order experiment")
    ap.add_argument("--out", default=os.path.join(ROOT, "reports", "tolerances.md"))
    a = ap.parse_args()
    if a.adam_only:
        print("\n".join(adam_order_experiment()))
        return
    t0 = time.time()
    found, runs = collect(set(filter(None, a.only.split(","))), a.repeat)
    adam = [] if a.no_adam else adam_order_experiment()
    out = report_lines(a, found, runs, adam, (time.time() - t0) / 60)
    with open(a.out, "w") as fh:
        fh.write("\n".join(out) + "\n")
    print(f"written: {a.out}")


def collect(only: set, repeat: int) -> tuple[dict, list]:
    """Run the cases (``only``: their names; empty: all), ``repeat`` times each: (the bounds found,
    the runs)."""
    # one bound: one call of ``within`` in the source, whichever tests reach it, with all their
    # parametrised and looped cases: (file:line, assertion, bound) -> [case name, {test functions}, [(value, where)]]
    found: dict = {}

    def add(test: str, site: str, name: str, value: float, bound: float, case: str) -> None:
        function, _, param = test.partition("[")
        assertion, _, where = name.partition(" @ ")
        where = " ".join(filter(None, [param.rstrip("]"), where]))
        entry = found.setdefault((site, assertion, bound), [case, [], []])
        name = function.split("::")[-1]
        if name not in entry[1]:
            entry[1].append(name)
        entry[2].append((value, where if len(entry[1]) == 1 else f"{name} {where}".strip()))
    runs = []
    for case, args, what in CASES:
        if only and case not in only:
            continue
        for i in range(repeat):
            rows, summary, secs = run_case(args)
            runs.append((case, " ".join(args), summary, secs))
            print(f"[tolerances] {case} run {i + 1}: {summary} ({secs:.0f} s, {len(rows)} values)", flush=True)
            for test, site, name, value, bound in rows:
                add(test, site, name, value, bound, case)
    if not only or "netbed" in only:
        for i in range(repeat):
            t1 = time.time()
            gap = netbed_auc_gap()
            runs.append(("netbed", "des.train --mode des / --mode ps, mpirun -np 2", f"|AUC gap| {gap:.3e}", time.time() - t1))
            print(f"[tolerances] netbed jobs run {i + 1}: |AUC gap| {gap:.3e}", flush=True)
            add(NETBED[0], "test_netbed.py:51", NETBED[1], gap, NETBED[2], "netbed")
    return found, runs


def report_lines(a, found: dict, runs: list, adam: list, minutes: float) -> list[str]:
    """reports/tolerances.md's lines."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    out = ["# Test tolerances against what the code achieves",
           "",
           f"`.venv/bin/python scripts/tolerances.py{' --repeat ' + str(a.repeat) if a.repeat > 1 else ''}"
           f"{' --only ' + a.only if a.only else ''}` at {commit}, {now}, {os.cpu_count()} cores, "
           f"{minutes:.0f} min. Each row is one bound: one call of `within(name, value, bound)` "
           "(tests/helpers.py) at the file:line named, over every test that reaches it and all their "
           "parametrised and looped cases (and runs); \"largest\" is the largest value it measured and where, "
           "\"values\" how many it checked, "
           "\"ratio\" the bound over the largest. The rule (issue 63): no bound looser than 10x what it "
           "measures; where every value is 0 the bound is 1e-7 (float32's resolution near 1 is 6e-8; for an "
           "AUC over 2,000 lines one pair of predictions in the other order moves it by about 1e-6).",
           "",
           "| where | test | assertion | bound | largest measured (where) | values | ratio | command |",
           "|---|---|---|---|---|---|---|---|"]
    cmds = {c[0]: f"`.venv/bin/python -m pytest -s {' '.join(c[1])}`" for c in CASES}
    cmds["netbed"] = "`.venv/bin/python scripts/tolerances.py --only netbed`"
    detail = ["", "## Every value", "", "| where | assertion | bound | values, largest first (where) |", "|---|---|---|---|"]
    for (site, assertion, bound), (case, functions, values) in found.items():
        values.sort(key=lambda vw: -vw[0])
        top, where = values[0]
        ratio = "all 0" if top == 0 else f"{bound / top:.1f}"
        out.append(f"| {site} | {', '.join(functions)} | {assertion} | {fmt(bound)} | "
                   f"{fmt(top)}{f' ({where})' if where else ''} | {len(values)} | {ratio} | {cmds[case]} |")
        detail.append(f"| {site} | {assertion} | {fmt(bound)} | "
                      + ", ".join(f"{fmt(v)}{f' ({w})' if w else ''}" for v, w in values) + " |")
    out += ["", "Runs:", ""]
    out += [f"- {case}: `{args}`: {summary} ({secs:.0f} s)" for case, args, summary, secs in runs]
    out += detail
    if adam:
        out += ["", "## Why Adam's bound on rows and weights is wider than SGD's", "",
                "The gallery's DeepCTR DeepFM with its defaults (tests/gallery.py `deepctr_deepfm_defaults`: 8 "
                "fields, DNN 256-128-64, L2 on the tables), 20 steps of 32 rows, Adam at 0.02 and SGD at 0.5 as "
                "in tests/test_gallery.py, over 5 build seeds (`tf.keras.utils.set_random_seed`). Each column "
                "is the largest difference (tests' `compare`: absolute or relative, whichever is smaller) from "
                "the untouched model on one process. \"rows permuted\" is that same untouched model on one "
                "process, trained on the same batches with each batch's rows in another order: the same mean "
                "loss, the same gradients in exact arithmetic, only the float32 order of the sums over rows "
                "differs; no DES code runs. (`.venv/bin/python scripts/tolerances.py --adam-only`)", ""]
        out += adam
    return out


if __name__ == "__main__":
    main()

"""des.compare on the user's own files (--data --format [--eval-data]) instead of a generated preset.

The data is a small generated libffm file (tests/helpers.py write_small_ffm) with its .meta.json
removed, as a user's file has none: the spec is then scanned from the training and evaluation
files, and the Bayes-optimal AUC is unknown."""
import csv
import json
import os
import subprocess
import sys

import pytest

from helpers import within, write_small_ffm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)


def _user_file(path: str, rows: int, seed: int) -> str:
    """A libffm file without metadata (the generator's .meta.json deleted)."""
    write_small_ffm(path, rows, seed=seed)
    if os.path.exists(path + ".meta.json"):
        os.remove(path + ".meta.json")
    return path


@pytest.mark.mpi
def test_compare_runs_on_user_files_without_metadata(tmp_path):
    """single and DES (N=2) on a libffm file and an evaluation file, neither with metadata: the
    report is under <out>/<file name>, names the files, DES's held-out AUC equals one process's,
    and the Bayes-optimal AUC is 'unknown'."""
    train = _user_file(str(tmp_path / "train.ffm"), 2000, seed=1)
    evalf = _user_file(str(tmp_path / "eval.ffm"), 500, seed=2)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "des.compare", "--data", train, "--format", "libffm",
                        "--eval-data", evalf, "--models", "lr", "--modes", "single,des", "--np", "2",
                        "--batch", "256", "--steps", "3", "--hidden", "8", "--dim", "4", "--out", str(out)],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    folder = out / "train.ffm"
    assert not (out / "data").exists()                      # nothing generated
    with open(folder / "comparison.csv") as fh:
        by = {row["mode"]: row for row in csv.DictReader(fh)}
    assert set(by) == {"single", "des"} and by["des"]["processes"] == "2"
    auc_single, auc_des = float(by["single"]["auc"]), float(by["des"]["auc"])
    assert 0 < auc_single < 1
    within("|AUC - single's|", abs(auc_des - auc_single), 1e-7)      # measured 0, twice
    md = (folder / "comparison.md").read_text()
    assert train in md.splitlines()[0] and evalf in md.splitlines()[0] and "preset" not in md.splitlines()[0]
    assert "Bayes-optimal AUC of the data: unknown." in md
    runs = [line for line in r.stdout.splitlines() if line.startswith("[compare] lr ")]
    assert len(runs) == 2 and all("--format libffm" in c and f"--eval-data {evalf}" in c and "--holdout" not in c
                                  for c in runs)


def test_data_without_format_or_metadata_is_a_usage_error(tmp_path):
    data = _user_file(str(tmp_path / "mine.ffm"), 20, seed=0)
    r = subprocess.run([sys.executable, "-m", "des.compare", "--data", data, "--out", str(tmp_path / "out")],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "--format" in r.stderr and len(r.stderr.strip().splitlines()[-1]) < 300
    assert not (tmp_path / "out").exists()


def test_markdown_without_metadata_says_the_bayes_auc_is_unknown():
    from des.jobs.compare import markdown, table_rows
    s = {"world_size": 1, "auc": 0.7, "logloss": 0.5, "samples_per_second": 100.0, "peak_rss_mib": 10.0}
    results = {"lr": {"single": s}}
    from des.jobs.compare import parser
    a = parser().parse_args(["--data", "a.ffm", "b.ffm", "--np", "2", "--batch", "256", "--steps", "3"])
    md = markdown(table_rows(results), results, a, {})
    assert md.startswith("# DES vs PS vs one process - data a.ffm, b.ffm, N=2")
    assert "Bayes-optimal AUC of the data: unknown." in md


def test_columnar_copies_are_made_once_and_remade_when_the_data_changes(tmp_path):
    """des.compare --columnar: the data and eval files get columnar copies beside them with the spec
    scanned from both (the eval file's longer bags fit), reused while fresh, remade when a file is newer."""
    import time
    from des.jobs.compare import ensure_columnar
    from des.data import columnar
    train, evalf = str(tmp_path / "train.ffm"), str(tmp_path / "eval.ffm")
    write_small_ffm(train, 300, seed=1)
    write_small_ffm(evalf, 100, seed=2)
    with open(evalf, "a") as fh:
        fh.write("1 0:1:1 1:7:1 1:8:1 1:9:1\n")          # field 1 holds 3 features here only
    meta = json.load(open(train + ".meta.json"))
    meta.pop("spec")                                      # scan the spec from both files
    cols, ecols = ensure_columnar([train], "libffm", [evalf], meta)
    assert (cols, ecols) == (train + ".cols", evalf + ".cols")
    assert columnar.manifest(cols)["rows"] == 300 and columnar.manifest(ecols)["rows"] == 101
    assert columnar.spec_of(cols)["F1"].max_len == columnar.spec_of(ecols)["F1"].max_len == 3
    stamp = os.path.getmtime(os.path.join(cols, "columns.json"))
    assert ensure_columnar([train], "libffm", [evalf], meta) == (cols, ecols)
    assert os.path.getmtime(os.path.join(cols, "columns.json")) == stamp            # reused
    time.sleep(0.05)
    write_small_ffm(train, 200, seed=3)
    ensure_columnar([train], "libffm", [evalf], meta)
    assert columnar.manifest(cols)["rows"] == 200                                    # remade


def test_bench_cache_plans_one_epoch_per_run_and_each_cells_cache_size(capsys):
    """scripts/bench_cache.py (the HET grid) builds its des.train runs from des.compare's: every run
    trains one epoch of the training lines (des.train's --steps counts over epochs), and each cache
    run has its staleness and size. It once stopped before its first run (a missing option) and
    meant 10,000 steps as "one epoch"."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_cache", os.path.join(ROOT, "scripts", "bench_cache.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--dry-run", "--rows", "20000", "--batch", "1024", "--staleness", "0,100,inf",
                       "--sizes", "1%,10%"]) == 0
    runs = [line.split(" --", 1) for line in capsys.readouterr().out.strip().splitlines()]
    assert [key for key, _ in runs] == ["des", "ps", "cache s=0", "cache s=100", "cache s=inf", "cache s=100"]
    epoch = (20000 - 2000) // 1024                                  # 10 % held out
    for key, argv in runs:
        args = ("--" + argv).split()
        assert args[args.index("--steps") + 1] == str(epoch), (key, args)
        assert args[args.index("--mode") + 1] == key.split()[0]
    caches = [("--" + argv).split() for key, argv in runs[2:]]
    sizes = [a[a.index("--cache-size") + 1] if "--cache-size" in a else "10%" for a in caches]   # 10 %: the default
    stale = [a[a.index("--staleness") + 1] if "--staleness" in a else "100" for a in caches]     # 100: the default
    assert list(zip(stale, sizes)) == [("0", "10%"), ("100", "10%"), ("inf", "10%"), ("100", "1%")]

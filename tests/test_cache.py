"""--mode cache (HET): exact at staleness 0, bounded staleness, bounded size, no lost update, bytes.

The semantics run under a real mpirun on 3 processes (one launch, several configurations:
scripts/mpi_cache.py); argument parsing and the world of one run in process.
"""
import json
import math
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import models
from des.baselines.cache.rewrite import cache, capacity_rows, parse_cache_size, parse_staleness
from des.data.readers import _slice_batch
from des.jobs.verify import PS_SPEC, optimizer_factory, ps_batches
from des.baselines.cache.tables import CacheConfig
from des.baselines.ps.tables import KeyExchange
from des_ops.comm import LocalCommunicator

from helpers import MPI_ENV as ENV, ROOT, mpirun, single_process_predictions, within  # noqa: E402

sys.path.insert(0, os.path.join(ROOT, "scripts"))
from mpi_cache import CONFIGS, LR, batches_of  # noqa: E402

N = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("cache")
    done = mpirun(N, "scripts/mpi_cache.py", str(out), timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
    return {name: [pickle.load(open(out / f"{name}.rank{r}.pkl", "rb")) for r in range(N)] for name in CONFIGS}


@pytest.mark.mpi
@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("exact")])
def test_staleness_0_is_the_single_process_model_after_every_step(runs, name):
    """s = 0: every update is pushed at once and every changed row re-read, so 3 processes on
    slices of the global batch make the single process's updates, also with fused tables whose
    one cache per width holds 4 rows per field (evictions every step) and with a rank whose slice
    is empty."""
    model_name, optimizer, *_, fused, kind = CONFIGS[name]
    for r in runs[name]:      # a fused configuration ran with one cached table per width
        assert all(t.startswith("des_fused") for t in r["tables"]) == fused and r["tables"], list(r["tables"])
        if fused:
            assert sum(s["evicted"] for s in r["steps"]) > 0
    expected = single_process_predictions(model_name, optimizer, LR, *batches_of(kind))
    for r in runs[name]:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(expected, r["predictions"]))
        print(f"cache s=0 {name}: max diff {diff:.1e}")
        assert diff < 1e-6
    hits = sum(s["hits"] for r in runs[name] for s in r["steps"])
    if optimizer == "sgd":   # HET's local SGD update keeps a row valid after the worker's own push
        assert hits > 0


@pytest.mark.mpi
@pytest.mark.parametrize("name", [n for n in CONFIGS if not n.startswith("exact")])
def test_bounded_staleness_size_and_no_lost_update(runs, name):
    _, optimizer, staleness, capacity, _, _, _ = CONFIGS[name]
    ranks = runs[name]
    for r in ranks:
        gaps = [s["max_read_gap"] for s in r["steps"]]
        if not math.isinf(staleness):
            assert max(gaps) <= staleness                          # no read lacked more than s updates
        assert max(s["over_capacity"] for s in r["steps"]) <= 0   # never more lines than the capacity
        assert sum(s["evicted"] for s in r["steps"]) > 0
        for s in r["steps"]:                                     # tensors handed to all-to-all == the count
            sent = s["query_bytes"] + s["clock_bytes"] + s["fetch_bytes"] + s["push_bytes"]
            assert sent == s["analytic_bytes"] > 0
    # staleness really happens (reads served from the cache while the owner moved on)
    assert max(max(s["max_read_gap"] for s in r["steps"]) for r in ranks) > 0
    assert sum(s["hits"] for r in ranks for s in r["steps"]) > 0
    # no update lost: after the flush, what the owners applied is what the workers computed
    for table in ranks[0]["tables"]:
        computed, applied = {}, {}
        for r in ranks:
            for keys, values, into in ((*r["tables"][table]["computed"], computed),
                                       (*r["tables"][table]["applied"], applied)):
                for k, v in zip(keys.tolist(), values[:, :-1]):
                    into[k] = into.get(k, 0) + v
        assert set(computed) == set(applied) and computed
        err = max(float(np.abs(computed[k] - applied[k]).max()) for k in computed)
        assert err < 1e-5, (table, err)
        if optimizer == "sgd":       # and the owner's row moved by exactly -lr * that sum
            for r in ranks:
                keys, rows, init = r["tables"][table]["rows"]
                want = init - r["lr"] * np.stack([applied[k] for k in keys.tolist()])
                assert np.abs(rows - want).max() < 1e-5


def small_libffm(path, rows: int):
    """A learnable libffm file with 4 fields (a few tables: the CLI test traces fast)."""
    rng = np.random.default_rng(0)
    sizes, weight = (200, 50, 300, 20), [rng.normal(0, 1, n) for n in (200, 50, 300, 20)]
    lines = []
    for _ in range(rows):
        ids = [rng.zipf(1.3, 2 if f == 2 else 1) % sizes[f] for f in range(4)]
        logit = sum(weight[f][i].sum() for f, i in enumerate(ids)) - 0.5
        label = int(rng.random() < 1 / (1 + np.exp(-logit)))
        lines.append(f"{label} " + " ".join(f"{f}:{i}:1" for f, i_s in enumerate(ids) for i in i_s))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.mpi
def test_cache_cli_under_mpirun(tmp_path):
    """des.train --mode cache on 2 processes: trains, evaluates (summed over slices), writes the
    cache figures; a checkpoint it saves is read by a single process with the same AUC."""
    data = small_libffm(tmp_path / "train.ffm", rows=3000)
    train = ["-m", "des.train", "--model", "fm", "--data", str(data), "--format", "libffm", "--batch", "256",
             "--optimizer", "sgd", "--epochs", "2"]
    done = mpirun(2, *train, "--mode", "cache", "--staleness", "5", "--cache-size", "40",
                  "--checkpoint", str(tmp_path / "ck"), "--summary-json", str(tmp_path / "c.json"), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cache bytes/step sent per process" in done.stdout
    s = [json.load(open(tmp_path / f"c.json.rank{r}")) for r in range(2)]
    assert s[0]["auc"] == s[1]["auc"] and s[0]["auc"] > 0.6
    assert s[0]["bytes_exact_steps"].split("/")[0] == s[0]["bytes_exact_steps"].split("/")[1]
    assert 0 < s[0]["hit_rate"] < 1 and s[0]["rows_fetched_per_step"] > 0
    pred = subprocess.run([sys.executable, "-m", "des.train", *train[2:], "--restore", str(tmp_path / "ck"),
                           "--summary-json", str(tmp_path / "r.json")], env=ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert pred.returncode == 0, pred.stderr[-3000:]
    again = json.load(open(tmp_path / "r.json"))
    # the same rows: the same AUC (measured 0, twice)
    within("restored by one process: |AUC - cache run's|", abs(again["auc"] - s[0]["auc"]), 1e-7)


def test_a_world_of_one_caches_nothing_and_is_the_model():
    """One process owns every key: nothing is cached or sent, and training is the plain model's."""
    batches, probe = ps_batches()
    model = cache(models.build("deepfm", PS_SPEC, seed=3, hidden=(8, 4)), KeyExchange(LocalCommunicator()), staleness=10,
                  capacity=5)
    model.compile(optimizer_factory("adam", LR)(), "binary_crossentropy")
    ref = models.build("deepfm", PS_SPEC, seed=3, hidden=(8, 4))
    ref.compile(optimizer_factory("adam", LR)(), "binary_crossentropy")
    for x, y in batches[:4]:
        model.train_on_batch(*_slice_batch(x, y, 0, 1))
        ref.train_on_batch(x, y)
    assert np.abs(model.predict_on_batch(probe) - ref.predict_on_batch(probe)).max() < 1e-6
    c = model.cache_counters()
    assert c["queried"] == 0 and c["query_bytes"] + c["push_bytes"] == 0


def test_options_are_checked():
    assert parse_staleness("inf") == math.inf and parse_staleness("10") == 10
    assert parse_cache_size("10%") == pytest.approx(0.1) and parse_cache_size("5000") == 5000
    assert parse_cache_size("100%") == 1.0 and isinstance(parse_cache_size("100%"), float)   # every row
    assert isinstance(parse_cache_size("1"), int) and parse_cache_size("0.5") == 0.5
    assert capacity_rows(parse_cache_size("100%"), 1001, "C1") == 1001
    for bad in ("-1", "2.5", "x"):
        with pytest.raises(ValueError):
            parse_staleness(bad)
    for bad in ("0", "150%", "2.5", "0%", "x"):
        with pytest.raises(ValueError):
            parse_cache_size(bad)
    assert capacity_rows(0.1, 1001, "C1") == 101 and capacity_rows(300, None, "C1") == 300
    assert capacity_rows(1, 1001, "C1") == 1
    with pytest.raises(ValueError, match="C1.*cardinality"):
        capacity_rows(0.1, None, "C1")
    with pytest.raises(ValueError):
        CacheConfig(eviction="fifo")
    assert CacheConfig(staleness=0).push_after == 1 and CacheConfig(staleness=math.inf).push_after == math.inf


def test_compare_report_has_cache_rows_and_the_auc_vs_bytes_plot(tmp_path):
    """des.compare's table and plots with cache runs: savings against the PS, hit rates, rows moved."""
    from des.jobs.compare import markdown, plots, table_rows
    base = {"world_size": 4, "logloss": 0.5, "samples_per_second": 1000.0, "peak_rss_mib": 900.0,
            "train_auc_by_step": [(1, 0.5), (2, 0.6)]}
    run = lambda auc, sent, **kw: dict(base, auc=auc, sent_bytes_per_step=sent, **kw)
    cache_fields = lambda h: dict(hit_rate=h, rows_fetched_per_step=10.0, rows_pushed_per_step=5.0,
                                  het_rows_per_lookup=0.3)
    results = {"deepfm": {"single": dict(run(0.75, None), world_size=1), "des": run(0.75, 1000.0),
                          "ps": run(0.75, 4000.0), "cache s=0": run(0.75, 3000.0, **cache_fields(0.2)),
                          "cache s=inf": run(0.74, 500.0, **cache_fields(0.9))}}
    rows = table_rows(results)
    by = {r["mode"]: r for r in rows}
    assert by["des"]["des_saving_pct"] == pytest.approx(75.0)
    assert by["cache s=inf"]["des_saving_pct"] == pytest.approx(87.5) and by["ps"]["des_saving_pct"] is None
    from des.jobs.compare import parser
    a = parser().parse_args(["--np", "4", "--batch", "1024", "--steps", "10"])
    md = markdown(rows, results, a, {"bayes_auc": 0.78})
    assert "| deepfm | cache s=inf | 4 | 0.7400 |" in md and "| 0.900 | 15 |" in md
    assert "(a2a measured + ring model)" in md and "analytic (formulas)" in md   # what is a formula is labelled
    files = plots(results, {"deepfm": {"des": [1.0, 2.0], "ps": [3.0, 4.0]}}, [512, 1024], a, str(tmp_path))
    assert os.path.basename(files[-1]) == "auc_vs_bytes.png" and os.path.getsize(files[-1]) > 10_000

"""Multi-process behaviour under a real mpirun with Horovod."""
import glob
import json
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import models
from des.jobs.verify import PS_SPEC, compare, optimizer_factory, random_batches, train_and_snapshot
from helpers import MPI_ENV as ENV, ROOT, mpirun, single_process_predictions, within, write_small_ffm

LR = {"sgd": 0.2, "adagrad": 0.05, "adam": 0.01, "ftrl": 0.05}


EQUIVALENCE = [("deepfm", "adam", 2, "horovod", "per-field"), ("wdl", "ftrl", 3, "horovod", "per-field"),
               ("fm", "adagrad", 4, "horovod", "fused"),
               ("deepfm", "adam", 5, "mpi4py", "joined"), ("wdl", "ftrl+adam", 2, "horovod", "fused"),
               ("deepfm", "adam", 5, "horovod", "joined")]
PS = [("deepfm", "adam", 2, "per-field"), ("wdl", "sgd", 3, "joined"), ("deepfm", "ftrl+adam", 2, "fused")]
USERS = ["deepctr_deepfm_defaults", "two_tower", "shared_table_deepfm", "deepctr_deepfm", "tfra_deepfm"]
SUBCLASSED = ["tfrs_ranking", "subclassed_wdl", "tfrs_retrieval"]
FIELD_ROWS = ["deepctr_dcn", "deepctr_din", "dlrm_offsets"]     # tables no rule splits: by field rows
# the architectures that kept every table whole on every process before field rows (issue 60), at N = 2:
# DeepCTR's DCN, xDeepFM, AutoInt, PNN, DIN, MMoE (default gates: read through), a DLRM port; and
# DeepCTR's DeepFM with its defaults (table penalties) under legacy Adagrad
HELD_OUT = ["deepctr_dcn", "deepctr_xdeepfm", "deepctr_autoint", "deepctr_pnn", "deepctr_din", "deepctr_mmoe",
            "dlrm_offsets", "deepctr_deepfm_defaults@legacy_adagrad"]
# Checks that share a process count share a launch (scripts/mpi_battery.py): a TensorFlow start and
# Horovod's initialisation per rank cost more than most checks. N = 3's first REPEATED jobs run again
# in a second launch, which must give the same bits; N = 5 is more processes than fields.
REPEATED = ["gallery:deepctr_deepfm_defaults", "gallery:two_tower", "gallery:shared_table_deepfm", "tail:keras_deepfm",
            "rows:keras_deepfm", "gallery:deepctr_dcn"]
BATTERY = {2: [f"gallery:{m}" for m in HELD_OUT] + ["samples:deepctr_dcn", "samples:dlrm_offsets"], 3: REPEATED + [f"gallery:{m}" for m in USERS + FIELD_ROWS if f"gallery:{m}" not in REPEATED]
           + [f"subclassed:{m}" for m in SUBCLASSED] + ["gallery:tfra_one_table", "samples:tfra_one_table:joined", "big:big_field_deepfm", "bigtail:big_field_deepfm", "big:big_bag_deepfm", "bigtail:big_bag_deepfm"], 4: [],
           5: ["gallery:two_tower", "gallery:shared_table_deepfm", "tail:deepctr_deepfm", "rows:deepctr_deepfm",
               "gallery:deepctr_dcn", "samples:deepctr_dcn", "samples:dlrm_offsets", "psuser:tfra_deepfm", "layerrows:deepctr_deepfm",
               "layerrows:tfra_deepfm:joined"]}
for _m, _o, _n, _c, _t in EQUIVALENCE:
    if _c == "horovod":
        BATTERY[_n].append(f"equivalence:{_m}:{_o}:horovod:{_t}")
for _m, _o, _n, _t in PS:
    BATTERY[_n].append(f"ps:{_m}:{_o}:{_t}")


# the mpi4py communicator's jobs at N = 5 (more processes than fields), in two launches of their own
# (it drives MPI itself, without Horovod) that must give the same bits
MPI4PY = [("tail", "deepctr_deepfm"), ("rows", "deepctr_deepfm"), ("samples", "deepctr_dcn"),
          ("samples", "dlrm_offsets"), ("layerrows", "deepctr_deepfm")]
MPI4PY += [("equivalence", f"{m}:{o}:mpi4py:{t}") for m, o, _n, c, t in EQUIVALENCE if c == "mpi4py"]
assert {n for *_, n, c, _t in EQUIVALENCE if c == "mpi4py"} <= {5}, "the mpi4py battery runs at N = 5"


@pytest.fixture(scope="module")
def battery(tmp_path_factory):
    """battery(n) -> OUT_DIR of ONE mpirun of scripts/mpi_battery.py with BATTERY[n] (the first call
    launches it); battery(3, again=True): a second launch of N = 3's REPEATED jobs;
    battery(5, mpi4py=True), and again=True: the two launches of MPI4PY's jobs by --mpi4py."""
    done = {}

    def launch(n: int, again: bool = False, mpi4py: bool = False):
        if (n, again, mpi4py) not in done:
            out = tmp_path_factory.mktemp(f"battery{n}{'mpi4py' if mpi4py else ''}{'again' if again else ''}")
            jobs = [f"{k}:{m}" for k, m in MPI4PY] if mpi4py else REPEATED if again else BATTERY[n]
            done[n, again, mpi4py] = mpirun(n, "scripts/mpi_battery.py", *(["--mpi4py"] if mpi4py else []), str(out),
                                            *jobs, timeout=900 if mpi4py else 1800), out
        run, out = done[n, again, mpi4py]
        assert run.returncode == 0, run.stderr[-3000:]
        return out
    return launch


def _ranks(where, name: str, n: int) -> list[dict]:
    """The n ranks' pickled snapshots ``where/<name>.rank<r>.pkl`` (``where/rank<r>.pkl`` when the
    folder is the job's own: name "")."""
    prefix = f"{name}." if name else ""
    return [pickle.load(open(where / f"{prefix}rank{r}.pkl", "rb")) for r in range(n)]


def _same_bits(a: dict, b: dict, job: str) -> None:
    """Two launches' snapshots of one rank: the same predictions, rows and weights, bit for bit."""
    parts = [p for p in ("predictions", "tables", "owned", "weights") if p in a]
    assert "predictions" in parts and "weights" in parts, parts
    for u, v in zip(tf.nest.flatten({p: a[p] for p in parts}), tf.nest.flatten({p: b[p] for p in parts})):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=job)


@pytest.mark.mpi
@pytest.mark.parametrize("name, optimizer, n, comm, tables", EQUIVALENCE)
def test_des_under_mpirun_equals_single_process(battery, name, optimizer, n, comm, tables):
    """DES on N processes (per-field, fused or joined tables; N = 5 > 4 fields: a process owns nothing)
    equals the untouched per-field model on one process; the mpi4py communicator's job, launched
    twice, gives the same bits."""
    config = f"{name}:{optimizer}:{comm}:{tables}"
    out = battery(n, mpi4py=comm == "mpi4py") / "equivalence"
    if comm == "mpi4py":     # mpi4py drives MPI itself (no Horovod), its waits sleeping: two launches of its own
        for a, b in zip(_ranks(battery(n, again=True, mpi4py=True) / "equivalence", config.replace(":", "-"), n),
                        _ranks(out, config.replace(":", "-"), n)):     # the same job, the same bits
            _same_bits(a, b, config)
    ranks = _ranks(out, config.replace(":", "-"), n)       # as scripts/mpi_equivalence.py names it
    # a sample's partials by hand (PS_SPEC: 4 fields of dim 3; hidden 8,4): the linear sum (1), the
    # FM's S and Q (3 + 1), the first Dense's 8 units
    floats = {"lr": 1, "fm": 1 + (3 + 1), "wdl": 1 + 8, "deepfm": 1 + (3 + 1) + 8}[name]
    widths = {"fused": 1 + (name not in ("lr", "dnn")), "joined": 1}.get(tables, 0)   # fused tables of an owner
    assert [r["fused_tables"] for r in ranks] == [widths * r["owns_fields"] for r in ranks]
    assert (n == 5) == (not all(r["owns_fields"] for r in ranks))       # N = 5: one process owns no field
    spec = PS_SPEC                 # one-hot, multi-valued and weighted fields, as scripts/mpi_equivalence.py
    ref = train_and_snapshot(models.build(name, spec, seed=3, hidden=(8, 4)), optimizer_factory(optimizer, LR), None,
                             random_batches(spec, 20, 32, seed=4), random_batches(spec, 1, 16, seed=99)[0][0])
    diff = compare(ref, ranks)
    print(f"mpirun -np {n} {name} {optimizer} ({comm}): {diff}")
    within("predictions", diff["predictions"], 1e-6)       # measured <= 1.8e-7 (reports/tolerances.md)
    # rows and weights: 1e-6, with Adam 1e-5 (its step m/(sqrt(v)+eps) amplifies float32 summation order on
    # a near-zero gradient: the README's contract per optimizer). Measured: <= 1.8e-7 on one machine, 1.06e-6
    # (a table row of deepfm, Adam, N = 2) on an AMD EPYC one, the same at 00f206a (before the row policy)
    within("rows and weights", max(diff["tables"], diff["owned"], diff["weights"]), 1e-5 if "adam" in optimizer else 1e-6)
    for r in ranks:
        assert np.array_equal(r["predictions"], ranks[0]["predictions"])   # replicas agree bitwise
        assert np.allclose(r["grad_des"], 1.0)                              # identity gradient
        if comm == "horovod":
            assert np.allclose(r["grad_raw_horovod"], n)                    # raw Horovod: N x
        # 20 train steps of 32 rows + 20 predictions of 16 rows + the gradient probe (2 floats)
        assert r["floats_per_sample"] == floats
        assert r["payload_bytes"] == 4 * floats * (20 * 32 + 20 * 16) + 8
        assert r["allreduce_calls"] == 20 + 20 + 1          # ONE allreduce per train and per predict step


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    """12,000 generated lines in libffm with 6 fields (tests/helpers.py write_small_ffm): the
    CLI tests below check modes, restore and bytes, none of it tied to Criteo's 39 fields, and
    every launch traces 12 tables instead of 78. Criteo files under mpirun: tests/test_predict.py."""
    p = str(tmp_path_factory.mktemp("d") / "train.ffm")
    write_small_ffm(p, 12_000, seed=2)
    return p


TRAIN = ["-m", "des.train", "--model", "wdl", "--batch", "512", "--hidden", "16",
         "--dim", "4", "--threads", "1", "--holdout", "2000", "--shuffle-buffer", "5000", "--lr", "0.02"]


@pytest.fixture(scope="module")
def single_run(data_file, tmp_path_factory):
    """The single-process run of TRAIN that the DES and PS CLI tests both compare with."""
    out = str(tmp_path_factory.mktemp("single") / "single.json")
    single = subprocess.run([sys.executable, *TRAIN, "--data", data_file, "--summary-json", out],
                            env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    return json.load(open(out))


@pytest.mark.mpi
def test_training_cli_des_under_mpirun(data_file, single_run, tmp_path):
    run = mpirun(2, *TRAIN, "--mode", "des", "--data", data_file, "--replica-check", "5",
                 "--checkpoint", str(tmp_path / "ck"), "--summary-json", str(tmp_path / "des.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("training wdl") == 1                 # logs from rank 0 only
    assert "collectives by mpi4py: each wait sleeping" in run.stdout   # the default under mpirun, replicated tail
    ranks = [json.load(open(p)) for p in sorted(glob.glob(str(tmp_path / "des.json*")))]
    assert len(ranks) == 2 and ranks[0]["auc"] == ranks[1]["auc"]   # same predictions everywhere
    s = single_run
    within("|AUC - single's|", abs(ranks[0]["auc"] - s["auc"]), 1e-7)      # measured 0: no pair of predictions flips
    assert ranks[0]["auc"] > 0.55
    assert ranks[0]["bytes_per_step_measured"] == ranks[0]["bytes_per_step_analytic"] == 4 * 512 * 17
    check = ranks[0]["collectives"]["check"]            # the replica check's allreduce is counted too
    assert check["calls"] == 4 and check["bytes"] > 0 and check["bytes"] % (4 * 2 * 8) == 0   # 4 x N x float64
    assert ranks[0]["check_bytes_per_step"] == check["bytes"] / 20
    assert sorted(os.listdir(tmp_path / "ck" / "state")) == ["config.json", "rank0-of-2.npz", "rank1-of-2.npz"]
    saved = json.load(open(tmp_path / "ck" / "state" / "config.json"))
    assert saved["plan"]["world_size"] == 2 and saved["position"] == {"epoch": 1, "step": 0, "seed": 0,
                                                                      "global_batch": 512}


@pytest.mark.mpi
def test_des_reading_text_with_a_process_that_owns_no_field_equals_one_process(tmp_path):
    """des.train --mode des on 3 processes over a 2-field libffm file: rank 2 owns no field, so its
    text reader turns only the first field's values into ids (for the replica check); the job ends
    on its own and evaluates what the single process does. Resumed from its checkpoint on the
    epoch's last step, it goes on past the empty rest of the epoch alike on every process."""
    data = str(tmp_path / "two.ffm")
    write_small_ffm(data, 3000, seed=3, fields=2)
    args = [*TRAIN, "--data", data, "--holdout", "500", "--steps", "6"]
    single = subprocess.run([sys.executable, *args, "--summary-json", str(tmp_path / "one.json")],
                            env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    run = mpirun(3, *args, "--mode", "des", "--replica-check", "2", "--summary-json", str(tmp_path / "des.json"),
                 "--checkpoint", str(tmp_path / "ck"), "--checkpoint-every", "5")
    assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"rank 2: load 0\.000 +\[no fields", run.stdout), run.stdout[-2000:]
    # 2,500 lines are 5 batches: the save due after the 5th ran before a 6th the data lacked. Resumed
    # from it, the epoch has no batch left on any process (one small sum, rank 2's answer in it)
    assert json.load(open(tmp_path / "ck" / "state.old" / "config.json"))["position"]["step"] == 5
    os.makedirs(tmp_path / "end")
    os.rename(tmp_path / "ck" / "state.old", tmp_path / "end" / "state")
    end = mpirun(3, *args, "--mode", "des", "--restore", str(tmp_path / "end"),
                 "--summary-json", str(tmp_path / "end.json"))
    assert end.returncode == 0, end.stderr[-3000:]
    assert "epoch 1 has no batch after step 5 (the checkpoint was at its end)" in end.stdout, end.stdout[-2000:]
    one = json.load(open(tmp_path / "one.json"))
    for r in range(3):
        for name in ("des", "end"):
            got = json.load(open(tmp_path / f"{name}.json.rank{r}"))
            within("|AUC - single's|", abs(got["auc"] - one["auc"]), 1e-7)             # measured 0
            within("|log loss - single's|", abs(got["logloss"] - one["logloss"]), 5e-7)   # measured 6.0e-8


def _predictions(where, data, runs) -> tuple[list[np.ndarray], str]:
    """des.predict of each (checkpoint folder under ``where``, processes) in ``runs`` on ``data``:
    the predictions of each, and what the last run printed."""
    preds = []
    for ck, n in runs:
        r = mpirun(n, "-m", "des.predict", "--checkpoint", str(where / ck), "--data", str(data),
                   "--out", str(where / f"{ck}.txt"), "--threads", "1")
        assert r.returncode == 0, r.stderr[-3000:]
        preds.append(np.loadtxt(where / f"{ck}.txt"))
    return preds, r.stdout


@pytest.mark.mpi
def test_a_killed_des_job_resumes_as_ps_on_3_processes_like_one_uninterrupted_process(data_file, tmp_path):
    """2 epochs of 4 steps in one process, against: DES on 2 processes saving every 3 steps, its
    last rank killed at step 4 (mpirun ends the job with that rank's code 17 and names it); then --mode ps on 3 processes restores that checkpoint (rows
    re-sharded by key, slots with them) and finishes: the same held-out AUC and log loss; its
    checkpoint, read by DES on 2 processes, predicts what the single process's does."""
    steps = ["--epochs", "2", "--steps", "4", "--optimizer", "adagrad", "--linear-optimizer", "ftrl"]
    single = subprocess.run([sys.executable, *TRAIN, *steps, "--data", data_file, "--checkpoint", str(tmp_path / "s"),
                             "--summary-json", str(tmp_path / "s.json")],
                            env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    killed = mpirun(2, *TRAIN, *steps, "--mode", "des", "--data", data_file, "--checkpoint", str(tmp_path / "d"),
                    "--checkpoint-every", "3", "--fail-at-step", "4", timeout=300)
    # the dying rank ends the whole job (no hang) with its exit code, and mpirun names it
    out = killed.stdout + killed.stderr
    assert killed.returncode == 17, out[-3000:]
    assert "--fail-at-step 4: this rank exits with code 17" in out, out[-3000:]
    assert re.search(r"Process name: \[\[\d+,\d+\],1\]\s+Exit code:\s+17", out), out[-3000:]
    assert json.load(open(tmp_path / "d" / "state" / "config.json"))["position"]["step"] == 3
    ps = mpirun(3, *TRAIN, *steps, "--mode", "ps", "--data", data_file, "--restore", str(tmp_path / "d"),
                "--checkpoint", str(tmp_path / "p"), "--summary-json", str(tmp_path / "p.json"))
    assert ps.returncode == 0, ps.stderr[-3000:]
    assert "continuing at epoch 1, step 3" in ps.stdout
    s, p = json.load(open(tmp_path / "s.json")), json.load(open(tmp_path / "p.json.rank0"))
    print(f"AUC single {s['auc']:.7f} / DES 2 killed, PS 3 resumed {p['auc']:.7f}; "
          f"log loss {s['logloss']:.7f} / {p['logloss']:.7f}")
    within("|AUC - single's|", abs(s["auc"] - p["auc"]), 1e-5)              # measured 5.2e-6
    within("|log loss - single's|", abs(s["logloss"] - p["logloss"]), 1e-7)  # measured 0
    # PS 3 -> DES 2: the PS checkpoint read by DES on 2 processes predicts what one process's does
    test = tmp_path / "test.txt"
    test.write_text("".join(open(data_file).readlines()[:500]))
    preds, said = _predictions(tmp_path, test, (("s", 1), ("p", 2)))
    assert "ps checkpoint of 3 process(es), read by 2" in said
    print(f"PS 3 checkpoint read by DES 2 vs single: max diff {np.abs(preds[0] - preds[1]).max():.1e}")
    assert preds[0].shape == (500,)
    within("PS 3 checkpoint read by DES 2: predictions", np.abs(preds[0] - preds[1]).max(), 5e-7)   # measured 6.0e-8


@pytest.mark.mpi
@pytest.mark.parametrize("name, optimizer, n, tables", PS)
def test_ps_under_mpirun_equals_single_process_and_counts_bytes_exactly(battery, name, optimizer, n, tables):
    """Sharded tables (one per field, fused: one per width, or joined: one) + all-to-all + dense allreduce on
    slices of the global batch make the same updates as one process on the whole batch: every
    gradient reaches its row although keys repeat across processes, and a process with an empty
    slice (no ids) takes part."""
    from des.jobs.verify import ps_batches
    out = battery(n) / "ps" / f"{name}-{optimizer}-{tables}"
    ranks = _ranks(out, "", n)
    assert all(r["fused_tables"] == {"fused": 2, "joined": 1}.get(tables, 0) for r in ranks)
    expected, ref = single_process_predictions(name, optimizer, LR, *ps_batches(), with_snapshot=True)
    if n == 3:
        assert [r["rows"][-2] for r in ranks] == [0, 1, 1]           # rank 0 had no ids in that step
    for r in ranks:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(expected, r["predictions"]))
        within("predictions after every step", diff, 5e-7)            # measured <= 6.0e-8
        for step, (m, a) in enumerate(zip(r["measured"], r["analytic"])):
            for k in ("ids_bytes", "rows_bytes", "grad_bytes", "unique_ids", "remote_ids", "dense_bytes"):
                assert m[k] == a[k], (step, k, m[k], a[k])
            assert m["control_bytes"] == 4
            # per destination, measured at the all-to-all; the self-send kept apart
            own = r["rank"]
            assert m["sent"]["ids"][own] == 8 * (m["unique_ids"] - m["remote_ids"])
            assert sum(m["sent"]["ids"]) - m["sent"]["ids"][own] == m["ids_bytes"]
            assert sum(m["received"]["rows"]) - m["received"]["rows"][own] == m["rows_bytes"]
            assert sum(m["sent"]["grads"]) - m["sent"]["grads"][own] == m["grad_bytes"]
        assert sum(m["remote_ids"] for m in r["measured"]) > 0
    # what r handed to all-to-all for d is what d received from r, in every step and kind
    for step in range(len(ranks[0]["measured"])):
        for kind in ("ids", "rows", "grads"):
            for r in range(n):
                for d in range(n):
                    assert ranks[r]["measured"][step]["sent"][kind][d] == \
                        ranks[d]["measured"][step]["received"][kind][r], (step, kind, r, d)
    # rows and weights, not only predictions: the shards are disjoint, held by key mod N, and
    # together equal the single process's tables row by row; every rank holds its weights
    merged = {"predictions": np.stack(ranks[0]["predictions"]), "owned": ranks[0]["snapshot"]["owned"],
              "weights": ranks[0]["snapshot"]["weights"], "tables": {}}
    for r in ranks:
        for key, rows in r["snapshot"]["tables"].items():
            assert all(k % n == r["rank"] for k in rows), (key, r["rank"])
            assert not set(rows) & set(merged["tables"].get(key, {}))
            merged["tables"].setdefault(key, {}).update(rows)
    diffs = [compare(dict(ref, predictions=np.stack(expected)),
                     [dict(merged, predictions=np.stack(r["predictions"]), weights=r["snapshot"]["weights"])])
             for r in ranks]
    print(f"PS rows/weights vs single process: {diffs[0]}")
    within("rows and weights", max(max(d.values()) for d in diffs), 5e-7)     # measured <= 8.0e-8


@pytest.mark.mpi
def test_the_first_layer_by_rows_under_mpirun(battery):
    """des.Options(first_layer="rows") under Horovod: DeepCTR's DeepFM (table and tail penalties) on 5
    processes (4 fields: one owns none; the last batch of 2 rows leaves 3 with no sample), every
    table by samples, no operator split: the same predictions as one process, and the tail's
    weights (the first Dense's kernel among them) the same bits on every process. A TFRA DeepFM with
    joined tables (each owned field's embedding and linear weight in one row of one table per
    process): every owner sends its table's lookup as it is (DESFirstLayer._fused_rows_sent), and
    it equals one process too."""
    for name in ("deepctr_deepfm", "tfra_deepfm"):
        ranks = _ranks(battery(5) / "layerrows", name, 5)
        assert not all(r["owns_fields"] for r in ranks)
        assert "first layer by rows: no operator is split" in ranks[0]["report"]
        if name == "tfra_deepfm":
            assert [r["sends_fused_rows"] for r in ranks] == [r["owns_fields"] for r in ranks]
        ref = _tail_reference(name, ranks[0]["initial"])
        for r in ranks:
            within(f"{name} first layer by rows N=5: predictions",
                   float(np.abs(np.asarray(r["predictions"]) - np.asarray(ref["predictions"])).max()), 1e-6)
            for k, w in r["weights"].items():
                np.testing.assert_array_equal(np.asarray(w), np.asarray(ranks[0]["weights"][k]))


@pytest.mark.mpi
def test_ps_on_a_users_tfra_model_under_mpirun_equals_one_process(battery):
    """The parameter-server baseline on a user's own model (scripts/mpi_ps_user.py: tests/gallery.py's
    TFRA DeepFM, every table sharded by key) on 5 processes, each training its slice (the last batch
    of 2 rows leaves 3 processes none): the same predictions as the untouched model trained on the
    whole batches on one process, and every key's row on process key mod 5 only, all of them. The same
    model through ``des.transform(model, des.Options(mode="ps"))``, handed the whole batches: the
    single process's loss and AUC at every step and its predictions; DeepCTR's DeepFM the same, and
    its save (the user's model) and checkpoint (resumed on one process) give the reference's."""
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]
    from tensorflow_recommenders_addons import dynamic_embedding as de
    from mpi_ps_user import build, user_batches
    n = 5
    ranks = _ranks(battery(n) / "psuser", "ps_user", n)
    assert sorted(r["slice_rows"][-1] for r in ranks) == [0, 0, 0, 1, 1]
    reference = build()
    batches, probe = user_batches(reference)
    reference.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(0.02)), "binary_crossentropy")
    for x, y in batches:
        reference.train_on_batch(x, y)
    expected = reference.predict_on_batch(probe)
    for r in ranks:
        within("PS on a user's model: predictions", float(np.abs(r["predictions"] - expected).max()), 1e-6,
               case=f"rank {r['rank']}")
    tables = {l.name: l for l in reference.layers if hasattr(l, "params")}
    assert len(ranks[0]["keys"]) == len(tables) == 8
    for key in ranks[0]["keys"]:
        held = [set(r["keys"][key]) for r in ranks]
        assert all(k % n == r for r, keys in enumerate(held) for k in keys)
        assert sum(len(h) for h in held) == len(set().union(*held))          # no key on two processes
    assert sum(len(set().union(*[set(r["keys"][k]) for r in ranks])) for k in ranks[0]["keys"]) == \
        sum(int(l.params.size()) for l in tables.values())
    # the same model through des.transform(mode="ps"), handed the whole batches: the single process's
    # loss and AUC at every step, and its predictions
    from mpi_ps_user import compiled
    reference = compiled(build())
    logs = [reference.train_on_batch(x, y, return_dict=True) for x, y in batches]
    expected_logs, expected = np.array([(d["loss"], d["auc"]) for d in logs]), reference.predict_on_batch(probe)
    for r in ranks:
        t = r["transform"]
        assert "a parameter server, rank" in t["report"], t["report"]
        within("des.transform(mode='ps'): predictions", float(np.abs(t["predictions"] - expected).max()), 1e-6,
               case=f"rank {r['rank']}")
        within("des.transform(mode='ps'): loss and AUC per step", float(np.abs(np.array(t["logs"]) - expected_logs).max()),
               1e-6, case=f"rank {r['rank']}")
    # DeepCTR's DeepFM (Keras Embedding tables sharded by key, their L2 penalty once) with SGD: the same
    from mpi_ps_user import deepctr_user
    reference, batches, probe = deepctr_user()
    logs = [reference.train_on_batch(x, y, return_dict=True) for x, y in batches]
    expected_logs, expected = np.array([(d["loss"], d["auc"]) for d in logs]), reference.predict_on_batch(probe)
    for r in ranks:
        k = r["keras"]
        within("mode ps, Keras Embedding tables: predictions", float(np.abs(k["predictions"] - expected).max()),
               1e-6, case=f"rank {r['rank']}")
        within("mode ps, Keras Embedding tables: loss and AUC per step",
               float(np.abs(np.array(k["logs"]) - expected_logs).max()), 1e-6, case=f"rank {r['rank']}")
        assert k["logs"] == ranks[0]["keras"]["logs"], f"rank {r['rank']} logs other bits than rank 0"
    # saved on the 5 processes: the user's model with every process's rows; the checkpoint of the
    # second batch resumes on one process (mode ps, a world of one) and trains on like the reference
    import des
    from deepctr.layers import custom_objects
    out = battery(n) / "psuser"
    saved = tf.keras.models.load_model(str(out / "ps_keras_saved"), custom_objects=custom_objects, compile=False)
    within("mode ps under mpirun: model.save, loaded", float(np.abs(saved.predict_on_batch(probe) - expected).max()),
           1e-6)
    user, _, _ = deepctr_user()
    resumed, _ = des.transform(user, des.Options(mode="ps"), sample=batches[0][0])
    des.checkpoint.restore(str(out / "ps_keras_ckpt"), resumed, resumed.optimizer)
    for x, y in batches[2:]:
        resumed.train_on_batch(x, y)
    within("mode ps: a checkpoint of 5 processes resumed on 1", float(np.abs(resumed.predict_on_batch(probe) -
                                                                               expected).max()), 1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("n, mode", [(3, ["--mode", "ps"]), (2, ["--mode", "cache", "--staleness", "0", "--cache-size", "50",
                                                              "--on-demand", "--plan-pushes", "--optimizer", "sgd"])])
def test_laia_allocation_under_mpirun_equals_single_process(data_file, single_run, tmp_path, n, mode):
    """--allocate laia: every process computes the same allocation (digest) and the job trains the
    single process's model (loss and AUC over the held-out lines), fetching fewer remote ids than
    contiguous slices would (the PS run's counters; the bytes stay exact); the cache run (SGD)
    with Herald's whole plan: on-demand reads (no queries, no clocks), plan pushes, evictions
    decided by the simulation. The PS run with contiguous slices (the default) trains like one
    process too, its bytes exact."""
    run = mpirun(n, *TRAIN, *mode, "--allocate", "laia", "--data", data_file,
                 "--summary-json", str(tmp_path / "s.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.load(open(tmp_path / f"s.json.rank{r}")) for r in range(n)]
    assert len({r["allocation"]["digest"] for r in ranks}) == 1 and ranks[0]["allocation"]["batches"] == 20
    single = single_run
    if "--optimizer" in mode:
        out = str(tmp_path / "single-sgd.json")
        done = subprocess.run([sys.executable, *TRAIN, "--optimizer", "sgd", "--data", data_file, "--summary-json", out],
                              env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        single = json.load(open(out))
    for r in ranks:
        within("|log loss - single's|", abs(r["logloss"] - single["logloss"]), 1e-7)     # measured 0
        within("|AUC - single's|", abs(r["auc"] - single["auc"]), 1e-7)                 # measured 0
        assert r["bytes_exact_steps"] == "20/20"
        if mode[1] == "cache":      # laia's simulation decided every eviction (one set of lines)
            assert r["clock_bytes_per_step"] == 0 and r["remote_lookups_per_step"] > 0
            assert r["evicted"] > 0 and r["evicted_unplanned"] == 0, r
    if mode[1] == "ps":     # the PS CLI with contiguous slices (its default): as one process, bytes exact
        slices = mpirun(n, *TRAIN, *mode, "--data", data_file, "--summary-json", str(tmp_path / "c.json"))
        assert slices.returncode == 0, slices.stderr[-3000:]
        plain = [json.load(open(tmp_path / f"c.json.rank{r}")) for r in range(n)]
        assert len({r["auc"] for r in plain}) == 1
        within("contiguous slices: |AUC - single's|", abs(plain[0]["auc"] - single_run["auc"]), 1e-7)   # measured 0
        for r in plain:
            assert r["bytes_exact_steps"] == "20/20"       # per step; the means below differ in the last bit
            assert abs(r["sent_bytes_per_step"] - r["analytic_sent_bytes_per_step"]) <= 1e-12 * r["sent_bytes_per_step"]
            assert r["remote_ids_per_step"] > 0 and r["dense_ring_bytes_per_step"] > 0
        contiguous = sum(r["remote_ids_per_step"] for r in plain)
        laia = sum(r["remote_ids_per_step"] for r in ranks)
        print(f"remote ids per step, all processes: contiguous {contiguous}, laia {laia}")
        assert laia < 0.9 * contiguous


def _gallery_reference(job: str, initial) -> dict:
    """The untouched model on one process, from rank 0's initial weights, fitted like the ranks
    (``job``: a model of tests/gallery.py, or MODEL@OPTIMIZER, as scripts/mpi_gallery.py)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import des
    from des.jobs.verify import fit_and_snapshot
    from gallery import BUILDERS, MULTI_TASK, batches_for, optimizer_for
    name, _, optimizer = job.partition("@")
    reference = {**BUILDERS, **MULTI_TASK}[name]()
    reference.set_weights(initial)
    des.make_keyed(reference, seed=0)
    batches = batches_for(reference, 20, 32, seed=4)
    return fit_and_snapshot(reference, batches, batches_for(reference, 1, 16, seed=99)[0][0],
                            optimizer_for(reference, optimizer) if optimizer else "adam")


def _check_against_reference(name: str, ranks: list[dict], predictions: tuple[str, float] = ("predictions", 5e-7)) -> dict:
    """Predictions within 5e-7 of one process (or ``predictions``: the bound's name and value);
    table rows, kernel rows, weights, AUC and loss within 1e-5 (20 steps of Adam amplify float32
    summation order in the rows: up to 4.6e-6, DeepCTR's DeepFM with its defaults;
    tests/test_gallery.py sweeps its build seeds)."""
    ref = _gallery_reference(name, ranks[0]["initial"])
    diff = compare(ref, ranks)
    diff["auc"] = max(abs(r["auc"] - ref["auc"]) for r in ranks)
    diff["loss"] = max(abs(r["loss"] - ref["loss"]) for r in ranks)
    print(f"mpirun -np {len(ranks)} {name}: {diff}")
    within(predictions[0], diff["predictions"], predictions[1], case=f"{name} N={len(ranks)}")  # 5e-7: measured <= 6.0e-8
    within("rows, weights, AUC, loss", max(diff.values()), 1e-5, case=f"{name} N={len(ranks)}")
    for r in ranks:
        assert np.array_equal(r["predictions"], ranks[0]["predictions"])     # replicas agree bitwise
        assert r["allreduce_calls"] == 20 + 1                                # one per fit step, one predict
        assert r["payload_bytes"] == 4 * r["floats_per_sample"] * (20 * 32 + 16)
    return diff


@pytest.mark.mpi
def test_users_models_under_mpirun_equal_single_process(battery):
    """DeepCTR's DeepFM (with its defaults, and with this project's options), a TFRA DeepFM, a
    two-tower model and a DeepFM whose two fields share a table, each rank built with its own
    random weights: under a real mpirun (Horovod, 3 processes) des.transform gives every rank
    rank 0's weights, and after 20 steps of the user's fit the DES model equals the untouched
    model on one process. The two-tower plan leaves ranks 0 and 2 with no field of one tower."""
    out = battery(3) / "gallery"
    for name in USERS:
        ranks = _ranks(out, name, 3)
        subs = "2 substitution(s)" if name == "two_tower" else "3 substitution(s)"
        assert f"{subs}, rank 0 of 3" in ranks[0]["report"]
        _check_against_reference(name, ranks)
    shared = _ranks(out, "shared_table_deepfm", 3)[0]["report"]
    assert "rank 0: load" in shared and "f0+f1" in shared
    tt = _ranks(out, "two_tower", 3)[0]["report"]     # user tower f0, f1; item tower f2, f3
    assert re.search(r"rank 0: load [\d.]+  \[f0\]\n.*rank 1: load [\d.]+  \[f1, f3\]\n.*rank 2: load [\d.]+  \[f2\]",
                     tt), tt


@pytest.mark.mpi
def test_tables_no_rule_splits_go_by_field_rows_under_mpirun(battery):
    """DeepCTR's DCN (its Cross reads every field's embedding), DIN (attention over the masked
    behaviour history) and a DLRM port (one table of all fields by offsets, split by key range): no
    table stays whole on every process; each owner sends its field's rows in the fused allreduce
    (the DLRM's: 3 ranks hold the 4 ranges, none the whole table), and after 20 steps
    every rank equals the untouched model on one process (3 processes; DCN also on 5, more
    processes than fields: two own nothing)."""
    for name in FIELD_ROWS:
        ranks = _ranks(battery(3) / "gallery", name, 3)
        assert "field_rows" in ranks[0]["report"] and "NOT substituted" not in ranks[0]["report"], ranks[0]["report"]
        _check_against_reference(name, ranks)
        if name == "dlrm_offsets":
            from gallery import V
            assert "split by key range into 4 fields" in ranks[0]["report"], ranks[0]["report"]
            for table in {k for r in ranks for k in r["tables"]}:
                held = [set(r["tables"].get(table, {})) for r in ranks]
                assert all(held) and sum(map(len, held)) == len(set().union(*held)) == 4 * V, table
    ranks = _ranks(battery(5) / "gallery", "deepctr_dcn", 5)
    assert "no fields: contributes zeros" in ranks[0]["report"]
    _check_against_reference("deepctr_dcn", ranks)


@pytest.mark.mpi
def test_architectures_that_kept_tables_whole_are_split_at_2_processes(battery):
    """Issue 60's held-out architectures under a real mpirun at N = 2: every table is owned by one
    process ("NOT substituted" nowhere in the report) and after 20 steps of the user's fit each
    equals the untouched model on one process; DeepCTR's DeepFM with its table penalties under
    legacy Adagrad too (a 2e-4 report that did not reproduce)."""
    out = battery(2) / "gallery"
    for job in HELD_OUT:
        ranks = _ranks(out, job, 2)
        report = ranks[0]["report"]
        assert "NOT substituted" not in report, report          # every table owned by one process
        # AutoInt's softmax over the fields amplifies float32 summation order: 6.6e-7 measured at N = 2
        _check_against_reference(job, ranks, ("predictions, held-out architectures", 5e-6))


def _tail_reference(name: str, initial) -> dict:
    """The untouched model on one process, from rank 0's initial weights, fitted as
    scripts/mpi_tail.py fits the ranks (SGD 0.5, batches of 31 rows and one of 2)."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import des
    from des.jobs.verify import fit_and_snapshot
    from gallery import BUILDERS
    from mpi_tail import tail_batches
    model = BUILDERS[name]()
    model.set_weights(initial)
    des.make_keyed(model, seed=0)
    batches, probe = tail_batches(model)
    return fit_and_snapshot(model, batches, probe, optimizer="sgd", learning_rate=0.5)


@pytest.mark.mpi
def test_field_rows_by_samples_under_mpirun(battery):
    """The data-parallel tail with the field vectors no rule splits sent to their samples'
    processes (des_ops.rows.rows_to_samples): DCN and a DLRM port (its tables split by key range
    have several owners: each sends its positions' rows), each at N = 2 and N = 5 (a process owning
    no field), equal one process, with uneven and empty shards; the bytes handed over per step are the
    reduce-scatter's partials and each owner's rows, once per distinct id of a slice (DCN's fields; the
    DLRM port's positions, keyed ``ids[f]``), counted by hand."""
    from des_ops.rows import distinct_rows
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]
    from gallery import BUILDERS, K
    from mpi_tail import tail_batches

    # by hand (tests/gallery.py, K = 4): DCN's 4 fields of K floats by samples, its linear sum (1 float)
    # reduce-scattered and DeepCTR's table penalties in their own 1-float allreduce per call; the DLRM
    # port's two tables split by key range, [B, 4, K] and [B, 4, 1], by samples from their positions'
    # owners (2 positions each at N = 2): 4 K + 4 floats, nothing reduce-scattered
    hand = {"deepctr_dcn": (1, 4 * K, True), "dlrm_offsets": (0, 4 * K + 4, False)}
    calls = [31] * 12 + [2] + [16]            # 13 training batches and the probe's prediction
    for name, n in (("deepctr_dcn", 2), ("dlrm_offsets", 2), ("deepctr_dcn", 5), ("dlrm_offsets", 5)):
        ranks = _ranks(battery(n) / "samples", name, n)
        diff = compare(_tail_reference(name, ranks[0]["initial"]), ranks)
        print(f"mpirun -np {n} {name} field rows by samples: {diff}, widths by rank {ranks[0]['by_samples']}")
        within(f"samples N={n} {name}", max(diff.values()), 1e-6)
        scattered, width, penalty = hand[name]
        widths = ranks[0]["by_samples"]
        assert sum(widths) == width and all(r["by_samples"] == widths for r in ranks)
        if name == "dlrm_offsets":        # every owner one block per table and position, keyed by its ids
            assert all(w % (K + 1) == 0 for w in widths) and widths.count(0) == max(0, n - 4), widths
            assert [[b.width for b in bl] for bl in ranks[0]["sample_blocks"]] == \
                [[K] * (w // (K + 1)) + [1] * (w // (K + 1)) for w in widths]
        if n == 5:
            assert widths.count(0) == 1                          # 4 fields on 5 processes: one sends no rows
        batches, probe = tail_batches(BUILDERS[name]())
        fed = [x for x, _ in batches] + [probe]
        blocks = ranks[0]["sample_blocks"]
        assert all(b.key is not None for bl in blocks for b in bl)    # key ranges: a position's key is ids[f]
        for r, snap in enumerate(ranks):
            # each field's rows once per distinct id of a destination's slice (counted in numpy)
            sent = [distinct_rows(x, blocks, b, r)[0] if any(blocks) else 0 for x, b in zip(fed, calls)]
            assert snap["counted"]["step"]["bytes"] == sum(4 * scattered * b + 4 * s + 4 * penalty
                                                           for b, s in zip(calls, sent))


@pytest.mark.mpi
def test_one_table_split_by_key_stripe_under_mpirun(battery):
    """TFRA's one-table style (tests/gallery.py tfra_one_table: ids [B, 4] into one dynamic table of
    width K and one of width 1) at N = 3: each table split by key stripe, every process holding the
    keys k mod 3 == its rank only; the user's fit equals one process under the replicated tail, and
    under the data-parallel tail with the rows by samples, each position's own keys once per
    distinct id of a slice (keys ``ids[f]@r/3``), the bytes as numpy counts them, and with joined
    tables: each process's stripes of both tables in one fused table (one lookup a step)."""
    from des_ops.rows import distinct_rows
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]
    from gallery import BUILDERS, K
    from mpi_tail import tail_batches
    name, n = "tfra_one_table", 3
    ranks = _ranks(battery(n) / "gallery", name, n)
    assert "split by key stripe over 3 processes" in ranks[0]["report"], ranks[0]["report"]
    _check_against_reference(name, ranks)
    for r, snap in enumerate(ranks):
        assert len(snap["tables"]) == 2 and all(keys and all(k % n == r for k in keys)
                                                for keys in snap["tables"].values()), r
    ranks = _ranks(battery(n) / "samples", name, n)
    joined = [line for line in ranks[0]["report"].splitlines() if f"des_fused{K + 1}_joined_stripe" in line]
    assert len(joined) == 1 and "key stripe (k mod 3 == 0)" in joined[0], ranks[0]["report"]
    diff = compare(_tail_reference(name, ranks[0]["initial"]), ranks)
    print(f"mpirun -np {n} {name} stripes by samples, joined: {diff}")
    within(f"stripes by samples N={n}", max(diff.values()), 1e-6)
    blocks = ranks[0]["sample_blocks"]
    assert [sorted(b.key for b in bl) for bl in blocks] == [sorted([f"ids[{f}]@{r}/{n}" for f in range(4)] * 2)
                                                            for r in range(n)]
    batches, probe = tail_batches(BUILDERS[name]())
    fed = [x for x, _ in batches] + [probe]
    calls = [31] * 12 + [2] + [16]
    for r, snap in enumerate(ranks):
        sent = [distinct_rows(x, blocks, b, r)[0] for x, b in zip(fed, calls)]
        assert snap["counted"]["step"]["bytes"] == 4 * sum(sent), r


@pytest.mark.mpi
def test_a_big_field_split_by_key_stripe_under_mpirun(battery):
    """tests/gallery.py big_field_deepfm and big_bag_deepfm at N = 3 with des.Options(stripe_min_rows=0):
    f0 (30 V of 33 V rows), and "hist", a bag of 5 ids a sample read by FM (which squares its pooled
    vector after the sum over processes), the linear sum and the first Dense (with an L2 kernel
    penalty), are too big for one owner and split by key stripe (des.compiler.big_tables).
    Their two tables are held by every process, each the keys k mod 3 == its rank; every process
    holds the field's first-Dense kernel rows whole (their gradients summed). The user's fit (Adam,
    the tail des.transform picks) and the data-parallel tail (SGD, the first Dense by partials)
    equal one process, every rank's predictions the same bits."""
    n = 3
    for name, field in (("big_field_deepfm", "f0"), ("big_bag_deepfm", "hist")):
        ranks = _ranks(battery(n) / "big", name, n)
        report = ranks[0]["report"]
        assert f"field '{field}': 1,200 rows, more than an even share" in report and \
            "split by key stripe over 3 processes" in report, report
        assert (name == "big_bag_deepfm") == ("squares its 5 ids a sample after the sum over processes" in report)
        diff = compare(_gallery_reference(name, ranks[0]["initial"]), ranks)
        print(f"mpirun -np {n} {name} ({field} split by key stripe): {diff}")
        within(f"{name} N=3 predictions", diff["predictions"], 5e-7)
        within(f"{name} N=3 rows and weights", max(diff.values()), 1e-5)
        split = sorted({k for r in ranks for k, rows in r["tables"].items()
                        if rows and sum(bool(q["tables"].get(k)) for q in ranks) > 1})
        assert len(split) == 2, (name, split)                          # the field's width-K and 1-wide tables
        for r, snap in enumerate(ranks):
            assert np.array_equal(snap["predictions"], ranks[0]["predictions"])
            assert all(k % n == r for t in split for k in snap["tables"][t]), (name, r)
            assert [k for k in snap["whole"] if "/rows:" in k], (name, snap["whole"])   # its kernel rows, on every rank
        ranks = _ranks(battery(n) / "bigtail", name, n)
        diff = compare(_tail_reference(name, ranks[0]["initial"]), ranks)
        print(f"mpirun -np {n} {name} ({field} split, data-parallel tail): {diff}")
        within(f"{name} data-parallel tail N=3", max(diff.values()), 1e-6)


def _split_field_trains_like_one_process(where, args: list, field: str, extra: tuple = (), tag: str = "") -> None:
    """des.train ``args`` on one process and on 3 (``--mode des`` and ``extra``), ``--checkpoint``
    ``where``/<tag>s and <tag>d: ``field``'s two tables split by key stripe (the report says so, each
    process holds some of the rows one process holds, together all of them), the same held-out AUC
    and log loss (measured 0 both)."""
    single = subprocess.run([sys.executable, *args, "--checkpoint", str(where / f"{tag}s"), "--summary-json",
                             str(where / f"{tag}s.json")], env=ENV, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
    assert single.returncode == 0, single.stderr[-3000:]
    run = mpirun(3, *args, "--mode", "des", *extra, "--checkpoint", str(where / f"{tag}d"),
                 "--summary-json", str(where / f"{tag}d.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"emb1_{field}, emb4_{field} split by key stripe over 3 processes" in run.stdout, run.stdout[-3000:]
    one = json.load(open(where / f"{tag}s.json"))
    ranks = [json.load(open(where / f"{tag}d.json.rank{r}")) for r in range(3)]
    table = f"emb4_{field}/emb1_{field}"
    held = [r["table_rows"]["tables"][table]["held"] for r in ranks]
    print(f"{field} rows held: one process {one['table_rows']['tables'][table]['held']}, N = 3 {held}")
    assert sum(held) == one["table_rows"]["tables"][table]["held"] and min(held) > 0
    for got in ranks:
        within(f"{field}: |AUC - single's|", abs(got["auc"] - one["auc"]), 1e-7)
        within(f"{field}: |log loss - single's|", abs(got["logloss"] - one["logloss"]), 5e-7)


@pytest.mark.mpi
def test_des_train_splits_a_big_field_saves_and_serves_like_one_process(tmp_path):
    """des.train's own model on criteo-like data whose C26 has 1,000,000 values (the
    criteo-big-field preset): with des.Options' defaults at N = 3 the field is too big for one owner
    and its two tables are split by key stripe. Adam, 6 steps of 256: the same held-out AUC and log
    loss as one process; its checkpoint, read by 2 processes, predicts what one process's does, and
    the same bits in each of 3 launches. Then libffm data whose fields are weighted (tables that pool ids times weights themselves), F3
    declared big, --stripe-min-rows 0: split, the same AUC and log loss."""
    from des.data.synth import write_criteo
    data, test = tmp_path / "big.txt", tmp_path / "test.txt"
    write_criteo(str(data), 3000, preset="criteo-big-field", seed=1, quiet=True)
    test.write_text("".join(open(data).readlines()[-400:]))
    args = ["-m", "des.train", "--model", "deepfm", "--batch", "256", "--hidden", "16", "--dim", "4", "--threads", "1",
            "--holdout", "500", "--shuffle-buffer", "1000", "--lr", "0.02", "--steps", "6"]
    _split_field_trains_like_one_process(tmp_path, [*args, "--data", str(data)], "C26")
    preds, said = _predictions(tmp_path, test, (("s", 1), ("d", 2), ("d", 2), ("d", 2)))
    assert "des checkpoint of 3 process(es), read by 2" in said, said[-2000:]
    within("DES 3 checkpoint read by 2: predictions", np.abs(preds[0] - preds[1]).max(), 5e-7)  # measured 2.1e-7
    # the same job gives the same bits: with tf.add_n in the partials, 4 distinct outputs came of 6 launches
    for again in preds[2:]:
        np.testing.assert_array_equal(preds[1], again, err_msg="des.predict at N = 2, launched again")
    # libffm: every field weighted (idx:val), its table pooling ids times weights itself; F3 declared big
    ffm = tmp_path / "w.ffm"
    write_small_ffm(str(ffm), 4000, seed=3, fields=4)
    meta = json.load(open(f"{ffm}.meta.json"))
    json.dump(dict(meta, cardinalities={"F0": 10, "F1": 20, "F2": 100, "F3": 500}), open(f"{ffm}.meta.json", "w"))
    _split_field_trains_like_one_process(tmp_path, [*args, "--data", str(ffm)], "F3", ("--stripe-min-rows", "0"), "w")


@pytest.mark.mpi
def test_same_mpirun_job_gives_the_same_bits_and_idle_processes_take_part(battery):
    """One job (DeepCTR's DeepFM with its defaults, the two-tower model, the shared-table DeepFM,
    a Keras DeepFM with the data-parallel tail, with partials and with its first Dense by rows) launched twice on 3 processes: bitwise-identical
    predictions, rows and weights both times. On 5 processes (more than the fields or field
    groups) some own nothing at all: the jobs end on their own and equal one process too."""
    first, again = battery(3), battery(3, again=True)
    for job in REPEATED:
        kind, name = job.split(":")
        for a, b in zip(_ranks(first / kind, name, 3), _ranks(again / kind, name, 3)):
            _same_bits(a, b, job)
    for name in ("two_tower", "shared_table_deepfm"):
        ranks = _ranks(battery(5) / "gallery", name, 5)
        assert "no fields: contributes zeros" in ranks[0]["report"]
        _check_against_reference(name, ranks)


@pytest.mark.mpi
@pytest.mark.parametrize("kind, expected", [
    ("plan", r"rank 1 of 2 disagrees with rank 0 on the field plan: rank 0 has 'f0 -> \d"),
    ("collective", r"Missing ranks:\s+0: \[.*des_partials__denseblock16x2_forced_by_DES_TEST_DISAGREE\]")])
def test_processes_that_disagree_end_the_job_with_a_message_naming_the_ranks(tmp_path, kind, expected):
    """A forced disagreement (test hook DES_TEST_DISAGREE): a field plan that differs on rank 1
    is caught at transform; an allreduce that rank 1 names differently (no check) is ended by
    Horovod's stall shutdown (DES's default 60 s; here the user's own setting, 10 s, which wins),
    which names the missing ranks and the collective."""
    import time
    t0 = time.time()
    run = mpirun(2, "scripts/mpi_gallery.py", str(tmp_path), "two_tower", timeout=900,
                 env={"DES_TEST_DISAGREE": f"{kind}:1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
                      "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "10"})
    took = time.time() - t0
    out = run.stdout + run.stderr
    print(f"{kind}: ended in {took:.0f} s with code {run.returncode}")
    assert run.returncode != 0 and re.search(expected, out), out[-3000:]
    assert took < 60, took          # start-up and tracing (about 35 s on a slow machine) + the 10 s stall shutdown


@pytest.mark.mpi
def test_the_mpi4py_collectives_with_an_empty_slice_and_a_disagreement_under_mpirun(tmp_path):
    """des_ops.mpi.Mpi4pyCommunicator on 3 processes (scripts/mpi_collectives.py; rank 2 holds no
    row): allreduce, all-gather, all-to-all, reduce-scatter and broadcast give what numpy computes,
    eagerly and chained in one tf.function; an all-to-all that rank 1 names differently ends on
    every rank with an error naming the other ranks."""
    run = mpirun(3, "scripts/mpi_collectives.py", str(tmp_path), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    n = 3
    held = [(100.0 * r + np.arange(2 * k, dtype=np.float32)).reshape(k, 2) for r, k in enumerate((3, 1, 0))]
    base = np.arange(10, dtype=np.float32).reshape(5, 2)
    for r in range(n):
        said = pickle.load(open(tmp_path / f"rank{r}.pkl", "rb"))
        # row i of rank s goes to rank (i + s) mod 3
        came = [[row for i, row in enumerate(held[s]) if (i + s) % n == r] for s in range(n)]
        expected = {"allreduce_f64": [1.5, 3.0], "allreduce_i64": [3, 21], "allgather": np.concatenate(held),
                    "alltoall": np.array([row for rows in came for row in rows], np.float32).reshape(-1, 2),
                    "alltoall_splits": [len(rows) for rows in came],
                    "reducescatter": 6 * base[(0, 2, 4)[r]:(2, 4, 5)[r]]}       # 1 + 2 + 3; rows 2, 2 and 1
        for how in ("eager", "graph"):
            assert sorted(said[how]) == sorted(expected)
            for key, value in expected.items():
                np.testing.assert_array_equal(said[how][key], value, err_msg=f"rank {r} {how} {key}")
        np.testing.assert_array_equal(said["broadcast"], [1, 10])
        others = "0, 2" if r == 1 else "1"
        assert said["disagreement"] == (f"rank {r} of 3: all-to-all {'rows' if r == 1 else 'ids'!r} met another "
                                        f"collective on rank(s) {others} (MPI matches collectives by order)")


@pytest.mark.mpi
def test_every_tail_on_the_mpi4py_communicator_under_mpirun(battery):
    """The data-parallel tail, the first Dense by rows, rows by samples (DCN; a DLRM port whose
    tables are split by key range) and the first layer by rows on des_ops.mpi.Mpi4pyCommunicator
    (reduce-scatter, all-gather, all-to-all by mpi4py, each wait sleeping), N = 5 > 4 fields (a
    process owns nothing), uneven and empty shards: each equals one process as Horovod's launch
    does, hands over the bytes Horovod's launch counts, and a second launch gives the same bits.
    The first layer by rows runs on the default communicator (des_ops.mpi.SettlingCommunicator),
    which settles on mpi4py for it."""
    first, again = battery(5, mpi4py=True), battery(5, again=True, mpi4py=True)
    for kind, name in [j for j in MPI4PY if j[0] != "equivalence"]:
        ranks = _ranks(first / kind, name, 5)
        if kind == "layerrows":
            assert "collectives by mpi4py: each wait sleeping, no Horovod (the first layer by rows" in ranks[0]["report"]
        for a, b in zip(_ranks(again / kind, name, 5), ranks):
            _same_bits(a, b, f"mpi4py {kind}:{name}")
        horovod = _ranks(battery(5) / kind, name, 5)
        assert [r["counted"] for r in ranks] == [r["counted"] for r in horovod]
        diff = compare(_tail_reference(name, ranks[0]["initial"]), ranks)
        print(f"mpirun -np 5 {kind}:{name} on mpi4py: {diff}")
        within(f"mpi4py {kind}:{name}", max(diff.values()), 1e-6)        # measured <= 1.8e-7


@pytest.mark.mpi
def test_subclassed_and_tfrs_models_under_mpirun_equal_single_process(battery):
    """TensorFlow Recommenders' ranking model (IntegerLookup + Embedding per side, Dense
    64-32-1, its Ranking task and compute_loss, Adagrad), a subclassed Wide & Deep and a TFRS
    two-tower retrieval model (towers called in compute_loss; one field in the candidate tower,
    so at N = 3 two processes own none of its fields): traced or transformed tower by tower,
    trained with the user's own fit under a real mpirun; after 20 steps every rank equals the
    untouched model on one process started from rank 0's weights. The retrieval model again with
    the mpi4py communicator: the same bits."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from subclassed_models import BUILDERS, COLLECTIVES, EXPECTED, batches_for, outputs, probe_of, train
    n, out = 3, battery(3) / "subclassed"      # N = 2: the in-process world (tests/test_subclassed.py)
    for name in SUBCLASSED:
        ranks = _ranks(out, name, n)
        assert f"{len(EXPECTED[name])} substitution(s), rank 0 of {n}" in ranks[0]["report"], ranks[0]["report"]
        reference = BUILDERS[name]()
        probe = probe_of(name)
        outputs(name, reference, probe)
        reference.set_weights(ranks[0]["initial"])
        ref = train(name, reference, batches_for(name, 20, 32, seed=4), probe)
        for r in ranks:
            diff = float(np.abs(r["predictions"] - ref["predictions"]).max())
            print(f"mpirun -np {n} {name}: predictions {diff:.1e}")
            within("predictions", diff, 1e-6, case=name)
            within("|loss - one process's| / max(1, loss)", abs(r["loss"] - ref["loss"]) / max(1.0, abs(ref["loss"])),
                   5e-7, case=name)   # retrieval: a sum ~100; measured <= 6.0e-8
            assert np.array_equal(r["predictions"], ranks[0]["predictions"])
            assert r["allreduce_calls"] == (20 + 1) * COLLECTIVES.get(name, 1)   # per fit step and predict
    # the retrieval model's two towers make two allreduces a step: by mpi4py (matched by order, chained
    # in trace order) they give the very bits of Horovod's (matched by name)
    (out / "mpi4py").mkdir(exist_ok=True)
    run = mpirun(n, "scripts/mpi_subclassed.py", str(out / "mpi4py"), "--mpi4py", "tfrs_retrieval")
    assert run.returncode == 0, run.stderr[-3000:]
    assert COLLECTIVES["tfrs_retrieval"] == 2
    for a, b in zip(_ranks(out, "tfrs_retrieval", n), _ranks(out / "mpi4py", "tfrs_retrieval", n)):
        np.testing.assert_array_equal(a["predictions"], b["predictions"])
        assert a["allreduce_calls"] == b["allreduce_calls"]


@pytest.mark.mpi
def test_data_parallel_tail_under_mpirun(battery):
    """The data-parallel tail under Horovod (reduce-scatter, all-gathers, the tail's gradient
    allreduce): N = 3 with batches of 31 rows and a last one of 2 (uneven shards, one empty)
    equals one process (and gives the same bits in a second launch: the same-bits test); N = 5
    > 4 fields (a process owns nothing) on DeepCTR's DeepFM (penalties on tables and tail) too."""
    from des_ops.comm import shard_rows


    ranks = _ranks(battery(3) / "tail", "keras_deepfm", 3)
    diff = compare(_tail_reference("keras_deepfm", ranks[0]["initial"]), ranks)
    print(f"mpirun -np 3 keras_deepfm data-parallel tail: {diff}")
    within("max diff", max(diff.values()), 1e-6, case="tail N=3 keras_deepfm")
    sizes = [31] * 12 + [2]
    for r, snap in enumerate(ranks):
        # by hand (tests/gallery.py keras_deepfm, K = 4): partials linear 1 + FM's S and Q 5 + first Dense 8;
        # tail variables: the first Dense's bias 8, the last Dense's kernel 8 and bias 1
        w, t = 1 + 5 + 8, 8 + 8 + 1
        assert (snap["floats_per_sample"], snap["tail_floats"]) == (w, t)
        rows = lambda b: (lambda lo, hi: hi - lo)(*shard_rows(b, r, 3))
        assert snap["counted"]["step"]["bytes"] == 4 * w * (sum(sizes) + 16)
        assert snap["counted"]["tail"]["bytes"] == sum(4 * (rows(b) * (1 + w) + t) for b in sizes) + 4 * rows(16)

    ranks = _ranks(battery(5) / "tail", "deepctr_deepfm", 5)
    assert not all(r["owns_fields"] for r in ranks)                          # a process owns no field
    diff = compare(_tail_reference("deepctr_deepfm", ranks[0]["initial"]), ranks)
    print(f"mpirun -np 5 deepctr_deepfm data-parallel tail: {diff}")
    within("max diff", max(diff.values()), 1e-6, case="tail N=5 deepctr_deepfm")

    # the first Dense by rows (des_ops.rows): all-to-alls of rows and kernel gradients, an all-gather
    # of the kernel; N = 3 with uneven and empty shards, N = 5 with a process that owns no field
    # rows of a field travel once per distinct id of each destination's slice (des_ops.rows.Block): counted
    # here in numpy from the batches' ids
    from des_ops.rows import distinct_rows
    sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "scripts")]
    from gallery import BUILDERS
    from mpi_tail import tail_batches
    ranks = _ranks(battery(3) / "rows", "keras_deepfm", 3)
    diff = compare(_tail_reference("keras_deepfm", ranks[0]["initial"]), ranks)
    print(f"mpirun -np 3 keras_deepfm first Dense by rows: {diff}")
    within("max diff", max(diff.values()), 1e-6, case="rows N=3 keras_deepfm")
    batches, probe = tail_batches(BUILDERS["keras_deepfm"]())
    fed = [x for x, _ in batches] + [probe]
    for r, snap in enumerate(ranks):
        (widths, units), = snap["by_rows"]
        blocks, = snap["rank_blocks"]
        w, t = snap["floats_per_sample"], snap["tail_floats"]
        assert w == 6 and sum(widths) == 16 and units == 8               # linear 1 + FM 5 summed; 4 fields x 4 by rows
        assert sorted(b.key for bl in blocks for b in bl) == ["f0", "f1", "f2", "f3"]
        rows = lambda b: (lambda lo, hi: hi - lo)(*shard_rows(b, r, 3))
        moved = [distinct_rows(x, blocks, b, r) for x, b in zip(fed, sizes + [16])]
        assert snap["counted"]["step"]["bytes"] == sum(4 * w * b + 4 * sent + 4 * widths[r] * units
                                                       for b, (sent, _) in zip(sizes + [16], moved))
        assert snap["counted"]["tail"]["bytes"] == sum(4 * (rows(b) * (1 + w) + t) + 4 * got + 4 * sum(widths) * units
                                                       for b, (_, got) in zip(sizes, moved)) + 4 * rows(16)
    ranks = _ranks(battery(5) / "rows", "deepctr_deepfm", 5)
    assert [r["by_rows"][0][0] for r in ranks][0].count(0) >= 1             # a process sends rows of no field
    diff = compare(_tail_reference("deepctr_deepfm", ranks[0]["initial"]), ranks)
    print(f"mpirun -np 5 deepctr_deepfm first Dense by rows: {diff}")
    within("max diff", max(diff.values()), 1e-6, case="rows N=5 deepctr_deepfm")

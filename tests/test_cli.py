"""des.train options that need no launcher.

The data is a generated libffm file of 6 fields (tests/helpers.py write_small_ffm): what these
tests check does not depend on the format or on Criteo's 39 fields, and a run traces 12 tables
instead of 78 (~15 s instead of ~45-60 s). Criteo files under des.train / des.predict:
tests/test_predict.py."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from des.jobs.job import batches_left
from helpers import copy_meta, write_small_ffm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
TRAIN = [sys.executable, "-m", "des.train", "--model", "fm", "--batch", "256", "--threads", "1",
         "--shuffle-buffer", "1000"]


def test_eval_data_file_equals_holding_out_the_same_lines(tmp_path):
    """--eval-data trains on all of --data (no counting pass) and evaluates the other file: the
    same result as holding out those lines at the end of one file."""
    full = str(tmp_path / "full.txt")
    write_small_ffm(full, 3000, seed=3)
    lines = open(full).read().splitlines(keepends=True)
    (tmp_path / "train.txt").write_text("".join(lines[:2600]))
    (tmp_path / "eval.txt").write_text("".join(lines[2600:]))
    copy_meta(full, str(tmp_path / "train.txt"))      # the format and spec of the data
    runs = {}
    for name, args in (("holdout", ["--data", full, "--holdout", "400"]),
                       ("eval", ["--data", str(tmp_path / "train.txt"), "--eval-data", str(tmp_path / "eval.txt")])):
        r = subprocess.run(TRAIN + args + ["--summary-json", str(tmp_path / f"{name}.json")], env=ENV,
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = (json.load(open(tmp_path / f"{name}.json")), r.stdout)
    assert "on 2600 lines, evaluating on 400 held-out lines" in runs["holdout"][1]
    assert "on all lines of --data, evaluating on" in runs["eval"][1]
    assert runs["eval"][0]["auc"] == runs["holdout"][0]["auc"] and 0 < runs["eval"][0]["auc"] < 1
    assert runs["eval"][0]["logloss"] == runs["holdout"][0]["logloss"]
    assert 0 < runs["eval"][0]["cpu_seconds_per_step"] < 60 and "CPU s per step on this process" in runs["eval"][1]


def test_eval_file_with_longer_bags_than_training_is_sized_from_both(tmp_path):
    """libffm without metadata: the spec is scanned from --data AND --eval-data, so a field with
    more features per line in the evaluation file than in any training line is evaluated (it
    stopped with "field 'F1' has more than 1 features (the spec's max_len)")."""
    rng = np.random.default_rng(0)
    line = lambda n1: " ".join([str(int(rng.random() < 0.3)), f"0:{rng.integers(1, 50)}:1"] +   # noqa: E731
                               [f"1:{rng.integers(1, 80)}:1" for _ in range(n1)])
    (tmp_path / "train.ffm").write_text("\n".join(line(1) for _ in range(600)) + "\n")
    (tmp_path / "eval.ffm").write_text("\n".join(line(3) for _ in range(200)) + "\n")
    r = subprocess.run(TRAIN + ["--format", "libffm", "--data", str(tmp_path / "train.ffm"), "--eval-data",
                                str(tmp_path / "eval.ffm"), "--summary-json", str(tmp_path / "s.json")],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert 0 < json.load(open(tmp_path / "s.json"))["auc"] < 1


def test_missing_eval_file_is_a_clear_error(tmp_path):
    data = str(tmp_path / "train.txt")
    write_small_ffm(data, 300, seed=3)
    r = subprocess.run(TRAIN + ["--data", data, "--eval-data", str(tmp_path / "nope.txt")], env=ENV,
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and f"{tmp_path / 'nope.txt'}: no such file" in r.stderr, r.stderr[-2000:]


def test_linear_optimizer_option(tmp_path):
    """--linear-optimizer ftrl trains the linear part with FTRL; the checkpoint records it."""
    data = str(tmp_path / "train.txt")
    write_small_ffm(data, 1000, seed=3)
    r = subprocess.run(TRAIN + ["--data", data, "--model", "wdl", "--steps", "3", "--linear-optimizer", "ftrl",
                                "--checkpoint", str(tmp_path / "ck")],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "optimizer adam (ftrl on the linear part)" in r.stdout
    assert json.load(open(tmp_path / "ck" / "state" / "config.json"))["linear_optimizer"] == "ftrl"
    # --restore with other settings would keep what matches and start the rest fresh: refused
    again = TRAIN + ["--data", data, "--model", "wdl", "--steps", "1", "--restore", str(tmp_path / "ck")]
    r = subprocess.run(again + ["--optimizer", "adagrad"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    assert (f"error: {tmp_path / 'ck'}: the checkpoint was written with --optimizer adam (this run: adagrad); "
            f"--linear-optimizer ftrl (this run: None): restore with the same settings") in r.stderr, r.stderr[-2000:]
    r = subprocess.run(again + ["--linear-optimizer", "ftrl"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0 and "restored" in r.stdout, r.stderr[-3000:]


def test_restore_continues_where_the_checkpoint_stopped(tmp_path):
    """Train 3 steps of epoch 1 and save; --restore with --epochs 2 trains epoch 2 only. At
    learning rate 0 (Adam moves nothing) the held-out AUC and log loss equal the saving run's, to
    the bit; at the saving run's learning rate the restored model goes on learning from there."""
    data = str(tmp_path / "train.txt")
    write_small_ffm(data, 2000, seed=3)
    base = TRAIN + ["--data", data, "--model", "wdl", "--steps", "3", "--holdout", "500"]
    runs, out = {}, {}
    for name, extra in (("saved", ["--lr", "0.02", "--checkpoint", str(tmp_path / "ck")]),
                        ("restored", ["--lr", "0", "--epochs", "2", "--restore", str(tmp_path / "ck")]),
                        ("continued", ["--lr", "0.02", "--epochs", "2", "--restore", str(tmp_path / "ck")])):
        r = subprocess.run(base + extra + ["--summary-json", str(tmp_path / f"{name}.json")], env=ENV,
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name], out[name] = json.load(open(tmp_path / f"{name}.json")), r.stdout
    saved, restored, continued = runs["saved"], runs["restored"], runs["continued"]
    assert "continuing at epoch 2, step 0" in out["continued"]
    assert (restored["auc"], restored["logloss"]) == (saved["auc"], saved["logloss"])
    assert continued["logloss"] < saved["logloss"] - 1e-4
    # the summary's timings: one save (the epoch's end) and no restore in the saving run, a restore in the others
    assert len(saved["checkpoint_save_seconds"]) == 1 and 0 < saved["checkpoint_save_seconds"][0] < 600
    assert 0 < saved["peak_rss_mib_before_first_save"] <= saved["peak_rss_mib"]
    assert "restore_seconds" not in saved and 0 < restored["restore_seconds"] < 600
    assert [len(r["samples_per_second_by_epoch"]) for r in (saved, restored, continued)] == [1, 1, 1]


def test_resume_after_a_crash_equals_the_uninterrupted_run(tmp_path):
    """2 epochs straight, against the same job killed at step 7 of epoch 1 (checkpoints every 3
    steps) and resumed with --restore: the same held-out AUC and log loss, to the bit, and the
    same predictions (des.predict) within 1e-6. So does a job resumed from a checkpoint on the
    first epoch's last step."""
    data = str(tmp_path / "train.txt")
    write_small_ffm(data, 3000, seed=4)
    base = TRAIN + ["--data", data, "--model", "deepfm", "--epochs", "2", "--holdout", "500",
                    "--optimizer", "adagrad", "--linear-optimizer", "ftrl"]
    runs = {}
    for name, extra in (("straight", ["--checkpoint", str(tmp_path / "a")]),
                        ("killed", ["--checkpoint", str(tmp_path / "b"), "--checkpoint-every", "3",
                                    "--fail-at-step", "7"]),
                        ("resumed", ["--restore", str(tmp_path / "b"), "--checkpoint", str(tmp_path / "b")])):
        r = subprocess.run(base + extra + ["--summary-json", str(tmp_path / f"{name}.json")], env=ENV,
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        if name == "killed":
            assert r.returncode == 17 and not (tmp_path / "killed.json").exists(), r.stderr[-3000:]
            assert json.load(open(tmp_path / "b" / "state" / "config.json"))["position"]["step"] == 6
            continue
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = json.load(open(tmp_path / f"{name}.json"))
    assert (runs["resumed"]["auc"], runs["resumed"]["logloss"]) == (runs["straight"]["auc"], runs["straight"]["logloss"])
    # a checkpoint on an epoch's last step (2,500 lines: 10 batches; due after the 10th, saved before
    # an 11th the data lacks): resumed, the rest of that epoch is empty and the job goes on with the next
    r = subprocess.run(base + ["--epochs", "1", "--checkpoint", str(tmp_path / "c"), "--checkpoint-every", "10"],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.load(open(tmp_path / "c" / "state.old" / "config.json"))["position"]["step"] == 10
    os.makedirs(tmp_path / "e")
    os.rename(tmp_path / "c" / "state.old", tmp_path / "e" / "state")
    r = subprocess.run(base + ["--restore", str(tmp_path / "e"), "--checkpoint", str(tmp_path / "e"),
                               "--summary-json", str(tmp_path / "end.json")],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "epoch 1 has no batch after step 10 (the checkpoint was at its end): going on with the next" in r.stdout
    end = json.load(open(tmp_path / "end.json"))
    assert (end["auc"], end["logloss"]) == (runs["straight"]["auc"], runs["straight"]["logloss"])
    preds = []
    for ck in ("a", "b"):
        r = subprocess.run([sys.executable, "-m", "des.predict", "--checkpoint", str(tmp_path / ck), "--data", data,
                            "--out", str(tmp_path / f"{ck}.txt"), "--threads", "1"], env=ENV, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        preds.append(np.loadtxt(tmp_path / f"{ck}.txt"))
    assert preds[0].shape == (3000,) and np.abs(preds[0] - preds[1]).max() <= 1e-6


def test_a_resumed_epoch_with_batches_left_on_some_processes_only_names_them():
    """batches_left: every process's answer in one sum; all alike, they go on alike; else the ranks."""
    class Mode:
        rank, world_size = 1, 3

        def __init__(self, others):
            self.others = others

        def sum_across(self, mine):
            return [o + m for o, m in zip(self.others, mine)]

    empty, some = tf.data.Dataset.range(4).skip(4), tf.data.Dataset.range(4).skip(3)
    assert batches_left(some, Mode([1.0, 0.0, 1.0])) is True
    assert batches_left(empty, Mode([0.0, 0.0, 0.0])) is False
    with pytest.raises(ValueError, match=r"the data of rank\(s\) \[0, 2\] has batches left, that of rank\(s\) \[1\] none"):
        batches_left(empty, Mode([1.0, 0.0, 1.0]))


def _train(tmp_path, *args):
    return subprocess.run(TRAIN + list(args), env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_libsvm_a_short_line_stops_with_its_line_and_the_layout_is_chosen_by_a_flag(tmp_path):
    """Every line has 3 positional features but line 58 ('0 7:1'): the layout is not guessed
    (it was: one bag field, silently); the error names the line and the flag; the flag picks
    the layout, and the scanned spec is printed at start."""
    rng = np.random.default_rng(1)
    lines = [f"{rng.integers(0, 2)} " + " ".join(f"{rng.integers(1, 50)}:1" for _ in range(3)) for _ in range(300)]
    lines[57] = "0 7:1"
    p = tmp_path / "short.svm"
    p.write_text("\n".join(lines) + "\n")
    auto = _train(tmp_path, "--format", "libsvm", "--data", str(p), "--steps", "2")
    assert auto.returncode == 2 and auto.stderr.strip().splitlines()[-1] == (
        f"error: {p}:58: 1 feature(s) where 299 of 300 lines have 3: the libsvm layout is ambiguous; pass "
        f"--libsvm-layout positional (the k-th feature is field k: fix this line) or --libsvm-layout bag (each line "
        f"is a bag of features)"), auto.stderr[-2000:]
    positional = _train(tmp_path, "--format", "libsvm", "--libsvm-layout", "positional", "--data", str(p), "--steps", "2")
    assert positional.returncode != 0 and f"{p}:58" in positional.stderr and "positional libsvm layout" in positional.stderr
    bag = _train(tmp_path, "--format", "libsvm", "--libsvm-layout", "bag", "--data", str(p), "--steps", "2")
    assert bag.returncode == 0, bag.stderr[-2000:]
    assert f"libsvm: scanned {p}: 1 field(s): features (multi, up to 3 features)" in bag.stderr


def test_libffm_a_field_id_past_a_gap_stops_with_its_line(tmp_path):
    """'9:3:1' among fields 0-2 created F3..F9, seven of them empty, without a word."""
    rng = np.random.default_rng(2)
    lines = [f"{rng.integers(0, 2)} " + " ".join(f"{j}:{rng.integers(1, 50)}:1" for j in range(3)) for _ in range(200)]
    lines[41] += " 9:3:1"
    p = tmp_path / "gap.ffm"
    p.write_text("\n".join(lines) + "\n")
    r = _train(tmp_path, "--format", "libffm", "--data", str(p), "--steps", "2")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        f"error: {p}:42: field 9, but field(s) 3-8 never occur: libffm field ids must be 0..F-1 for F fields "
        f"(a typo here would add 6 empty field(s))"), r.stderr[-2000:]


def test_cache_mode_runs_with_its_default_size_on_a_file_without_metadata(tmp_path):
    """--cache-size defaults to 10 % of a field's rows; a file with no metadata has no known
    cardinality, so it stopped on every run. The distinct ids of the first training lines stand in."""
    p = str(tmp_path / "plain.ffm")
    write_small_ffm(p, 3000, seed=1)
    os.remove(p + ".meta.json")
    r = _train(tmp_path, "--mode", "cache", "--format", "libffm", "--data", p, "--steps", "3",
               "--summary-json", str(tmp_path / "s.json"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "cache: 6 field(s) of no known cardinality (F0, F1, F2, ...): --cache-size 10% of the distinct ids " \
           "in the first 2,700 training lines" in r.stdout, r.stdout
    assert 0 < json.load(open(tmp_path / "s.json"))["auc"] < 1


def test_a_bad_line_among_the_first_is_reported_before_the_model_is_built(tmp_path):
    """Line 3 malformed: the error names it in one line, and no model was built or traced first
    (the run stops before its 'training ...' line)."""
    p = str(tmp_path / "bad.ffm")
    write_small_ffm(p, 1000, seed=1)
    lines = open(p).read().splitlines()
    lines[2] = "1 0:5:1 x:y"
    open(p, "w").write("\n".join(lines) + "\n")
    r = _train(tmp_path, "--data", p, "--steps", "3")
    assert r.returncode == 2 and "training fm" not in r.stdout, r.stdout + r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == f"error: {p}:3: feature 2 'x:y' is not field:idx:val", r.stderr[-2000:]


def test_python_m_des_lists_the_commands_and_runs_one():
    out = subprocess.run([sys.executable, "-m", "des"], env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and all(c in out.stdout for c in ("des-train", "des-predict", "des-export",
                                                                  "des-compare", "des-netbed")), out.stdout
    train = subprocess.run([sys.executable, "-m", "des", "train", "--help"], env=ENV, cwd=ROOT, capture_output=True,
                           text=True)
    assert train.returncode == 0 and "--mode" in train.stdout
    bad = subprocess.run([sys.executable, "-m", "des", "trian"], env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("python -m des: unknown command 'trian'")


def test_tail_auto_reports_its_choice_and_a_bad_link_is_one_line(tmp_path):
    """des.train --mode des --tail auto: the summary says which tail the cost model chose and why
    (one process: replicated); --link must be a rate."""
    data = str(tmp_path / "d.txt")
    write_small_ffm(data, 1200, seed=5)
    args = TRAIN + ["--mode", "des", "--data", data, "--steps", "2", "--holdout", "0", "--tail", "auto"]
    r = subprocess.run(args + ["--link", "100mbit", "--summary-json", str(tmp_path / "s.json")], env=ENV, cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.load(open(tmp_path / "s.json"))
    assert s["tail"] == "replicated" and s["tail_reason"] == "replicated: one process, nothing to share", s
    assert "tail chosen by the cost model (tail='auto'): replicated: one process" in r.stdout
    bad = subprocess.run(args + ["--link", "fast"], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    errors = [ln for ln in bad.stderr.splitlines() if ": error: " in ln]      # argparse's one line, no traceback
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and len(errors) == 1, bad.stderr[-2000:]
    assert errors[0].endswith("error: --link: bandwidth 'fast': a number and one of bit, kbit, mbit, gbit, bps, kbps, "
                              "mbps, gbps (e.g. 10gbit), or auto (measured at start)"), errors

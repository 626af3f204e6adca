"""des.predict: checkpoints of des.train back to one probability per input line."""
import os
import subprocess
import sys

import numpy as np
import pytest

from des.data.synth import write_criteo
from helpers import within

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
TRAIN = ["--model", "deepfm", "--steps", "4", "--batch", "256", "--holdout", "0", "--threads", "1"]


def run(*args, n=1):
    cmd = [sys.executable, *args]
    if n > 1:
        cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none"] + cmd
    return subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Generated train.txt, a test.txt of its first 300 lines without the label column, and a
    single-process checkpoint trained 4 steps."""
    d = tmp_path_factory.mktemp("predict")
    train = str(d / "train.txt")
    write_criteo(train, 2000, preset="tiny", seed=1, quiet=True)
    with open(train) as fh:
        head = [next(fh).rstrip("\n") for _ in range(300)]
    test = d / "test.txt"
    test.write_text("".join(line.split("\t", 1)[1] + "\n" for line in head))
    r = run("-m", "des.train", "--data", train, "--checkpoint", str(d / "ck"), *TRAIN)
    assert r.returncode == 0, r.stderr[-3000:]
    return d


def predict(ck, data, out, n=1, *extra):
    return run("-m", "des.predict", "--checkpoint", str(ck), "--data", str(data), "--out", str(out),
               "--threads", "1", *extra, n=n)


def test_predicts_test_txt_and_labelled_files_line_by_line(job, tmp_path):
    r = predict(job / "ck", job / "test.txt", tmp_path / "p_test.txt")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "format criteo-test" in r.stdout
    r = predict(job / "ck", job / "train.txt", tmp_path / "p_train.txt")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "AUC" in r.stdout and "format criteo" in r.stdout
    p_test, p_train = np.loadtxt(tmp_path / "p_test.txt"), np.loadtxt(tmp_path / "p_train.txt")
    assert p_test.shape == (300,) and p_train.shape == (2000,)
    assert np.all((p_test > 0) & (p_test < 1)) and p_test.std() > 0
    # 39 columns read as the 40 minus the label (batches differ: float32 summation order only)
    np.testing.assert_allclose(p_test, p_train[:300], rtol=1e-6)


RESTORE = """
import json, sys, numpy as np
import des, models
from des.runtime import checkpoint
from des.data import FeatureSpec
from des.data.readers import make_dataset
ck, test, out = sys.argv[1:4]
config = checkpoint.load_config(ck)
spec = FeatureSpec.from_json(json.dumps(config["spec"]))
model = models.build(config["model"], spec, seed=config["seed"], hidden=(128, 64))
untrained = [model(x, training=False).numpy().reshape(-1) for x, _ in make_dataset(test, "criteo-test", spec, 1000)]
checkpoint.restore(ck, model)
restored = [model(x, training=False).numpy().reshape(-1) for x, _ in make_dataset(test, "criteo-test", spec, 1000)]
np.save(out, np.stack([np.concatenate(untrained), np.concatenate(restored)]))
"""


def test_predictions_equal_the_restored_model(job, tmp_path):
    """des.predict's file equals what the checkpoint restored into a freshly built model (in a
    fresh process: TFRA keys tables by name) predicts, and differs from the untrained model."""
    r = predict(job / "ck", job / "test.txt", tmp_path / "p.txt", 1, "--batch", "100")
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp_path / "restore.py").write_text(RESTORE)
    r = run(str(tmp_path / "restore.py"), str(job / "ck"), str(job / "test.txt"), str(tmp_path / "m.npy"))
    assert r.returncode == 0, r.stderr[-3000:]
    untrained, restored = np.load(tmp_path / "m.npy")
    np.testing.assert_allclose(np.loadtxt(tmp_path / "p.txt"), restored, rtol=1e-6)
    assert np.abs(untrained - restored).max() > 1e-4


def test_bad_line_and_wrong_checkpoints_are_clear_errors(job, tmp_path):
    lines = (job / "test.txt").read_text().splitlines()
    bad = tmp_path / "bad.txt"
    bad.write_text("\n".join(lines[:5] + ["\t".join(["x"] + lines[5].split("\t")[1:])] + lines[6:]) + "\n")
    r = predict(job / "ck", bad, tmp_path / "p.txt")
    assert r.returncode == 2 and f"{bad}:6: column I1: 'x' is not an integer" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "p.txt").exists()

    r = predict(tmp_path / "nothing", job / "test.txt", tmp_path / "p.txt")
    assert r.returncode == 2 and "nothing: no such folder" in r.stderr, r.stderr[-2000:]

    ck = tmp_path / "ck_cut"
    subprocess.run(["cp", "-r", str(job / "ck"), str(ck)], check=True)
    shard = ck / "state" / "rank0-of-1.npz"
    shard.write_bytes(shard.read_bytes()[:1000])
    r = predict(ck, job / "test.txt", tmp_path / "p.txt")
    assert r.returncode == 2 and f"{shard}: truncated" in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "p.txt").exists()


@pytest.mark.mpi
def test_des_checkpoint_predicts_under_mpirun_like_the_single_process_model(job, tmp_path):
    """DES on 2 processes trains the same model: its checkpoint, read by 2 processes or by one,
    predicts what the single-process checkpoint predicts. (A checkpoint of another mode read by
    DES on 2 processes: tests/test_mpi.py, a PS checkpoint of 3.)"""
    r = run("-m", "des.train", "--mode", "des", "--data", str(job / "train.txt"),
            "--checkpoint", str(tmp_path / "ckd"), *TRAIN, n=2)
    assert r.returncode == 0, r.stderr[-3000:]
    r = predict(tmp_path / "ckd", job / "test.txt", tmp_path / "p_des.txt", 2)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "deepfm, des checkpoint of 2 process(es), read by 2 process(es)" in r.stdout
    r = predict(job / "ck", job / "test.txt", tmp_path / "p_single.txt")
    assert r.returncode == 0, r.stderr[-3000:]
    r = predict(tmp_path / "ckd", job / "test.txt", tmp_path / "p_des_on_1.txt")
    assert r.returncode == 0, r.stderr[-3000:]
    single_p = np.loadtxt(tmp_path / "p_single.txt")
    for other in ("p_des.txt", "p_des_on_1.txt"):
        p = np.loadtxt(tmp_path / other)
        diff = np.abs(p - single_p).max()
        assert p.shape == (300,)
        within("vs the single-process predictions", diff, 5e-7, case=other)      # measured 6.0e-8

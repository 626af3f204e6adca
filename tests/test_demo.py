"""`make demo`'s main job at a small size: examples/byom.py (a Keras DeepFM written by hand, the
one line ``des.transform``) on 1 process and under ``mpirun -np 2``, then scripts/demo_plot.py.

The demo is what a newcomer runs first; it once reported 0 DES bytes (it read an attribute the
compiler no longer sets) and its plot divided by zero. This test runs the same commands.
"""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_mpi_yield_when_idle="1", PYTHONPATH=ROOT)
BATCH, DIM, STEPS = 256, 4, 6


def run(cmd, timeout=600):
    done = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.mpi
def test_byom_on_one_and_on_two_processes_and_the_demo_table(tmp_path):
    data = str(tmp_path / "train.txt")
    run([sys.executable, "-m", "des.data.synth", "--preset", "criteo-like", "--rows", "3000", "--seed", "0",
         "--out", data])
    byom = ["examples/byom.py", "--model", "keras", "--data", data, "--steps", str(STEPS), "--batch", str(BATCH),
            "--dim", str(DIM), "--holdout", "1000", "--vocabulary", "1000"]
    run([sys.executable, *byom, "--summary-json", str(tmp_path / "single.json"), "--save", str(tmp_path / "s1")])
    run(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, *byom,
         "--summary-json", str(tmp_path / "des.json"), "--save", str(tmp_path / "s2")])
    # what both saved, read where des is not importable: the same model, the export predicting what it does
    check = ("import sys, numpy as np, tensorflow as tf\n"
             "sig = tf.saved_model.load(sys.argv[2] + '/served').signatures['serving_default']\n"
             "x = {k: tf.constant([[i * 7 % 1000], [3]], tf.int64) for i, k in enumerate(sig.structured_input_signature[1])}\n"
             "p = [tf.keras.models.load_model(d + '/model', compile=False).predict_on_batch(x) for d in sys.argv[1:]]\n"
             "s = list(sig(**x).values())[0].numpy()\n"
             "assert 'des' not in sys.modules\n"
             "print(float(np.abs(p[0] - p[1]).max()), float(np.abs(s.reshape(p[1].shape) - p[1]).max()))\n")
    done = subprocess.run([sys.executable, "-c", check, str(tmp_path / "s1"), str(tmp_path / "s2")], cwd="/",
                          env=dict(ENV, PYTHONPATH=""), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    saved_diff, served_diff = map(float, done.stdout.split())
    assert saved_diff < 1e-6 and served_diff <= 1e-6, done.stdout
    single, des = (json.load(open(tmp_path / f)) for f in ("single.json", "des.json"))
    assert (single["world_size"], des["world_size"]) == (1, 2)
    assert 0 < single["seconds_to_first_step"] < 600 and 0 < des["seconds_to_first_step"] < 600
    print(f"held-out AUC 1 process {single['auc']:.7f}, DES on 2 {des['auc']:.7f}; "
          f"log loss {single['logloss']:.7f} / {des['logloss']:.7f}")
    assert abs(single["auc"] - des["auc"]) < 1e-6 and abs(single["logloss"] - des["logloss"]) < 1e-6
    # DES's one allreduce per step: per sample the linear sum (1), FM's sum of embeddings (DIM)
    # and of their squares (1), and the first Dense layer's pre-activation (64): 4 bytes each
    assert des["des_bytes_handed_per_step"] == 4 * BATCH * (1 + DIM + 1 + 64)
    assert des["sent_bytes_per_step"] == des["des_bytes_handed_per_step"]      # ring on 2: 2 x 1/2 of it
    # the demo's table and plot, with the PS's bytes standing in from a summary of the same shape
    ps = dict(des, sent_bytes_per_step=3 * des["sent_bytes_per_step"])
    json.dump(ps, open(tmp_path / "ps.json", "w"))
    out = run([sys.executable, "scripts/demo_plot.py", str(tmp_path / "single.json"), str(tmp_path / "des.json"),
               str(tmp_path / "ps.json"), str(tmp_path / "demo.png"), str(tmp_path / "demo.md"), "test"]).stdout
    assert "DES sends 3.0x fewer bytes per step than the parameter server" in out
    table = open(tmp_path / "demo.md").read()
    assert os.path.getsize(tmp_path / "demo.png") > 0 and "| Keras DeepFM, DES on 2 (mpirun) |" in table
    assert "first step done (s after start)" in table
    # a summary without bytes (a run on 1 process, a broken counter) is an error, not a division by 0
    bad = subprocess.run([sys.executable, "scripts/demo_plot.py", str(tmp_path / "single.json"),
                          str(tmp_path / "single.json"), str(tmp_path / "ps.json"), str(tmp_path / "x.png")],
                         env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "single.json: no bytes per step were counted" in bad.stderr

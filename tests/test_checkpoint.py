"""Checkpoints: one layout for every mode and N, restore anywhere, slots row by row, bad input,
export for serving. (The PS side and the CLI's exact resume under mpirun: tests/test_mpi.py.)"""
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import tensorflow as tf

import des
import models
from des.runtime import checkpoint
from des.runtime import export
from des.runtime.callbacks import PeriodicCheckpoint
from des.runtime.state import export_rows
from des.jobs.verify import random_batches, run_in_process_world, small_spec

SPEC = small_spec(5, dim=4)
BATCHES = random_batches(SPEC, 6, 32, seed=11)
PROBE = random_batches(SPEC, 1, 64, seed=99)[0][0]   # also holds keys no step trained


def build(name):
    return lambda: models.build(name, SPEC, seed=1, hidden=(8,))


def optimizer():
    return models.make_optimizer("adagrad", 0.05, linear="ftrl", linear_learning_rate=0.05)


def config(name):
    return {"model": name, "spec": json.loads(SPEC.to_json()), "hidden": "8", "seed": 1, "dim": 4,
            "format": "libffm", "optimizer": "adagrad", "linear_optimizer": "ftrl"}


def rows_by_key(ranks: list[dict]) -> dict:
    """Union over ranks of export_rows: {(kind, key): {id or None: {"value": .., "slot:x": ..}}}."""
    out = {}
    for entries in ranks:
        for piece, e in entries.items():
            got = out.setdefault(piece, {})
            if "keys" in e:
                for i, k in enumerate(e["keys"].tolist()):
                    assert k not in got, f"{piece} key {k} held twice"
                    got[k] = {n: v[i] for n, v in e.items() if n != "keys" and not n.startswith("has:")}
            else:
                got[None] = {n: v for n, v in e.items()}
    return out


def assert_same_rows(ref: dict, got: dict, tol: float = 1e-6) -> int:
    assert set(ref) == set(got), set(ref) ^ set(got)
    compared = 0
    for piece in ref:
        assert set(ref[piece]) == set(got[piece]), piece
        for k, named in ref[piece].items():
            assert set(named) == set(got[piece][k]), (piece, k)
            for n, v in named.items():
                np.testing.assert_allclose(got[piece][k][n], v, atol=tol, rtol=tol, err_msg=f"{piece} {k} {n}")
                compared += 1
    return compared


def barrier(comm):
    return lambda: comm.allreduce(tf.zeros([1]))


@pytest.mark.parametrize("name", ["fm", "wdl", "deepfm"])
def test_restore_matrix_single_des3_single_des2_with_slots_row_by_row(tmp_path, name):
    """single (3 steps) -> DES on 3 -> single, and DES 3 -> DES 2: predictions at once equal the
    model that wrote the checkpoint; every table row with its FTRL/Adagrad slots, every kernel
    block and replicated weight equal; two more steps equal the uninterrupted single model."""
    ref = build(name)()
    opt = optimizer()
    ref.compile(opt, "binary_crossentropy")
    for x, y in BATCHES[:3]:
        ref.train_on_batch(x, y)
    ck1, ck3 = str(tmp_path / "single"), str(tmp_path / "des3")
    checkpoint.save(ck1, ref, opt, config=config(name), position={"epoch": 0, "step": 3})
    at3 = np.asarray(ref.predict_on_batch(PROBE))
    rows3 = rows_by_key([export_rows(ref, opt)])
    for x, y in BATCHES[3:5]:
        ref.train_on_batch(x, y)
    at5 = np.asarray(ref.predict_on_batch(PROBE))

    def from_single(m):
        o = optimizer()
        m.compile(o, "binary_crossentropy")
        checkpoint.restore(ck1, m, o, des.distributed(m).layer.comm.rank, 3)
        p = np.asarray(m.predict_on_batch(PROBE))
        checkpoint.save(ck3, m, o, des.distributed(m).plan, des.distributed(m).layer.comm.rank, 3, config=config(name),
                        barrier=barrier(des.distributed(m).layer.comm))
        rows = export_rows(m, o)
        for x, y in BATCHES[3:5]:
            m.train_on_batch(x, y)
        return p, rows, np.asarray(m.predict_on_batch(PROBE))
    des3 = run_in_process_world(3, build(name), from_single)
    assert sorted(os.listdir(os.path.join(ck3, "state"))) == ["config.json"] + [f"rank{r}-of-3.npz" for r in range(3)]
    for p, _, p5 in des3:
        assert np.abs(p - at3).max() <= 1e-6 and np.abs(p5 - at5).max() <= 1e-5
    n = assert_same_rows(rows3, rows_by_key([r for _, r, _ in des3]))
    assert n > 200

    back = build(name)()
    o = optimizer()
    back.compile(o, "binary_crossentropy")
    checkpoint.restore(ck3, back, o)
    assert np.abs(np.asarray(back.predict_on_batch(PROBE)) - at3).max() <= 1e-6
    assert_same_rows(rows3, rows_by_key([export_rows(back, o)]))
    assert int(o.linear.iterations) == int(o.rest.iterations) == 3

    def from_des3(m):
        o = optimizer()
        m.compile(o, "binary_crossentropy")
        checkpoint.restore(ck3, m, o, des.distributed(m).layer.comm.rank, 2)
        return np.asarray(m.predict_on_batch(PROBE)), export_rows(m, o)
    des2 = run_in_process_world(2, build(name), from_des3)
    assert max(np.abs(p - at3).max() for p, _ in des2) <= 1e-6
    assert_same_rows(rows3, rows_by_key([r for _, r in des2]))


def saved_single(tmp_path, name="fm"):
    m = build(name)()
    o = optimizer()
    m.compile(o, "binary_crossentropy")
    for x, y in BATCHES[:2]:
        m.train_on_batch(x, y)
    ck = str(tmp_path / "ck")
    checkpoint.save(ck, m, o, config=config(name))
    return m, o, ck


def test_bad_checkpoints_are_one_line_errors_and_a_crash_mid_save_keeps_the_last(tmp_path):
    m, o, ck = saved_single(tmp_path)
    expected = np.asarray(m.predict_on_batch(PROBE))
    state = os.path.join(ck, "state")
    # another model or spec: named settings
    with pytest.raises(checkpoint.CheckpointError, match=r"--model fm \(this run: deepfm\)"):
        checkpoint.check_config(ck, dict(config("fm"), model="deepfm"))
    with pytest.raises(checkpoint.CheckpointError, match="another feature spec"):
        checkpoint.check_config(ck, dict(config("fm"), spec={"fields": []}))
    # rows of another model: nothing of it fits
    other = models.build("dnn", SPEC, seed=1, hidden=(8,))
    with pytest.raises(checkpoint.CheckpointError, match="it was written by another model"):
        checkpoint.restore(ck, other)
    # a crash between the two renames of a save: state.old is read
    os.rename(state, state + ".old")
    fresh = build("fm")()
    assert checkpoint.restore(ck, fresh).endswith("state.old")
    assert np.abs(np.asarray(fresh.predict_on_batch(PROBE)) - expected).max() == 0
    os.rename(state + ".old", state)
    # a crash while writing: .incoming is half written, state untouched
    os.makedirs(os.path.join(ck, ".incoming"))
    open(os.path.join(ck, ".incoming", "rank0-of-1.npz"), "wb").write(b"PK\x03\x04")
    assert checkpoint.restore(ck, build("fm")()).endswith("state")
    # truncated and missing shards
    shard = os.path.join(state, "rank0-of-1.npz")
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) // 2])
    with pytest.raises(checkpoint.CheckpointError, match=r"rank0-of-1.npz: truncated"):
        checkpoint.restore(ck, build("fm")())
    os.remove(shard)
    with pytest.raises(checkpoint.CheckpointError, match=r"rank0-of-1.npz: missing"):
        checkpoint.restore(ck, build("fm")())
    with pytest.raises(checkpoint.CheckpointError, match="no such folder"):
        checkpoint.restore(str(tmp_path / "nothing"), build("fm")())


def test_periodic_checkpoint_positions():
    """Saves every K steps over epochs, and at each epoch's end as the next epoch's start; never
    at a position past an epoch's last batch."""
    saved = []
    cb = PeriodicCheckpoint(saved.append, steps=3)
    for epoch, steps in ((0, 5), (1, 4)):
        cb.on_epoch_begin(epoch)
        for b in range(steps):
            cb.on_train_batch_begin(b)
            cb.on_train_batch_end(b)
        cb.on_epoch_end(epoch)
    assert saved == [{"epoch": 0, "step": 3}, {"epoch": 1, "step": 0}, {"epoch": 1, "step": 1},
                     {"epoch": 2, "step": 0}]
    resumed = []
    cb = PeriodicCheckpoint(resumed.append, steps=2, epoch=1, step=1)   # resumed at epoch 1, step 1
    cb.on_epoch_begin(1)
    for b in range(3):
        cb.on_train_batch_begin(b)
        cb.on_train_batch_end(b)
    cb.on_epoch_end(1)
    assert resumed == [{"epoch": 1, "step": 3}, {"epoch": 2, "step": 0}]


def test_periodic_checkpoint_by_time_saves_at_the_same_step_on_every_process():
    """--checkpoint-every 10s on two processes (threads, whose sum_across is a real two-party
    allreduce that fails if one calls it alone) with clocks that disagree: they call the sum at the
    same steps (rank 0's step time sets the gap), save at the same steps (at the first call after
    either clock passed 10 s) and call it about ten times per interval, not every step."""
    meet = threading.Barrier(2, timeout=10)
    values: list = [None, None]
    calls: list = [[], []]
    saved: list = [[], []]

    def run(rank, per_step):
        t = [0.0]

        def sum_across(mine):
            calls[rank].append(cb.total)
            values[rank] = mine
            meet.wait()
            out = [a + b for a, b in zip(*values)]
            meet.wait()
            return out
        cb = PeriodicCheckpoint(saved[rank].append, seconds=10.0, sum_across=sum_across, rank=rank,
                                clock=lambda: t[0])
        cb.on_epoch_begin(0)
        for b in range(100):
            cb.on_train_batch_begin(b)
            t[0] += per_step
            cb.on_train_batch_end(b)
    threads = [threading.Thread(target=run, args=(r, s)) for r, s in ((0, 0.5), (1, 0.6))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert calls[0] == calls[1] and saved[0] == saved[1], (calls, saved)
    steps = [p["step"] for p in saved[0]]
    # the clocks start after step 1; the sum is called after steps 2, 4, 6, ... (rank 0: 10 s / 10 calls /
    # 0.5 s = 2 steps apart); rank 1's clock (0.6 s steps, from 0.6 s) passes 10 s after step 18 (10.8 s), then
    # 10 s after that save (at 10.8 s) after step 35 (21.0 s), seen at 36; rank 0's would come later (38)
    assert steps == [18, 36, 54, 72, 90], steps
    assert len(calls[0]) == 50, calls[0]


def test_periodic_checkpoint_by_time_calls_its_sum_at_a_gap_set_by_rank_0():
    t = [0.0]
    calls = []

    def sum_across(values):
        calls.append(values)
        return values
    saved: list = []
    cb = PeriodicCheckpoint(saved.append, seconds=10.0, sum_across=sum_across, clock=lambda: t[0])
    cb.on_epoch_begin(0)
    for b in range(45):
        cb.on_train_batch_begin(b)
        t[0] += 0.5
        cb.on_train_batch_end(b)
    assert [c[1] for c in calls[:3]] == [2.0, 2.0, 2.0]       # 10 s / 10 probes / 0.5 s a step
    # the clock starts at 0.5 s, after step 1; called after steps 2, 4, ..., 44; 10 s pass after step 21 (seen
    # at 22), then 10 s after the save at 11 s, after step 42
    assert len(calls) == 22 and [s["step"] for s in saved] == [22, 42], (len(calls), saved)


SERVE = """
import sys, numpy as np, tensorflow as tf
inputs = dict(np.load(sys.argv[1]))
serve = tf.saved_model.load(sys.argv[2]).signatures["serving_default"]
np.save(sys.argv[3], serve(**{k: tf.constant(v) for k, v in inputs.items()})["probability"].numpy())
print(sorted(m for m in sys.modules if m.split(".")[0] in ("des", "models", "tensorflow_recommenders_addons")))
"""


def test_export_serves_the_checkpoints_predictions_without_des_or_tfra(tmp_path):
    """des.export of a checkpoint, loaded with tf.saved_model.load in a process that imports
    neither des nor TFRA, predicts what the checkpoint's model predicts (keys the checkpoint
    never saw included); an existing --out is not overwritten."""
    spec = small_spec(4, dim=3)
    from des.jobs.verify import PS_SPEC
    for name, spec in (("deepfm", spec), ("wdl", PS_SPEC)):     # PS_SPEC: multi-valued, weighted fields
        m = models.build(name, spec, seed=1, hidden=(8,))
        o = models.make_optimizer("adam", 0.01)
        m.compile(o, "binary_crossentropy")
        for x, y in random_batches(spec, 3, 32, seed=2):
            m.train_on_batch(x, y)
        ck, out = str(tmp_path / f"ck_{name}"), str(tmp_path / f"served_{name}")
        checkpoint.save(ck, m, o, config=dict(config(name), spec=json.loads(spec.to_json()), dim=3))
        info = export.export(ck, out)
        assert info["rows"] > 0 and info["bytes"] > 0
        probe = random_batches(spec, 1, 64, seed=98)[0][0]
        np.savez(tmp_path / "in.npz", **{k: v.numpy() for k, v in probe.items()})
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH="")
        (tmp_path / "serve.py").write_text(SERVE)
        r = subprocess.run([sys.executable, str(tmp_path / "serve.py"), str(tmp_path / "in.npz"), out,
                            str(tmp_path / "p.npy")], env=env, cwd="/", capture_output=True, text=True)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.strip().splitlines()[-1] == "[]"           # des, models, TFRA: none imported
        served = np.load(tmp_path / "p.npy")
        expected = np.asarray(m.predict_on_batch(probe)).reshape(-1)
        assert served.shape == expected.shape and np.abs(served - expected).max() <= 1e-6
        before = sorted(os.listdir(out))
        with pytest.raises(ValueError, match="exists and is not empty; nothing was written"):
            export.export(ck, out)
        assert sorted(os.listdir(out)) == before
        shutil.rmtree(ck)


def test_checkpoint_every_takes_steps_or_a_time_and_refuses_the_rest(capsys):
    from des.jobs.config import Every, RunConfig
    assert [Every.parse(t) for t in ("500", "90s", "10min", "10m", "1.5h")] == [
        Every(steps=500), Every(seconds=90.0), Every(seconds=600.0), Every(seconds=600.0), Every(seconds=5400.0)]
    config = RunConfig.parse(["--data", "x", "--checkpoint", "c", "--checkpoint-every", "10min"])
    assert config.checkpoint_every == Every(seconds=600.0) and RunConfig.parse(config.to_argv()) == config
    for bad in ("1.5", "10x", "-3", "min"):
        with pytest.raises(SystemExit):
            RunConfig.parse(["--data", "x", "--checkpoint", "c", "--checkpoint-every", bad])
        assert (f"argument --checkpoint-every: '{bad}': a whole number of steps (500) or a time (90s, 10min, 2h)"
                in capsys.readouterr().err)

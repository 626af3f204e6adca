"""Getting a user's model out of a real mpirun job (scripts/mpi_saving.py): ``model.save`` and
``model.save_weights`` on every process write the untouched architecture, a DES checkpoint of
step 15 written by 2 processes resumes exactly on 5 (more processes than fields: one owns
nothing), and ``des.export`` serves it where neither des nor TFRA is imported. Every optimizer
Keras 2.15 ships, new and legacy, on a hand-written Keras DeepFM; DeepCTR's DeepFM with Adam; a
TFRA DeepFM with DynamicEmbeddingOptimizer around Adam, legacy Adagrad and RMSprop. (TFRA 0.7.2
cannot create slots of the Keras 2.11+ Adagrad and Ftrl for its tables: an untouched TFRA model
fails with them too.)"""
import os
import pickle
import re
import subprocess
import sys

import numpy as np
import pytest

from helpers import ROOT, mpirun

sys.path.insert(0, os.path.join(ROOT, "tests"))
from gallery import OPTIMIZERS  # noqa: E402

# every case checkpoints at step 15 and resumes on 5 processes (the optimizer's slots travel);
# one case per model (":saves") also writes every saved form, which holds weights, not slots
CASES = ([f"keras_deepfm:{o}" + (":saves" if o == "adam" else "") for o in OPTIMIZERS] + ["deepctr_deepfm:adam:saves"] +
         [f"tfra_deepfm:{o}" for o in ("adam:saves", "legacy_adagrad", "rmsprop")])
# A model written by Keras after 30 steps, read back elsewhere, predicts what one process's model
# predicts; float32 summation order is all that differs (measured: 6e-8).
TOL = 2e-6


def _reference(name: str, opt: str, initial) -> np.ndarray:
    """The untouched model on one process from rank 0's initial weights, 30 steps like the job."""
    import des
    from gallery import BUILDERS, batches_for, optimizer_for
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    from mpi_saving import BATCH, STEPS
    model = BUILDERS[name]()
    model.set_weights(initial)
    des.make_keyed(model, seed=0)
    model.compile(optimizer_for(model, opt), "binary_crossentropy")
    for x, y in batches_for(model, STEPS, BATCH, seed=4):
        model.train_on_batch(x, y)
    return np.asarray(model.predict_on_batch(batches_for(model, 1, 16, seed=99)[0][0]))


LOAD = """
import pickle, sys
import numpy as np
{imports}
import tensorflow as tf
out = {{}}
for path, probe_file, how in pickle.load(open(sys.argv[1], "rb")):
    probe = pickle.load(open(probe_file, "rb"))["probe"]
    if how == "serve":
        sig = tf.saved_model.load(path).signatures["serving_default"]
        got = sig(**{{k: tf.constant(probe[k]) for k in sig.structured_input_signature[1]}})
        out[path] = np.asarray(list(got.values())[0])
    else:                     # DeepCTR's own layers: its custom_objects, as for the untouched model
        custom = __import__("deepctr.layers").layers.custom_objects if "deepctr" in path else None
        out[path] = np.asarray(tf.keras.models.load_model(path, custom_objects=custom,
                                                          compile=False).predict_on_batch(probe))
print("imported des or TFRA:", sorted({{m.split(".")[0] for m in sys.modules}} & {{"des", "des_ops", "tensorflow_recommenders_addons"}}))
pickle.dump(out, open(sys.argv[2], "wb"))
"""


def _load_elsewhere(tmp_path, jobs: list, tfra: bool) -> tuple[dict, str]:
    """Load each (path, pickle holding the probe, "keras" or "serve") in a fresh Python that has
    not imported des (nor TFRA unless ``tfra``: TFRA's own SavedModels need its ops)."""
    todo, got = tmp_path / f"jobs{tfra}.pkl", tmp_path / f"got{tfra}.pkl"
    pickle.dump(jobs, open(todo, "wb"))
    code = LOAD.format(imports="import tensorflow_recommenders_addons" if tfra else "")
    run = subprocess.run([sys.executable, "-c", code, str(todo), str(got)], capture_output=True, text=True, cwd="/",
                         env=dict(os.environ, PYTHONPATH="", TF_CPP_MIN_LOG_LEVEL="3"), timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return pickle.load(open(got, "rb")), run.stdout


@pytest.mark.mpi
def test_users_models_saved_resumed_and_served_from_mpirun(tmp_path):
    """2 processes train 30 steps (a checkpoint at step 15) and save every way; 5 processes resume
    the checkpoint of step 15 and save again. Everything read back equals the untouched model
    trained on one process."""
    out = str(tmp_path)
    run = mpirun(2, "scripts/mpi_saving.py", "train", out, *CASES, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    run = mpirun(5, "scripts/mpi_saving.py", "resume", out, *CASES, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]

    keras_jobs, tfra_jobs, served_jobs, refs, trained = [], [], [], {}, {}
    for case in CASES:
        name, opt, *saves = case.split(":")
        base = os.path.join(out, f"{name}-{opt}")
        job = pickle.load(open(f"{base}.train2.pkl", "rb"))
        refs[base], trained[base] = _reference(name, opt, job["initial"]), job["predictions"]
        resumed = pickle.load(open(f"{base}.resume5.pkl", "rb"))["predictions"]
        diff = {"des2": np.abs(job["predictions"] - refs[base]).max(), "des2->5": np.abs(resumed - refs[base]).max()}
        print(case, diff)
        assert max(diff.values()) < TOL, (case, diff)
        assert os.path.exists(f"{base}.savedmodel") == bool(saves), case
        if not saves:
            continue
        saved = [f"{base}.savedmodel", f"{base}.resumed5.savedmodel"] + ([] if name.startswith("tfra") else
                                                                          [f"{base}.keras"])
        (tfra_jobs if name.startswith("tfra") else keras_jobs).extend((p, f"{base}.train2.pkl", "keras")
                                                                      for p in saved)
        served_jobs.append((f"{base}.served", f"{base}.train2.pkl", "serve"))

    for jobs, tfra in ((keras_jobs + served_jobs, False), (tfra_jobs, True)):
        got, said = _load_elsewhere(tmp_path, jobs, tfra)
        assert "imported des or TFRA: []" in said if not tfra else "'des'" not in said, said
        for path, probe_file, how in jobs:
            base = probe_file[:-len(".train2.pkl")]
            ref = refs[base]
            if how == "serve":        # the export serves what the DES model predicts
                assert np.abs(got[path].reshape(ref.shape) - trained[base]).max() <= 1e-6, path
            assert np.abs(got[path].reshape(ref.shape) - ref).max() < TOL, (path, np.abs(got[path] - ref).max())

    # save_weights: the untouched model's weights, loaded into a fresh build of it
    import des  # noqa: F401 - builds the gallery models with this process's TensorFlow set-up
    from gallery import BUILDERS, batches_for
    for case in CASES:
        name, opt, *saves = case.split(":")
        if name.startswith("tfra") or not saves:
            continue                  # h5 holds no TFRA table; its SavedModel is checked above
        base = os.path.join(out, f"{name}-{opt}")
        fresh = BUILDERS[name]()
        fresh.load_weights(f"{base}.weights.h5")
        got = np.asarray(fresh.predict_on_batch(batches_for(fresh, 1, 16, seed=99)[0][0]))
        assert np.abs(got - refs[base]).max() < TOL, case


@pytest.mark.mpi
def test_a_save_on_rank_0_alone_ends_the_job_and_writes_nothing(tmp_path):
    """Horovod's habit (save on rank 0 only) with a DES model: rank 0's save waits for rows the
    others never send; Horovod's stall shutdown (here 10 s) ends the job naming the missing rank
    (its eager all-gather shows as HorovodAllgather; the error names it: des_save_agree_sizes).
    No partial model is written."""
    run = mpirun(2, "scripts/mpi_saving.py", "rank0", str(tmp_path), "keras_deepfm:adam", timeout=600,
                 env={"HOROVOD_STALL_CHECK_TIME_SECONDS": "5", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "10"})
    out = run.stdout + run.stderr
    assert run.returncode != 0 and re.search(r"Missing ranks:\s+1: \[HorovodAllgather\]", out), out[-3000:]
    assert "name: des_save_agree_sizes" in out, out[-3000:]
    assert not os.path.exists(os.path.join(tmp_path, "keras_deepfm-adam.rank0only"))

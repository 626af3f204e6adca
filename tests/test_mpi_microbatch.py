"""Micro-batches and 16-bit partials under a real mpirun (Horovod): 5 processes on 4 fields, one of
which owns none. The simulated-world sweep: tests/test_microbatch.py."""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import models
from des.jobs.verify import PS_SPEC, compare, random_batches, train_and_snapshot
from helpers import within

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)


@pytest.mark.mpi
def test_micro_batches_and_float16_under_mpirun(tmp_path):
    """K = 3 slices (32 rows: 10, 11, 11) equal the untouched single-process model within float32
    order on every rank, the idle rank included; a 2-row batch (one empty slice) predicts the
    same; float16 on the wire moves half the bytes and stays within float16 rounding."""
    n = 5
    cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", sys.executable,
           "scripts/mpi_microbatch.py", str(tmp_path)]
    run = subprocess.run(cmd, env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [pickle.load(open(tmp_path / f"rank{r}.pkl", "rb")) for r in range(n)]
    assert [r["k3"]["owns_fields"] for r in ranks].count(False) == 1          # one process owns no field
    batches, probe = random_batches(PS_SPEC, 10, 32, seed=4), random_batches(PS_SPEC, 1, 16, seed=99)[0][0]
    plain = models.build("deepfm", PS_SPEC, seed=3, hidden=(8, 4))
    ref = train_and_snapshot(plain, "adam", 0.01, batches, probe)
    two_rows = plain.predict_on_batch({k: v[:2] for k, v in probe.items()})
    diff = compare(ref, [r["k3"] for r in ranks])
    print(f"mpirun -np {n} deepfm micro_batches=3: {diff}")
    within("micro_batches=3: max diff", max(diff.values()), 1e-6)           # measured 1.5e-7
    floats = 1 + (3 + 1) + 8      # by hand (PS_SPEC: dim 3; hidden 8,4): linear sum, FM's S and Q, first Dense
    for r in ranks:
        assert np.array_equal(r["k3"]["predictions"], ranks[0]["k3"]["predictions"])     # replicas agree bitwise
        assert np.abs(r["k3"]["two_rows"] - two_rows).max() < 2e-6
        assert r["k3"]["step"] == {"calls": 3 * 20, "bytes": 4 * floats * (10 * 32 + 10 * 16)}
        assert r["fp16"]["step"] == {"calls": 20, "bytes": 2 * floats * (10 * 32 + 10 * 16)}
        assert r["fp16"]["collective"].endswith("__wirefloat16")
        assert np.array_equal(r["fp16"]["predictions"], ranks[0]["fp16"]["predictions"])
    gap = np.abs(ranks[0]["fp16"]["predictions"] - ref["predictions"]).max()
    within("float16 wire vs the exact model: predictions", gap, 6e-4, floor=1e-6)   # measured 6.6e-5

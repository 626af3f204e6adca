"""Micro-batches and 16-bit partials (des.transform(micro_batches=K, wire_dtype=...)) in the
simulated world: K slices of the batch, each with its own allreduce, compute what the untouched
model computes; float16 on the wire halves the bytes and is close, not exact; float32 (the
default) builds exactly today's collective. Under a real mpirun: tests/test_mpi_microbatch.py."""
import numpy as np
import pytest
import tensorflow as tf

import des
import models
from des.jobs.verify import compare, fit_and_snapshot, run_in_process_world, train_and_snapshot
from des_ops.comm import InProcessWorld
from gallery import BUILDERS, batches_for
from helpers import random_batches, small_spec, within

TOL = 2e-6        # float32 summation order (test_equivalence_sim's bound)
SPEC = small_spec(4, dim=3)
BATCHES = random_batches(SPEC, 12, 32, seed=4)
PROBE = random_batches(SPEC, 1, 16, seed=99)[0][0]


def build(name):
    return lambda: models.build(name, SPEC, seed=3, hidden=(8, 4))


def _with_collectives(m, work):
    comm = des.distributed(m).comm
    out = work(m)
    return {**out, "collective": des.distributed(m).layer.collective, "step": comm.counted()["step"]}


@pytest.mark.parametrize("name, n", [("deepfm", 3), ("wdl", 5)])
def test_three_slices_of_32_rows_equal_the_untouched_model(name, n):
    """K = 3 does not divide B = 32 (slices of 10, 11, 11 rows); N = 5 > 4 fields: one process owns
    nothing and still joins every slice's allreduce."""
    work = lambda m: train_and_snapshot(m, "adam", 0.01, BATCHES, PROBE)  # noqa: E731
    ref = work(build(name)())
    ranks = run_in_process_world(n, build(name), lambda m: _with_collectives(m, work), micro_batches=3)
    diff = compare(ref, ranks)
    print(f"{name} N={n} micro_batches=3: {diff}")
    assert max(diff.values()) < TOL, diff
    floats = {"deepfm": 1 + (3 + 1) + 8, "wdl": 1 + 8}[name]            # LR + FM (S, Q) + first Dense
    names = {"deepfm": "des_partials__linearsum1__fm4__denseblock8", "wdl": "des_partials__linearsum1__denseblock8"}
    for r in ranks:
        assert r["collective"] == names[name]          # the slices' collectives are this name + _mb<k>of3
        # 12 training steps + 12 predictions, 3 allreduces each; every row handed over once in float32
        assert r["step"] == {"calls": 24 * 3, "bytes": 24 * 4 * 32 * floats - 12 * 4 * 16 * floats}


def test_more_slices_than_rows_and_weight_penalties():
    """B = 2 rows in K = 3 slices (one is empty); a model with L2/L1 penalties on tables and the
    first Dense (the penalty share rides in the last slice): equal to the untouched model, loss included."""
    b = BUILDERS["regularized"]
    tf.keras.utils.set_random_seed(7)
    base = b()
    batches, probe = batches_for(base, 4, 2, seed=1), batches_for(base, 1, 4, seed=2)[0][0]
    ref = fit_and_snapshot(base, batches, probe, optimizer="sgd", learning_rate=0.1)
    tf.keras.utils.set_random_seed(7)
    ranks = run_in_process_world(2, b, lambda m: fit_and_snapshot(m, batches, probe, optimizer="sgd",
                                                                 learning_rate=0.1), micro_batches=3)
    diff = compare(ref, ranks)
    assert max(diff.values()) < TOL, diff
    assert all(abs(r["loss"] - ref["loss"]) < 1e-6 * max(1.0, abs(ref["loss"])) for r in ranks), \
        ([r["loss"] for r in ranks], ref["loss"])


def test_float16_partials_halve_the_bytes_and_stay_close():
    """float16 on the wire: the step's bytes are exactly half the float32 run's (2 bytes a float);
    after 12 steps the predictions differ from the exact run by more than float32 rounding but
    stay within a few float16 roundings (relative 2^-11 per partial, a few partials per output):
    measured 4.5e-5, held to 4e-4 (reports/tolerances.md)."""
    work = lambda m: train_and_snapshot(m, "adam", 0.01, BATCHES, PROBE)  # noqa: E731
    ref = work(build("deepfm")())
    exact = run_in_process_world(2, build("deepfm"), lambda m: _with_collectives(m, work))
    half = run_in_process_world(2, build("deepfm"), lambda m: _with_collectives(m, work), wire_dtype="float16")
    assert max(compare(ref, exact).values()) < TOL                       # the default is exact
    assert exact[0]["collective"] == "des_partials__linearsum1__fm4__denseblock8"       # and today's collective
    assert half[0]["collective"] == "des_partials__linearsum1__fm4__denseblock8__wirefloat16"
    floats, steps = 13, 24
    assert exact[0]["step"]["bytes"] == 4 * floats * (12 * 32 + 12 * 16)
    assert half[0]["step"]["bytes"] == 2 * floats * (12 * 32 + 12 * 16) == exact[0]["step"]["bytes"] // 2
    assert half[0]["step"]["calls"] == exact[0]["step"]["calls"] == steps
    gap = np.abs(half[0]["predictions"] - ref["predictions"]).max()
    within("float16 wire vs the exact model: predictions", gap, 4e-4, floor=1e-5)
    assert np.array_equal(half[0]["predictions"], half[1]["predictions"])    # every process the same


@pytest.mark.parametrize("kwargs, message", [
    ({"micro_batches": 0}, "micro_batches=0; a whole number >= 1"),
    ({"micro_batches": 2.5}, "micro_batches=2.5; a whole number >= 1"),
    ({"wire_dtype": "bfloat16"}, "wire_dtype='bfloat16'; choose from float32, float16"),
    ({"micro_batches": 2, "tail": "data_parallel"}, "micro_batches and a 16-bit wire_dtype are for the replicated"),
])
def test_bad_options_are_one_line_errors(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        des.transform(build("deepfm")(), des.Options(**kwargs), comm=InProcessWorld(1).communicator(0))


def test_the_report_says_what_was_asked():
    _, report = des.transform(build("deepfm")(), des.Options(micro_batches=4, wire_dtype="float16"), comm=InProcessWorld(1).communicator(0))
    text = str(report)
    assert "in 4 slices of the batch, one allreduce each" in text
    assert "partials on the wire in float16" in text and "NOT exact" in text
    assert report.payload_bytes(4096) == 2 * 4096 * 13                    # 2 bytes a float, 13 a sample


def test_a_communicator_that_cannot_sum_float16_refuses_it():
    """mpi4py's Allreduce has no float16 (Open MPI 4.1: MPI_ERR_TYPE): a communicator says which
    types it sums, and transform refuses the others in one line."""
    comm = InProcessWorld(1).communicator(0)
    comm.wire_dtypes, comm.name = ("float32",), "mpi4py"
    with pytest.raises(ValueError, match="wire_dtype='float16': the mpi4py communicator sums float32 only"):
        des.transform(build("deepfm")(), des.Options(wire_dtype="float16"), comm=comm)


def test_ps_float16_rows_halve_the_row_bytes_and_stay_close():
    """--mode ps --wire-dtype float16: rows and gradient rows travel in 16 bits (half their bytes,
    the ids' bytes unchanged), each step's counts equal the formula at 2 bytes a float, and the
    model stays close to the float32 PS (which is the single process's), not equal to it. N = 3:
    the batch of 2 rows leaves one process an empty slice."""
    from helpers import train_ps_counting

    from des.baselines.ps.tables import KeyExchange
    from des.jobs.verify import ps_batches, run_sharded_world
    batches, probe = ps_batches(steps=4)

    def work(ex):
        preds, _, steps = train_ps_counting(ex, batches, probe, bytes_per_float=ex.wire_dtype.size)
        return np.stack(preds), steps

    runs = {wire: run_sharded_world(3, work, wire) for wire in ("float32", "float16")}   # 3: an empty slice
    for (p32, s32), (p16, s16) in zip(runs["float32"], runs["float16"]):
        assert all(m == a for step in s16 for m, a in step.values()), s16          # the formula at 2 bytes
        for a, b in zip(s32, s16):                                                  # the same ids, half the rows
            assert b["ids_bytes"][0] == a["ids_bytes"][0]
            assert 2 * b["rows_bytes"][0] == a["rows_bytes"][0] and 2 * b["grad_bytes"][0] == a["grad_bytes"][0]
        assert sum(step["rows_bytes"][0] for step in s16) > 0
        diff = float(np.abs(p16 - p32).max())
        within("PS float16 rows vs float32: predictions", diff, 1.5e-4, floor=0)     # measured 1.8e-5
    with pytest.raises(ValueError, match="wire_dtype='bfloat16': one of float32, float16"):
        KeyExchange(wire_dtype="bfloat16")

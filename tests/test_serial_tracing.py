"""The in-process world's ranks build graphs one at a time (des_ops.serial_tracing), and that
never hangs them: a rank waiting in a collective lets the others trace."""
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from des.jobs.verify import _on_every_rank
from des_ops.comm import InProcessWorld
from des_ops.serial_tracing import TraceToken


def test_ranks_trace_one_at_a_time_and_run_at_once():
    world = InProcessWorld(3, timeout=60)
    lock = threading.Lock()
    inside: list[int] = []
    most = [0]
    log: list[tuple[int, str]] = []

    def traced_body(r):
        with lock:
            inside.append(r)
            most[0] = max(most[0], len(inside))
            log.append((r, "in"))
        time.sleep(0.2)                  # a slow trace: the others would start theirs meanwhile
        with lock:
            inside.remove(r)
            log.append((r, "out"))

    def work(r):
        comm = world.communicator(r)

        @tf.function
        def step(x):
            traced_body(r)
            return comm.allreduce(x, name="sum")   # every rank's graph meets the others' when it runs
        return float(step(tf.constant([float(r + 1)]))[0])

    assert _on_every_rank(world, work) == [6.0, 6.0, 6.0]
    assert most[0] == 1, log                               # never two traces at once
    assert sorted(r for r, what in log if what == "in") == [0, 1, 2]


def test_a_trace_that_meets_the_others_eagerly_lets_them_trace():
    # Each rank's trace calls a collective at trace time (inside init_scope, as a variable's first
    # value might). Holding the token through that wait would leave the others unable to trace
    # to the same collective: the world's timeout (20 s) would end it with a TimeoutError.
    world = InProcessWorld(3, timeout=20)

    def work(r):
        @tf.function
        def step(x):
            with tf.init_scope():
                total = world.allreduce(r, np.array([r + 1.0], np.float32), name="at_trace")
            return x + total
        t0 = time.monotonic()
        out = float(step(tf.constant([0.0]))[0])
        return out, time.monotonic() - t0

    outs = _on_every_rank(world, work)
    assert [o for o, _ in outs] == [6.0, 6.0, 6.0]
    assert max(s for _, s in outs) < 15, outs


def test_waiting_for_the_token_ends_naming_the_rank_that_holds_it():
    token = TraceToken(timeout=0.3)
    got = []
    with token.held(2):
        t = threading.Thread(target=lambda: got.append(pytest.raises(TimeoutError, token._acquire, 0)))
        t.start()
        t.join()
    assert "rank 0: waited 0 s to trace while rank 2 traced" in str(got[0].value)
    assert token.owner is None


def test_a_failed_rank_wakes_the_ranks_waiting_to_trace():
    token = TraceToken(timeout=30)
    errors = []

    def wait():
        try:
            token._acquire(1)
        except RuntimeError as e:
            errors.append(str(e))
    with token.held(0):
        t = threading.Thread(target=wait)
        t.start()
        time.sleep(0.1)
        token.abort()
        t.join(5)
    assert errors == ["rank 1: another simulated rank failed"]


_FRESH = r"""
import os
import sys
sys.path.insert(0, "tests")
import numpy as np
import tensorflow as tf
from des.jobs.verify import fit_and_snapshot, run_in_process_world
from test_key_stripes import P, V, one_table
if sys.argv[1] == "started":
    tf.config.threading.set_inter_op_parallelism_threads(2)   # a 2-core machine's default pool, on any machine
    tf.constant(1.0) + 1.0              # TF's runtime starts with it
rng = np.random.default_rng(0)
x = {"ids": rng.integers(0, V, (31, P)), "user": rng.integers(0, V, 31)}
batches, probe = [(x, rng.integers(0, 2, 31).astype("float32"))], {k: v[:4] for k, v in x.items()}
try:
    run_in_process_world(3, one_table, lambda m: fit_and_snapshot(m, batches, probe, "adam", 0.02),
                         tail="data_parallel", field_rows="samples")
except RuntimeError as e:
    print("refused:", str(e).splitlines()[0])
    sys.exit(0)
print("trained with", tf.config.threading.get_inter_op_parallelism_threads() or os.cpu_count(), "inter-op threads")
"""


@pytest.mark.parametrize("tf_started", [False, True])
def test_a_fresh_process_gets_the_threads_the_simulated_world_needs_or_is_told_at_once(tf_started):
    """Without tests/conftest.py's 64 inter-op threads, a one-batch fit of the key-stripe model at
    N = 3 (data-parallel tail) used to wait 300 s and end "only 2 of 3 ranks came": two ranks'
    collectives held both of a 2-core machine's TF threads. The world now asks for its threads
    when TF can still give them, and says what to call, before anything runs, when it cannot."""
    out = subprocess.run([sys.executable, "-c", _FRESH, "started" if tf_started else "fresh"],
                         capture_output=True, text=True, timeout=240,   # < the world's 300 s
                         cwd=str(pathlib.Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr[-3000:]
    if tf_started:
        assert "refused: the simulated world of 3 ranks needs 64 TensorFlow inter-op threads, and TF started " \
            "with 2" in out.stdout, out.stdout
        assert "set_inter_op_parallelism_threads(64)" in out.stdout
    else:
        said = [line for line in out.stdout.splitlines() if line.startswith("trained with")]
        assert said and int(said[0].split()[2]) >= 64, out.stdout + out.stderr[-2000:]

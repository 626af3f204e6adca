"""Byte accounting of the DES communicator: every collective counted where it is called, by purpose.

The all-to-all side (per destination, self-sends apart, sender = receiver across processes) needs
Horovod's all-to-all and runs under mpirun: tests/test_mpi.py (PS) and tests/test_cache.py."""
import numpy as np
import tensorflow as tf

import des
import models
from des.callbacks import ReplicaCheck
from des.verify import run_in_process_world
from des_ops.comm import InProcessWorld, LocalCommunicator
from helpers import random_batches, small_spec

SPEC = small_spec(4, dim=3)
BATCHES = random_batches(SPEC, 6, 32, seed=4)


def test_every_collective_is_counted_by_purpose_with_the_bytes_handed_over():
    """6 fit steps with a replica check every 2 steps, then one predict, on 2 in-process ranks:
    the step allreduce holds 4*B*floats per step (one call per step), the replica check's allreduce
    (not counted before) its N x (layers + 1) float64 table per check, the transform's broadcasts
    their arrays; nothing else is counted."""
    n = 2

    def work(m):
        comm = des.distributed(m).layer.comm
        before = comm.counted()
        m.compile(models.make_optimizer("adagrad", 0.05), "binary_crossentropy")
        check = ReplicaCheck(comm, every=2)
        xs = {k: tf.concat([x[k] for x, _ in BATCHES], 0) for k in BATCHES[0][0]}
        ys = tf.concat([y for _, y in BATCHES], 0)
        m.fit(tf.data.Dataset.from_tensor_slices((xs, ys)).batch(32), epochs=1, verbose=0, shuffle=False,
              callbacks=[check])
        m.predict_on_batch(BATCHES[0][0])
        return before, comm.counted(), len(check.replicated_layers()), des.distributed(m).layer.floats_per_sample()

    for before, after, layers, floats in run_in_process_world(n, lambda: models.build("deepfm", SPEC, seed=3,
                                                                                        hidden=(8, 4)), work):
        assert before["broadcast"]["calls"] > 0 and before["broadcast"]["bytes"] > 0   # at transform
        assert before["step"] == before["check"] == {"bytes": 0, "calls": 0}
        # DeepFM, 4 fields of width 3, first Dense of 8: LR 1 + FM (S 3, Q 1) + Dense 8 floats a sample
        assert floats == 1 + (3 + 1) + 8
        assert after["step"] == {"calls": 6 + 1, "bytes": 4 * (1 + 4 + 8) * 32 * 7}
        assert after["check"] == {"calls": 3, "bytes": 3 * n * (layers + 1) * 8}
        assert after["broadcast"] == before["broadcast"] and after["barrier"] == {"bytes": 0, "calls": 0}


def test_allreduce_counted_counts_under_its_purpose_only():
    comm = InProcessWorld(1).communicator(0)
    y = comm.allreduce_counted(tf.ones([3, 2], tf.float64), "barrier")
    assert np.array_equal(y.numpy(), np.ones([3, 2]))
    counted = comm.counted()
    assert counted["barrier"] == {"bytes": 48, "calls": 1}
    assert all(counted[p] == {"bytes": 0, "calls": 0} for p in ("step", "check", "broadcast"))
    assert LocalCommunicator().counted()["step"] == {"bytes": 0, "calls": 0}

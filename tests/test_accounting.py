"""Byte accounting of the DES communicator: every collective counted where it is called, by purpose.

The all-to-all side (per destination, self-sends apart, sender = receiver across processes) needs
Horovod's all-to-all and runs under mpirun: tests/test_mpi.py (PS) and tests/test_cache.py."""
import numpy as np
import pytest
import tensorflow as tf

import des
import models
from des.baselines.ps.tables import KeyExchange
from des.runtime.callbacks import ReplicaCheck
from des.jobs.verify import run_in_process_world
from des_ops import mpi
from des_ops.comm import InProcessWorld, LocalCommunicator, allreduce_sum
from helpers import random_batches, small_spec

SPEC = small_spec(4, dim=3)
BATCHES = random_batches(SPEC, 6, 32, seed=4)


def test_every_collective_is_counted_by_purpose_with_the_bytes_handed_over():
    """6 fit steps with a replica check every 2 steps, then one predict, on 2 in-process ranks:
    the step allreduce holds 4*B*floats per step (one call per step), the replica check's allreduce
    (not counted before) its N x (replicated layers + 1) float64 table per check, the transform's
    broadcasts their arrays (rank 0's weights among them); nothing else is counted."""
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
        return before, comm.counted(), des.distributed(m).layer.floats_per_sample()

    build = lambda: models.build("deepfm", SPEC, seed=3, hidden=(8, 4))
    for before, after, floats in run_in_process_world(n, build, work):
        assert before["broadcast"]["calls"] > 0                                         # at transform
        # at least the float32 Dense weights: dnn_0 12x8 + 8, dnn_1 8x4 + 4, dnn_out 4x1 + 1, bias 1 = 146 floats
        assert before["broadcast"]["bytes"] >= 4 * (12 * 8 + 8 + 8 * 4 + 4 + 4 * 1 + 1 + 1)
        assert before["step"] == before["check"] == {"bytes": 0, "calls": 0}
        # DeepFM, 4 fields of width 3, first Dense of 8: LR 1 + FM (S 3, Q 1) + Dense 8 floats a sample
        assert floats == 1 + (3 + 1) + 8
        # 6 fit steps + 1 predict, each 4 B * 13 floats * 32 samples
        assert after["step"] == {"calls": 6 + 1, "bytes": 4 * (1 + 4 + 8) * 32 * 7}
        # steps 2, 4, 6: a 2 x 5 float64 table, one column per replicated layer (dnn_0's bias, kept whole
        # after the DES layer, dnn_1, dnn_out, bias) and one for the batch fingerprint: 3 * 2 * 5 * 8 B
        assert after["check"] == {"calls": 3, "bytes": 3 * n * (4 + 1) * 8}
        assert after["broadcast"] == before["broadcast"] and after["barrier"] == {"bytes": 0, "calls": 0}


def test_allreduce_counted_counts_under_its_purpose_only():
    comm = InProcessWorld(1).communicator(0)
    y = comm.allreduce_counted(tf.ones([3, 2], tf.float64), "barrier")
    assert np.array_equal(y.numpy(), np.ones([3, 2]))
    counted = comm.counted()
    assert counted["barrier"] == {"bytes": 48, "calls": 1}                         # 3 * 2 float64s * 8 B
    assert all(counted[p] == {"bytes": 0, "calls": 0} for p in ("step", "check", "broadcast"))
    assert LocalCommunicator().counted()["step"] == {"bytes": 0, "calls": 0}
    # the step allreduce counts what it hands over, 3 * 2 float32s * 4 B, not a ring's wire bytes (0 on one
    # process; on 2 they equal the payload, so the test above cannot tell them apart)
    allreduce_sum(comm, tf.ones([3, 2]))
    assert comm.counted()["step"] == {"bytes": 24, "calls": 1}


def test_an_epoch_of_unknown_length_counts_one_call_per_step():
    """A dataset of unknown length (a filter, a text reader): Keras starts one more step whose
    input never comes; no collective runs in it, so none is counted (the demo once reported
    bytes/step as 40/41 of the truth). 3 steps of 32 rows of an FM on 4 fields of width 3: per
    sample the linear sum (1), the sum of embeddings (3) and of their squares (1) = 5 floats."""
    model, _ = des.transform(models.build("fm", SPEC, seed=3), comm=LocalCommunicator())
    model.compile(models.make_optimizer("sgd", 0.1), "binary_crossentropy")
    xs = {k: tf.concat([x[k] for x, _ in BATCHES[:3]], 0) for k in BATCHES[0][0]}
    ys = tf.concat([y for _, y in BATCHES[:3]], 0)
    data = tf.data.Dataset.from_tensor_slices((xs, ys)).filter(lambda x, y: True).batch(32)
    assert data.cardinality() == tf.data.UNKNOWN_CARDINALITY
    model.fit(data, epochs=2, verbose=0)
    assert des.distributed(model).comm.counted()["step"] == {"calls": 6, "bytes": 6 * 4 * 32 * 5}


def test_the_mpi4py_wait_sleeps_doubling_pauses_up_to_its_longest_until_the_request_is_done(monkeypatch):
    """des_ops.mpi.sleeping_wait tests the request, sleeps 20 us, 40 us, ... at most 500 us between
    tests (Open MPI's own Wait would poll a core), and returns on the first test that finds it done."""
    import time
    from des_ops.mpi import sleeping_wait
    pauses = []
    monkeypatch.setattr(time, "sleep", pauses.append)

    class Request:
        tests = 0

        def Test(self):
            self.tests += 1
            return self.tests == 8
    request = Request()
    sleeping_wait(request)
    assert request.tests == 8
    np.testing.assert_allclose(pauses, [2e-5, 4e-5, 8e-5, 1.6e-4, 3.2e-4, 5e-4, 5e-4])
    pauses.clear()
    sleeping_wait(type("Done", (), {"Test": lambda self: True})())
    assert pauses == []


def test_the_mpi4py_allreduce_names_ranks_that_met_another_collective_and_gives_up_on_ranks_that_never_come():
    """MPI matches collectives by order, not name: des_ops.mpi.SleepingMpi.sum sends each rank's
    mark of the name beside the payload, so rank 0 of 2 whose allreduce met rank 1's differently
    named one ends naming rank 1; with the same name it returns the sum. A rank that never comes
    ends the wait after the stall timeout, with a message."""
    import pytest
    from des_ops.comm import DisagreementError
    from des_ops.mpi import SleepingMpi

    class Done:
        def Test(self):
            return True

    def world(rank1_name: str, never: bool = False):
        """Rank 0 of 2, rank 1 sending [10, 20] under ``rank1_name`` (or never coming)."""
        mpi = object.__new__(SleepingMpi)
        mpi.rank, mpi.size, mpi.timeout, mpi.mpi = 0, 2, 0.05, type("MPI", (), {"SUM": "sum"})

        def iallreduce(send, out, op):
            if never:
                return type("Pending", (), {"Test": lambda self: False})()
            theirs = np.zeros_like(send)
            theirs[:2], theirs[2 + 1] = [10, 20], _mark(rank1_name)
            out[:] = send + theirs
            return Done()
        mpi.comm = type("Comm", (), {"Iallreduce": staticmethod(iallreduce)})
        return mpi

    def _mark(name):          # the mark SleepingMpi.sum puts in a rank's place, computed independently
        import zlib
        return zlib.crc32(name.encode()) % (1 << 23) + 1

    np.testing.assert_array_equal(world("des_partials").sum(np.array([1.0, 2.0], np.float32), "des_partials"),
                                  [11.0, 22.0])
    with pytest.raises(DisagreementError, match=r"rank 0 of 2: allreduce 'des_partials' met another collective "
                                                r"on rank\(s\) 1"):
        world("des_partials_other").sum(np.array([1.0, 2.0], np.float32), "des_partials")
    with pytest.raises(TimeoutError, match=r"rank 0 of 2, allreduce 'des_partials': waited 0 s"):
        world("des_partials", never=True).sum(np.array([1.0, 2.0], np.float32), "des_partials")


def test_the_default_communicator_settles_on_mpi4py_without_partials_and_on_horovod_otherwise(monkeypatch):
    """des_ops.mpi.SettlingCommunicator (the default under a launcher) starts on mpi4py; des.transform's
    settle keeps it in float32 for the replicated tail and the first layer by rows (no partials) and
    takes Horovod for the data-parallel tail's partials or a 16-bit wire, for good, as the PS's
    KeyExchange does; both count into its counters; once a collective is in a traced step, a switch
    is refused. (Fake inner communicators: the real ones are launched in test_mpi.)"""
    class Fake(LocalCommunicator):
        def one_machine(self):
            return True
    monkeypatch.setattr(mpi, "Mpi4pyCommunicator", type("Mpi4py", (Fake,), {"name": "mpi4py", "blocking": True}))
    monkeypatch.setattr(mpi, "HorovodCommunicator", type("Horovod", (Fake,), {"name": "horovod"}))
    for tail, wire, first, expected in (("replicated", "float32", "operators", "mpi4py"),
                                        ("data_parallel", "float32", "operators", "horovod"),
                                        ("data_parallel", "float32", "rows", "mpi4py"),
                                        ("data_parallel", "float16", "rows", "horovod"),
                                        ("replicated", "float16", "operators", "horovod")):
        comm = mpi.SettlingCommunicator()
        assert (comm.name, comm.blocking) == ("mpi4py", True)         # the plan's agreement, the link's timing
        comm.broadcast(np.zeros(3, np.float32))
        assert comm.settle(tail, wire, first) == expected == comm.name
        assert comm.settle("replicated", "float32") == expected       # a second tower does not switch back
        comm.inner.count("broadcast", 8)
        allreduce_sum(comm, tf.ones([2, 3]))
        assert comm.counted()["broadcast"]["calls"] == 1 and comm.counted()["step"] == {"bytes": 24, "calls": 1}
    assert KeyExchange(mpi.SettlingCommunicator()).comm.name == "horovod"    # the PS's exchanges, however built
    comm = mpi.SettlingCommunicator()
    tf.function(lambda x: comm.allreduce(x, "des_partials"))(tf.ones([2]))
    with pytest.raises(RuntimeError, match="already in a traced step by mpi4py"):
        comm.settle("data_parallel", "float32")

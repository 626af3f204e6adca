"""One process of the ``--comm sync`` check under mpirun (used by tests/test_timemodel.py):

    mpirun -np 2 python scripts/mpi_sync.py

The last rank sleeps 0.4 s before each of 3 steps. Rank 0 times the steps of each timing
communicator: ``noop`` (DES's) and the PS's no-op exchange do not wait for it; ``sync`` (DES's)
and the PS's exchange over ``NoopCommunicator(meet="scalars")`` (``--mode ps --comm sync``) do,
and so does an all-to-all over ``NoopCommunicator(meet="every")`` (``--comm meet``: no rows
move, it returns its input). Prints one JSON line of median seconds per step (rank 0), then
each rank a line of what ``agree`` said over the timing communicators: the last rank's text
differs; with ``sync`` it is compared with rank 0's (a real broadcast) and that rank raises, with
``noop`` (no meeting) nothing is compared (rank 0 prints every rank's line).
"""
import json
import sys
import time

import des  # noqa: F401
import horovod.tensorflow as hvd
import numpy as np
import tensorflow as tf

from des_ops.comm import DisagreementError, agree, launcher_rank  # noqa: E402
from des_ops.mpi import NoopCommunicator, SyncCommunicator  # noqa: E402
from des.baselines.ps.tables import KeyExchange  # noqa: E402


def steps(reduce) -> float:
    rank, size = launcher_rank()

    @tf.function
    def step(x):
        return reduce(x)
    step(tf.ones([1]))                       # trace (and a first meeting)
    times = []
    for _ in range(3):
        if rank == size - 1:
            time.sleep(0.4)
        t = time.perf_counter()
        step(tf.ones([1])).numpy()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def meet_alltoall(x):
    """One row to process 0 through the meeting all-to-all: it comes back unchanged."""
    rank, size = launcher_rank()
    rows, splits = MEET.alltoall(tf.reshape(x, [1, 1]) * 3.0, tf.one_hot(0, size, dtype=tf.int32), "ids")
    check = tf.debugging.assert_equal(rows, tf.reshape(x, [1, 1]) * 3.0)
    with tf.control_dependencies([check, tf.debugging.assert_equal(splits, tf.one_hot(0, size, dtype=tf.int32))]):
        return tf.identity(rows)


def agreements() -> dict:
    """What ``agree`` says on this rank: equal texts pass, then the last rank's text differs."""
    rank, size = launcher_rank()
    out = {"rank": rank}
    for name, comm in (("noop", NoopCommunicator()), ("sync", SyncCommunicator())):
        agree(comm, "plan", "F0 -> 0, F1 -> 1")
        try:
            agree(comm, "plan", "F0 -> 0" + (", F1 -> 0" if rank == size - 1 else ""))
            out[name] = "agreed"
        except DisagreementError as e:
            out[name] = str(e)
    return out


def main() -> None:
    global MEET
    MEET = KeyExchange(NoopCommunicator(meet="every"))
    out = {"des_noop": steps(NoopCommunicator().allreduce), "des_sync": steps(SyncCommunicator().allreduce),
           "ps_noop": steps(KeyExchange(NoopCommunicator()).sum_across),
           "ps_sync": steps(KeyExchange(NoopCommunicator(meet="scalars")).sum_across),
           "ps_meet_allreduce": steps(lambda x: MEET.sum_across(tf.concat([x, x], 0))),
           "ps_meet_alltoall": steps(meet_alltoall)}
    said = hvd.allgather_object(agreements())
    if launcher_rank()[0] == 0:
        print(json.dumps(out), flush=True)
        for line in said:
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    sys.exit(main())

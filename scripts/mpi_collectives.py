"""The mpi4py communicator's collectives under mpirun (used by tests/test_mpi.py):

    mpirun -np 3 python scripts/mpi_collectives.py OUT_DIR

Rank r holds ``rows(r, n)`` rows of 2 numbers (rank 2 of 3 none: an empty slice); each of
des_ops.mpi.Mpi4pyCommunicator's collectives runs eagerly and again inside one tf.function (its
calls chained in trace order), and each rank pickles what it got to OUT_DIR/rank<r>.pkl:

- allreduce of a float64 and an int64 array; broadcast from rank 1;
- all-gather of its rows; all-to-all of its rows, row i to rank (i + r) mod n;
- reduce-scatter of a [5, 2] array that is (r + 1) x the same array on every rank.

Then a forced disagreement: rank 1 names its all-to-all differently, and each rank records the
error it met (every rank meets one, at the same call: nothing hangs).
"""
import os
import pickle
import sys

import numpy as np
import tensorflow as tf

from des_ops.comm import DisagreementError
from des_ops.mpi import Mpi4pyCommunicator


def rows(r: int, n: int) -> np.ndarray:
    """Rank r's rows: max(0, 3 - 2 r) rows of 2 float32, 100 r + 0, 1, 2, ..."""
    k = max(0, 3 - 2 * r)
    return (100.0 * r + np.arange(2 * k, dtype=np.float32)).reshape(k, 2)


def destinations(r: int, n: int) -> np.ndarray:
    return (np.arange(len(rows(r, n))) + r) % n


def collectives(comm: Mpi4pyCommunicator, x, dest, base, f64, i64) -> dict:
    order = tf.argsort(dest, stable=True)
    splits = tf.math.bincount(tf.cast(dest, tf.int32), minlength=comm.world_size, maxlength=comm.world_size)
    got, got_splits = comm.alltoall(tf.gather(x, order), splits, "probe_alltoall")
    return {"allreduce_f64": comm.allreduce(f64, "probe_f64"), "allreduce_i64": comm.allreduce(i64, "probe_i64"),
            "allgather": comm.allgather(x, "probe_allgather"), "alltoall": got, "alltoall_splits": got_splits,
            "reducescatter": comm.reducescatter(base * float(comm.rank + 1), "probe_reducescatter")}


def main(out: str) -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    comm = Mpi4pyCommunicator()
    r, n = comm.rank, comm.world_size
    x, dest = tf.constant(rows(r, n)), tf.constant(destinations(r, n), tf.int64)
    base = tf.reshape(tf.range(10, dtype=tf.float32), [5, 2])
    f64, i64 = tf.constant([0.5 * r, 1.0], tf.float64), tf.constant([r, 7], tf.int64)
    said = {"eager": {k: v.numpy() for k, v in collectives(comm, x, dest, base, f64, i64).items()}}
    graph = tf.function(lambda *a: collectives(comm, *a))
    said["graph"] = {k: v.numpy() for k, v in graph(x, dest, base, f64, i64).items()}
    said["broadcast"] = comm.broadcast(np.array([r, 10 * r], np.int64), root=1)
    try:
        comm.alltoall(x, tf.zeros([n], tf.int32), "ids" if r != 1 else "rows")
        said["disagreement"] = None
    except DisagreementError as e:
        said["disagreement"] = str(e)
    with open(os.path.join(out, f"rank{r}.pkl"), "wb") as fh:
        pickle.dump(said, fh)


if __name__ == "__main__":
    main(sys.argv[1])

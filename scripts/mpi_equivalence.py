"""One process of an equivalence run under mpirun (used by tests/test_mpi.py):

    mpirun -np 3 python scripts/mpi_equivalence.py OUT_DIR deepfm:adam:horovod:per-field [wdl:ftrl:horovod:fused ...]

For each configuration (model:optimizer:horovod|mpi4py:per-field|fused; one communicator kind
per launch), in the order given, each rank trains the DES model on the shared toy batches
(PS_SPEC: one-hot, multi-valued and weighted multi-valued fields) and pickles its snapshot
(predictions after every step, owned table rows, weights) to OUT_DIR/<configuration with
'-' for ':'>.rank<r>.pkl, plus the gradient a raw hvd.allreduce would give, to show why DES
needs the identity gradient.
"""
import os
import pickle
import sys

import des  # noqa: F401
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import horovod.tensorflow as hvd  # noqa: E402

import models  # noqa: E402
from des.jobs.verify import PS_SPEC, optimizer_factory, random_batches, train_and_snapshot  # noqa: E402
from des_ops.comm import allreduce_sum  # noqa: E402
from des_ops.mpi import HorovodCommunicator, Mpi4pyCommunicator  # noqa: E402

LR = {"sgd": 0.2, "adagrad": 0.05, "adam": 0.01, "ftrl": 0.05}


def run(out: str, config: str) -> None:
    """Train and snapshot one configuration ``model:optimizer:comm:tables``."""
    name, optimizer, comm_kind, tables = config.split(":")
    comm = HorovodCommunicator() if comm_kind == "horovod" else Mpi4pyCommunicator()
    spec = PS_SPEC            # one-hot, multi-valued and weighted multi-valued fields
    batches = random_batches(spec, 20, 32, seed=4)
    probe = random_batches(spec, 1, 16, seed=99)[0][0]
    model, report = des.transform(models.build(name, spec, seed=3, hidden=(8, 4)), des.Options(tables=(("joined" if tables == "joined" else "fused") if tables in ("fused", "joined") else "per-field")), comm=comm)
    if comm.rank == 0:
        print(report, flush=True)
    snap = train_and_snapshot(model, optimizer_factory(optimizer, LR), None, batches, probe)
    x = tf.Variable([1.0, 2.0])
    with tf.GradientTape(persistent=True) as tape:
        ours = tf.reduce_sum(allreduce_sum(comm, x))
        if comm_kind == "horovod":
            raw = tf.reduce_sum(hvd.allreduce(x, op=hvd.Sum))
    snap["grad_des"] = tape.gradient(ours, x).numpy()
    if comm_kind == "horovod":
        snap["grad_raw_horovod"] = tape.gradient(raw, x).numpy()
    snap["payload_bytes"] = int(comm.payload_bytes.numpy())
    snap["allreduce_calls"] = int(comm.calls.numpy())
    snap["floats_per_sample"] = report.floats_per_sample
    snap["fused_tables"] = sum(line.startswith("fused table") for line in report.tables)
    snap["owns_fields"] = bool(des.distributed(model).plan.fields_of(comm.rank))
    with open(os.path.join(out, f"{config.replace(':', '-')}.rank{comm.rank}.pkl"), "wb") as fh:
        pickle.dump(snap, fh)


if __name__ == "__main__":
    if len({c.split(":")[2] for c in sys.argv[2:]}) > 1:
        sys.exit("one communicator kind per launch (Horovod and mpi4py each drive MPI)")
    for c in sys.argv[2:]:
        run(sys.argv[1], c)

"""One process of the bring-your-own-model runs under mpirun (used by tests/test_mpi.py):

    mpirun -np 3 python scripts/mpi_gallery.py OUT_DIR deepctr_deepfm tfra_deepfm deepctr_deepfm_defaults@legacy_adagrad

For each named model of tests/gallery.py: every rank builds it (its own random weights, seeded
by its rank: the same job gives the same bits in every launch),
rank 0 saves its initial weights, des.transform (Horovod) gives every rank rank 0's weights
and its fields, and each rank fits 20 steps (with Adam, or NAME@OPTIMIZER: an optimizer of
tests/gallery.py's OPTIMIZERS) and pickles its snapshot to OUT_DIR/<NAME@OPTIMIZER>.rank<r>.pkl
(rank 0 also the report). Models of several outputs (gallery.MULTI_TASK) learn the labels on each.
"""
import os
import pickle
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import des  # noqa: E402
from des.jobs.verify import fit_and_snapshot  # noqa: E402
from des_ops.mpi import HorovodCommunicator  # noqa: E402
from gallery import BUILDERS, MULTI_TASK, batches_for, optimizer_for  # noqa: E402


def main(out: str, names: list[str], options: des.Options | None = None) -> None:
    comm = HorovodCommunicator()
    tf.keras.utils.set_random_seed(comm.rank)    # other weights on every rank, the same in every launch
    for job in names:
        name, _, optimizer = job.partition("@")
        model = {**BUILDERS, **MULTI_TASK}[name]()
        initial = model.get_weights()
        batches = batches_for(model, 20, 32, seed=4)
        probe = batches_for(model, 1, 16, seed=99)[0][0]
        model, report = des.transform(model, options, comm=comm)
        calls, sent = int(comm.calls.numpy()), int(comm.payload_bytes.numpy())
        snap = fit_and_snapshot(model, batches, probe, optimizer_for(model, optimizer) if optimizer else "adam")
        snap["allreduce_calls"] = int(comm.calls.numpy()) - calls       # the communicator's own counter
        snap["payload_bytes"] = int(comm.payload_bytes.numpy()) - sent
        snap["floats_per_sample"] = report.floats_per_sample
        if comm.rank == 0:
            snap["initial"], snap["report"] = initial, str(report)
            print(report, flush=True)
        with open(os.path.join(out, f"{job}.rank{comm.rank}.pkl"), "wb") as fh:
            pickle.dump(snap, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

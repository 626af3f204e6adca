"""One process of the subclassed-model runs under mpirun (used by tests/test_mpi.py):

    mpirun -np 2 python scripts/mpi_subclassed.py OUT_DIR tfrs_ranking subclassed_wdl tfrs_retrieval
    mpirun -np 3 python scripts/mpi_subclassed.py OUT_DIR --mpi4py tfrs_retrieval     # des_ops.Mpi4pyCommunicator

For each named model of tests/subclassed_models.py: every rank builds it with its own random
weights (seeded by its rank), calls it once on a batch (rank 0 saves those initial weights),
des.transform traces and rewrites it (rank 0's weights everywhere), and the user's loop trains
it 20 steps; each rank pickles its predictions to OUT_DIR/<model>.rank<r>.pkl.
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
from des_ops.mpi import HorovodCommunicator, Mpi4pyCommunicator  # noqa: E402
from subclassed_models import BUILDERS, batches_for, outputs, probe_of, sample_of, train  # noqa: E402


def main(out: str, names: list[str]) -> None:
    comm = Mpi4pyCommunicator() if names[0] == "--mpi4py" else HorovodCommunicator()
    names = [n for n in names if n != "--mpi4py"]
    for name in names:
        tf.keras.utils.set_random_seed(comm.rank)
        batches, probe = batches_for(name, 20, 32, seed=4), probe_of(name)
        model = BUILDERS[name]()
        outputs(name, model, probe)                         # builds it: its own random weights
        initial = model.get_weights()
        model, report = des.transform(model, comm=comm, sample=sample_of(name, batches))
        calls = int(comm.calls.numpy())
        result = train(name, model, batches, probe)
        result["allreduce_calls"] = int(comm.calls.numpy()) - calls
        result["report"] = str(report)
        if comm.rank == 0:
            result["initial"] = initial
            print(report, flush=True)
        with open(os.path.join(out, f"{name}.rank{comm.rank}.pkl"), "wb") as fh:
            pickle.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])

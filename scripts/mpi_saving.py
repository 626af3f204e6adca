"""One process of the saving runs under mpirun (used by tests/test_mpi.py):

    mpirun -np 2 python scripts/mpi_saving.py train OUT keras_deepfm:adam tfra_deepfm:legacy_adagrad ...
    mpirun -np 5 python scripts/mpi_saving.py resume OUT keras_deepfm:adam ...

For each MODEL:OPTIMIZER of tests/gallery.py, ``train``: every rank builds the model (its own
random weights, seeded by its rank; des.transform gives every rank rank 0's), rank 0 saves them
as OUT/<case>.initial.pkl; each rank fits 30 steps of 32 with that optimizer and writes a DES
checkpoint after step 15 (des.checkpoint.save, every rank). A case written MODEL:OPTIMIZER:saves
then, after step 30, also calls ``model.save`` (a Keras SavedModel folder and a .keras file where
the model's layers serialize), ``model.save_weights`` and ``des.export``: every rank calls each,
rank 0 writes (these write weights, not the optimizer's slots: one optimizer per model is
enough). Rank 0 pickles its predictions. ``resume``: builds and transforms the model on this
many processes, restores the checkpoint of step 15 (the optimizer's slots with it), fits steps
16-30 and writes the predictions (rank 0) and, for a ``saves`` case, a ``model.save`` of its own
(every rank takes part, a process that owns no field too).
``rank0`` (the Horovod habit of saving on rank 0 only): after 2 steps rank 0 alone calls
``model.save`` while the others train on; the job must end (Horovod's stall shutdown) with
nothing written.
"""
import os
import pickle
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import tensorflow as tf  # noqa: E402

import des  # noqa: E402
from des.runtime import checkpoint  # noqa: E402
from des_ops.mpi import HorovodCommunicator  # noqa: E402
from gallery import BUILDERS, batches_for, optimizer_for  # noqa: E402

STEPS, HALF, BATCH = 30, 15, 32


def case_data(name: str):
    model = BUILDERS[name]()
    return model, batches_for(model, STEPS, BATCH, seed=4), batches_for(model, 1, 16, seed=99)[0][0]


def main(phase: str, out: str, cases: list[str]) -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    comm = HorovodCommunicator()
    barrier = lambda: comm.allreduce_counted(tf.zeros([1]), "barrier")   # noqa: E731
    tf.keras.utils.set_random_seed(comm.rank)
    for case in cases:
        name, opt, *flags = case.split(":")
        saves = flags == ["saves"]
        model, batches, probe = case_data(name)
        base = os.path.join(out, f"{name}-{opt}")
        initial = model.get_weights()
        model, _ = des.transform(model, comm=comm)
        model.compile(optimizer_for(model, opt), "binary_crossentropy")
        if phase == "rank0":
            for x, y in batches[:2]:
                model.train_on_batch(x, y)
            if comm.rank == 0:
                model.save(base + ".rank0only")
            for x, y in batches[2:]:
                model.train_on_batch(x, y)
        elif phase == "train":
            for step, (x, y) in enumerate(batches, 1):
                model.train_on_batch(x, y)
                if step == HALF:
                    checkpoint.save(base + ".ckpt", model, model.optimizer, rank=comm.rank,
                                    world_size=comm.world_size, barrier=barrier)
            if saves:
                model.save(base + ".savedmodel")
                if not name.startswith("tfra"):          # TFRA's layers do not serialize to .keras
                    model.save(base + ".keras")
                model.save_weights(base + ".weights.h5")
                des.export(model, base + ".served")
        else:
            checkpoint.restore(base + ".ckpt", model, model.optimizer, rank=comm.rank, world_size=comm.world_size)
            for x, y in batches[HALF:]:
                model.train_on_batch(x, y)
            if saves:
                model.save(base + f".resumed{comm.world_size}.savedmodel")
        predictions = model.predict_on_batch(probe)
        if comm.rank == 0:
            with open(f"{base}.{phase}{comm.world_size}.pkl", "wb") as fh:
                pickle.dump({"initial": initial, "predictions": predictions, "probe": probe}, fh)
        print(f"rank {comm.rank}: {case} {phase} done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

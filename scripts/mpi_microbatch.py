"""One process of the micro-batch / 16-bit wire run under mpirun (tests/test_mpi_microbatch.py):

    mpirun -np 5 python scripts/mpi_microbatch.py OUT_DIR

Each rank trains DeepFM on PS_SPEC's toy batches (4 fields: at N = 5 one rank owns none) twice:
with micro_batches=3 (exact) and with wire_dtype="float16"; then predicts a batch of 2 rows
with the K = 3 model (a slice is empty). It pickles predictions, snapshots and byte counters to
OUT_DIR/rank<r>.pkl.
"""
import os
import pickle
import sys

import des
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import models  # noqa: E402
from des.jobs.verify import PS_SPEC, random_batches, train_and_snapshot  # noqa: E402
from des_ops.mpi import HorovodCommunicator  # noqa: E402

STEPS = 10


def main(out: str) -> None:
    comm = HorovodCommunicator()
    batches = random_batches(PS_SPEC, STEPS, 32, seed=4)
    probe = random_batches(PS_SPEC, 1, 16, seed=99)[0][0]
    result = {}
    for key, kwargs in (("k3", {"micro_batches": 3}), ("fp16", {"wire_dtype": "float16"})):
        model, _ = des.transform(models.build("deepfm", PS_SPEC, seed=3, hidden=(8, 4)), des.Options(**kwargs), comm=comm)
        before = comm.counted()["step"]
        snap = train_and_snapshot(model, "adam", 0.01, batches, probe)
        after = comm.counted()["step"]
        snap["step"] = {k: after[k] - before[k] for k in after}
        snap["collective"] = des.distributed(model).layer.collective
        snap["owns_fields"] = bool(des.distributed(model).plan.fields_of(comm.rank))
        if key == "k3":
            snap["two_rows"] = model.predict_on_batch({k: v[:2] for k, v in probe.items()})
        result[key] = snap
    with open(os.path.join(out, f"rank{comm.rank}.pkl"), "wb") as fh:
        pickle.dump(result, fh)


if __name__ == "__main__":
    main(sys.argv[1])

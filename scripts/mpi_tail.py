"""One process of a data-parallel-tail run under mpirun (used by tests/test_mpi.py):

    mpirun -np 3 python scripts/mpi_tail.py OUT_DIR keras_deepfm deepctr_deepfm
    mpirun -np 3 python scripts/mpi_tail.py --first-dense rows OUT_DIR keras_deepfm
    mpirun -np 3 python scripts/mpi_tail.py --field-rows samples OUT_DIR deepctr_dcn
    mpirun -np 3 python scripts/mpi_tail.py --first-layer rows OUT_DIR keras_deepfm

For each named model of tests/gallery.py: every rank builds it (its own random weights, seeded
by its rank), des.transform(tail="data_parallel") gives every rank rank 0's weights and its
fields, and each rank fits 12 batches of 31 rows and one of 2 (31 is not divisible by 3; with
2 rows some processes hold no row) with SGD, then pickles its snapshot, its bytes counted per
purpose and its shard sizes to OUT_DIR/<model>.rank<r>.pkl. ``main(..., comm="mpi4py")``: the
same on des_ops.mpi.Mpi4pyCommunicator (scripts/mpi_battery.py --mpi4py); ``comm="settling"``: on
the default one (des_ops.mpi.SettlingCommunicator), as des.transform settles it.
"""
import os
import pickle
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import tensorflow as tf  # noqa: E402

import des  # noqa: E402
from des.jobs.verify import fit_and_snapshot  # noqa: E402
from des_ops.mpi import HorovodCommunicator, Mpi4pyCommunicator, SettlingCommunicator  # noqa: E402
from gallery import BUILDERS, batches_for  # noqa: E402

ROWS, BATCH = 12 * 31 + 2, 31


def tail_batches(model):
    """ROWS rows as batches of BATCH (the last one 2 rows) and a probe of 16 rows."""
    rows = batches_for(model, 1, ROWS, seed=4)[0]
    x, y = rows
    batches = [({k: v[i:i + BATCH] for k, v in x.items()}, y[i:i + BATCH]) for i in range(0, ROWS, BATCH)]
    return batches, batches_for(model, 1, 16, seed=99)[0][0]


def main(out: str, names: list[str], first_dense: str = "partials", field_rows: str = "partials",
         first_layer: str = "operators", tables: str = "auto", stripe_min_rows: int | None = 1_000_000,
         comm: str = "horovod") -> None:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    comm = {"mpi4py": Mpi4pyCommunicator, "settling": SettlingCommunicator}.get(comm, HorovodCommunicator)()
    tf.keras.utils.set_random_seed(comm.rank)    # other weights on every rank, the same in every launch
    for name in names:
        model = BUILDERS[name]()
        initial = model.get_weights()
        batches, probe = tail_batches(model)
        options = (des.Options(first_layer="rows", tables=tables, stripe_min_rows=stripe_min_rows)
                   if first_layer == "rows" else
                   des.Options(tail="data_parallel", first_dense=first_dense, field_rows=field_rows, tables=tables,
                               stripe_min_rows=stripe_min_rows))
        model, report = des.transform(model, options, comm=comm)
        before = comm.counted()
        snap = fit_and_snapshot(model, batches, probe, optimizer="sgd", learning_rate=0.5)
        after = comm.counted()
        snap["counted"] = {p: {k: after[p][k] - before[p][k] for k in after[p]} for p in after}
        snap["floats_per_sample"] = report.floats_per_sample
        snap["tail_floats"] = sum(int(v.shape.num_elements()) for v in des.distributed(model).tail_variables)
        snap["owns_fields"] = bool(des.distributed(model).plan.fields_of(comm.rank))
        layer = des.distributed(model).layer
        snap["by_rows"] = [(op.rank_widths, op.width) for op, rows in zip(layer.ops, layer.by_rows) if rows]
        snap["rank_blocks"] = [op.rank_blocks for op, rows in zip(layer.ops, layer.by_rows) if rows]
        snap["by_samples"] = report.by_samples
        snap["sends_fused_rows"] = layer.sends_fused_rows
        snap["sample_blocks"] = [[b for op, s in zip(layer.ops, layer.to_samples) if s
                                  for b in op.samples_blocks(comm.world_size)[p]] for p in range(comm.world_size)]
        if comm.rank == 0:
            snap["initial"], snap["report"] = initial, str(report)
        with open(os.path.join(out, f"{name}.rank{comm.rank}.pkl"), "wb") as fh:
            pickle.dump(snap, fh)


if __name__ == "__main__":
    if sys.argv[1] in ("--first-dense", "--field-rows", "--first-layer"):
        main(sys.argv[3], sys.argv[4:], **{sys.argv[1][2:].replace("-", "_"): sys.argv[2]})
    else:
        main(sys.argv[1], sys.argv[2:])

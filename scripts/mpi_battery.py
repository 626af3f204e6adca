"""Several mpirun checks in ONE launch (used by tests/test_mpi.py): a TensorFlow process start per
rank is most of what a small check costs, so checks that share a process count share a launch.

    mpirun -np 3 python scripts/mpi_battery.py OUT_DIR gallery:two_tower tail:keras_deepfm \\
        subclassed:tfrs_ranking equivalence:wdl:ftrl:horovod:per-field ps:wdl:sgd:fused

Each job is KIND:ARGS and runs, in the order given, the ``main`` of scripts/mpi_KIND.py with
its output in OUT_DIR/KIND (ps: OUT_DIR/ps/<ARGS with '-' for ':'>), exactly as that script
run alone would write it: gallery:NAME, tail:NAME, rows:NAME (the tail's run with the first Dense
by rows, mpi_tail.py --first-dense rows), samples:NAME[:TABLES] (the tail's run with the field vectors no rule
splits sent to their samples' processes, mpi_tail.py --field-rows samples), layerrows:NAME[:TABLES] (the first layer
by rows, des.Options(first_layer="rows"), mpi_tail.py --first-layer rows), subclassed:NAME (one model each),
equivalence:MODEL:OPTIMIZER:horovod:TABLES, ps:MODEL:OPTIMIZER:TABLES, psuser:tfra_deepfm (the PS on
a user's TFRA model, mpi_ps_user.py), big:NAME and bigtail:NAME (gallery:NAME and tail:NAME with
des.Options(stripe_min_rows=0): a field too big for one owner split by key stripe). ``--mpi4py`` first:
the tail's kinds (tail, rows, samples, layerrows, bigtail) and equivalence:MODEL:OPTIMIZER:mpi4py:TABLES
on des_ops.mpi.Mpi4pyCommunicator (layerrows: on the default SettlingCommunicator, which stays on
mpi4py for the first layer by rows), in a launch of their own (it drives MPI itself, without Horovod);
the other kinds are Horovod's.

    mpirun -np 5 python scripts/mpi_battery.py --mpi4py OUT_DIR tail:deepctr_deepfm equivalence:deepfm:adam:mpi4py:joined
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import mpi_equivalence  # noqa: E402  (sets the 1-thread pools before TensorFlow starts)
import mpi_gallery  # noqa: E402
import mpi_ps  # noqa: E402
import mpi_ps_user  # noqa: E402
import mpi_subclassed  # noqa: E402
import mpi_tail  # noqa: E402

KINDS = ("gallery", "tail", "rows", "samples", "layerrows", "subclassed", "equivalence", "ps", "psuser", "big",
         "bigtail")


TAIL_KINDS = ("tail", "rows", "samples", "layerrows", "bigtail")


def run(out: str, job: str, comm: str = "horovod") -> None:
    """Run one ``KIND:ARGS`` job, its output under ``out/KIND``; ``comm``: the tail kinds' communicator."""
    kind, _, args = job.partition(":")
    if kind not in KINDS or not args:
        sys.exit(f"mpi_battery: job {job!r}: expected KIND:ARGS with KIND one of {', '.join(KINDS)}")
    if comm != "horovod" and kind not in TAIL_KINDS + ("equivalence",):
        sys.exit(f"mpi_battery: job {job!r}: --{comm} runs {', '.join(TAIL_KINDS)} and equivalence only")
    where = os.path.join(out, kind, args.replace(":", "-")) if kind == "ps" else os.path.join(out, kind)
    os.makedirs(where, exist_ok=True)
    if kind == "gallery":
        mpi_gallery.main(where, [args])
    elif kind == "big":
        mpi_gallery.main(where, [args], mpi_gallery.des.Options(stripe_min_rows=0))
    elif kind == "tail":
        mpi_tail.main(where, [args], comm=comm)
    elif kind == "bigtail":
        mpi_tail.main(where, [args], stripe_min_rows=0, comm=comm)
    elif kind == "rows":
        mpi_tail.main(where, [args], first_dense="rows", comm=comm)
    elif kind == "samples":                   # NAME or NAME:TABLES (des.Options.tables)
        name, _, tables = args.partition(":")
        mpi_tail.main(where, [name], field_rows="samples", tables=tables or "auto", comm=comm)
    elif kind == "layerrows":                 # NAME or NAME:TABLES (des.Options.tables)
        name, _, tables = args.partition(":")
        mpi_tail.main(where, [name], first_layer="rows", tables=tables or "auto",   # --mpi4py: the default
                      comm="settling" if comm == "mpi4py" else comm)               # communicator, as it settles
    elif kind == "psuser":
        mpi_ps_user.main(where)
    elif kind == "subclassed":
        mpi_subclassed.main(where, [args])
    elif kind == "equivalence":
        if args.split(":")[2] != comm:
            sys.exit(f"mpi_battery: job {job!r}: its communicator is not this launch's ({comm})")
        mpi_equivalence.run(where, args)
    else:
        name, optimizer, tables = args.split(":")
        mpi_ps.main(name, optimizer, where, tables)


if __name__ == "__main__":
    kind = "mpi4py" if sys.argv[1] == "--mpi4py" else "horovod"
    argv = sys.argv[2:] if kind == "mpi4py" else sys.argv[1:]
    for j in argv[1:]:
        run(argv[0], j, kind)

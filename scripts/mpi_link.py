"""One process of a des.transform with no options under mpirun (used by tests/test_netbed.py and
tests/test_mpi.py): the link's bandwidth is measured at start, rounded to a class, and every
process makes the same choices with it.

    mpirun -np 2 python scripts/mpi_link.py OUT.json     # writes OUT.json.rank<r>
    mpirun -np 2 python scripts/mpi_link.py --des-train OUT.json     # des.train's options (--link auto)

Writes the report's line on the link, the bandwidth assumed, the tail and the first Dense chosen.
``--des-train``: with the des.Options des.train builds from its default command line (its costs
given, the bandwidth left to measure) instead of none.
"""
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import des  # noqa: E402
from des.jobs.config import RunConfig  # noqa: E402
from des_ops.mpi import HorovodCommunicator  # noqa: E402
from gallery import BUILDERS  # noqa: E402


def main(out: str, des_train: bool = False) -> None:
    comm = HorovodCommunicator()
    options = RunConfig.parse(["--data", "unused.txt", "--batch", "4096"]).options() if des_train else None
    model, report = des.transform(BUILDERS["keras_deepfm"](), options, comm=comm)
    assumed = float(report.link.split("assumed ")[1].split(" ")[0]) if report.link else None
    with open(f"{out}.rank{comm.rank}", "w") as fh:
        json.dump({"link": report.link, "assumed": assumed, "tail": report.tail, "by_rows": sorted(report.by_rows)},
                  fh)


if __name__ == "__main__":
    main(sys.argv[-1], des_train="--des-train" in sys.argv[1:-1])

"""Train a reference model, single-process or with DES under mpirun.

    python -m des.train --model deepfm --data train.txt --format criteo
    mpirun -np 4 python -m des.train --mode des --model deepfm --data train.txt

The last ``--holdout`` lines are held out for AUC / log loss (or ``--eval-data FILE`` is
evaluated, and all of ``--data`` trains without a line-count pass). Under DES every process
reads the same batches; logs and the progress bar come from rank 0 only.
"""
from __future__ import annotations

import sys
import time

from des.jobs.config import RunConfig


def main(argv=None) -> int:
    """Parse the options (without loading TensorFlow: a wrong option stops at once), then run."""
    started = time.perf_counter()
    config = RunConfig.parse(argv, __doc__)
    import des  # noqa: F401 - first: it quiets TF logs before TF loads
    from des.jobs import job       # TensorFlow and the modes load here, after the options are checked
    return job.run(config, started)


if __name__ == "__main__":
    sys.exit(main())

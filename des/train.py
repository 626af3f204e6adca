"""``python -m des.train``: see des.jobs.train."""
import sys

from des.jobs.train import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m des.compare``: see des.jobs.compare."""
import sys

from des.jobs.compare import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m des.launch``: see des.jobs.launch."""
import sys

from des.jobs.launch import main

if __name__ == "__main__":
    sys.exit(main())

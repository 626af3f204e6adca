"""``python -m des.predict``: see des.jobs.predict."""
import sys

from des.jobs.predict import main

if __name__ == "__main__":
    sys.exit(main())

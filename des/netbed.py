"""``python -m des.netbed``: see des.cluster.netbed."""
import sys

from des.cluster.netbed import main

if __name__ == "__main__":
    sys.exit(main())

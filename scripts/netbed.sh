#!/usr/bin/env bash
# The emulated cluster (network namespaces as hosts): see des/cluster/netbed.py.
#   scripts/netbed.sh up 4 --rate 1gbit --delay 100us      scripts/netbed.sh down
#   scripts/netbed.sh run 2 --rate 1gbit -- .venv/bin/python -m des.train --mode des ...
cd "$(dirname "$0")/.." && exec .venv/bin/python -m des.netbed "$@"

#!/bin/sh
# mpirun's rsh agent on the netbed (des/netbed.py): "netbed_rsh.sh [options] 10.77.0.K command..."
# runs the command inside host K's network namespace (deshK) instead of over ssh.
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
exec ip netns exec "desh${host##*.}" /bin/sh -c "$*"

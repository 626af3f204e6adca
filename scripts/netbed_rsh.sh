#!/bin/sh
# mpirun's rsh agent on the netbed (des/cluster/netbed.py): "netbed_rsh.sh [options] 10.77.0.K command..."
# runs the command inside host K's network namespace (deshK) instead of over ssh. When the netbed
# gave host K a CPU budget (a cgroup deshK under the cpu controller, and cpuacct on cgroup v1),
# the agent joins it first, so the host's daemon and every process it starts are in it.
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
ns="desh${host##*.}"
for cg in /sys/fs/cgroup/cpu /sys/fs/cgroup/cpuacct /sys/fs/cgroup; do
  [ -w "$cg/$ns/cgroup.procs" ] && echo $$ > "$cg/$ns/cgroup.procs"
done
exec ip netns exec "$ns" /bin/sh -c "$*"

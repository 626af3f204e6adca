"""Fixed cost of one Horovod collective call, as training calls them (inside a tf.function, one
after another): the ``call`` and ``latency`` terms of des.cluster.timemodel. Run it under the launcher
whose network you model, e.g. on the emulated cluster:

    python -m des.netbed run 2 --rate 1gbit -- .venv/bin/python scripts/bench_collectives.py

Prints (rank 0) the median seconds per call of a 4-byte allreduce, a 4-byte-per-peer all-to-all,
64 independent all-to-alls in one step (-> the cost of one more call in a phase, and the cycle a
dependent call waits for), and 256 KiB, 1 MiB and 4 MiB allreduces (the ring's bytes / their excess over the tiny one = the
effective bandwidth at that message size), and an all-to-all of 1 MiB per peer (the effective
bandwidth of all-to-all traffic, which keeps every link busy at once: the PS's).
"""
import json
import sys
import time

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import horovod.tensorflow as hvd  # noqa: E402
from des_ops.wire import ring_share  # noqa: E402


def per_call(fn, x, calls: int = 50, repeats: int = 7) -> float:
    """Median over repeats of (seconds for ``calls`` dependent calls) / calls."""
    @tf.function
    def chain(v):
        for _ in range(calls):
            v = fn(v)
        return v
    chain(x)                                    # trace and warm up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        chain(x).numpy()
        times.append((time.perf_counter() - t) / calls)
    return float(np.median(times))


def main() -> None:
    hvd.init()
    n = hvd.size()
    splits = tf.ones([n], tf.int32)
    big = tf.fill([n], 1 << 18)
    def many(v):                                # 64 independent all-to-alls in one step: ONE cycle
        return tf.add_n([hvd.alltoall(v * float(i + 1), splits=splits)[0] for i in range(64)]) / 2080.0

    out = {"processes": n,
           "alltoall_4B_x64": per_call(many, tf.ones([n]), calls=10),
           "allreduce_4B": per_call(lambda v: hvd.allreduce(v, op=hvd.Sum) * 0.5, tf.ones([1])),
           "alltoall_4B": per_call(lambda v: hvd.alltoall(v, splits=splits)[0], tf.ones([n])),
           "allreduce_256KiB": per_call(lambda v: hvd.allreduce(v, op=hvd.Sum) * 0.5, tf.ones([65536]), calls=10),
           "allreduce_1MiB": per_call(lambda v: hvd.allreduce(v, op=hvd.Sum) * 0.5, tf.ones([1 << 18]), calls=5,
                                      repeats=11),
           "allreduce_4MiB": per_call(lambda v: hvd.allreduce(v, op=hvd.Sum) * 0.5, tf.ones([1 << 20]), calls=3),
           # 1 MiB to every other process at once (what the PS's all-to-alls do): all links busy
           "alltoall_1MiB_per_peer": per_call(lambda v: hvd.alltoall(v, splits=big)[0] * 0.5,
                                              tf.ones([n << 18]), calls=3, repeats=5)}
    # a dependent call waits for Horovod's cycle; calls ready in the same cycle only add their MPI time
    out["per_call_in_a_phase"] = (out["alltoall_4B_x64"] - out["alltoall_4B"]) / 63
    out["cycle"] = out["allreduce_4B"] - out["per_call_in_a_phase"]
    for size, key in ((262144, "256KiB"), (1 << 20, "1MiB"), (4 << 20, "4MiB")):
        ring = ring_share(n) * size
        out[f"effective_bandwidth_Bps_{key}"] = ring / max(1e-9, out[f"allreduce_{key}"] - out["allreduce_4B"])
    out["effective_alltoall_Bps_1MiB"] = (n - 1) * (1 << 20) / max(1e-9, out["alltoall_1MiB_per_peer"]
                                                                    - out["alltoall_4B"])
    if hvd.rank() == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())

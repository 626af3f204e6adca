"""Test set-up: quiet TF, and enough inter-op threads for the in-process simulated world
(each simulated rank blocks one TF thread inside its allreduce)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(64)


def pytest_terminal_summary(terminalreporter):
    """This pytest process's peak memory, so that running files side by side (scripts/test.sh)
    can be checked against the machine's."""
    import resource
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    terminalreporter.write_line(f"peak RSS: {peak} MiB")

"""Test set-up: quiet TF, and enough inter-op threads for the in-process simulated world
(each simulated rank blocks one TF thread inside its allreduce)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(64)

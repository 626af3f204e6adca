"""Test set-up: quiet TF, and enough inter-op threads for the in-process simulated world
(each simulated rank blocks one TF thread inside its allreduce)."""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_inter_op_parallelism_threads(64)

import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _release_models():
    """Free each test's models, graphs and tables: the suite builds hundreds of models in one
    process, and without this the process grows by gigabytes before the mpirun tests start
    (a 24 GiB machine ran out of memory in CI)."""
    yield
    tf.keras.backend.clear_session()
    gc.collect()

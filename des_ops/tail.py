"""The data-parallel tail: after the DES first layer, each process runs the rest of the model
(the FM combine, the Dense stack, ...) on its own rows of the global batch instead of on all of
them, so the tail's computation per process falls as 1/N.

Forward: the partials are summed with a reduce-scatter (process r receives the combined rows
``shard_rows(B, r, N)``), the tail runs on those rows, and the model's outputs are all-gathered,
so every process still sees the whole batch's predictions, computes the same loss and the same
global metrics. Backward: the all-gather's gradient is the process's own rows of the upstream
gradient (identical on every process, as in des_ops.comm.allreduce_sum); the reduce-scatter's
gradient is the all-gather of every process's rows, so each owner of a field gets the gradient
of the whole batch; the tail's own weights get one summed allreduce of their gradients
(``sum_tail_gradients``), because each process saw only its rows. The loss is the mean over the
global batch, so the sum of the processes' gradients is the single process's gradient up to
float32 summation order.

    >>> from des_ops.comm import LocalCommunicator
    >>> comm = LocalCommunicator()
    >>> x = tf.constant([[1.0], [2.0], [3.0]])
    >>> with tf.GradientTape() as tape:
    ...     tape.watch(x)
    ...     y = gather_rows(comm, 2.0 * reduce_scatter_sum(comm, x, "demo"), "demo_out")
    >>> y.numpy().ravel().tolist(), tape.gradient(y, x).numpy().ravel().tolist()
    ([2.0, 4.0, 6.0], [2.0, 2.0, 2.0])
"""
from __future__ import annotations

import tensorflow as tf

from des_ops.comm import Communicator, nbytes, not_folded, shard_rows
from des_ops.keras_internals import stop_penalty_gradients


def reduce_scatter_sum(comm: Communicator, x: tf.Tensor, name: str) -> tf.Tensor:
    """This process's rows (``shard_rows``) of the sum of ``x`` over processes. Gradient: the
    all-gather of every process's rows of the upstream gradient. Counted: the reduce-scatter
    under ``step`` (the whole ``x`` handed over), the all-gather under ``tail``."""
    @tf.custom_gradient
    def _scatter(v):
        with tf.control_dependencies([comm.count("step", nbytes(v))]):
            y = comm.reducescatter(not_folded(comm, v), name)

        def grad(dy):
            with tf.control_dependencies([comm.count("tail", nbytes(dy))]):
                return tf.ensure_shape(comm.allgather(not_folded(comm, dy), f"{name}_grad"), v.shape)
        return y, grad

    return _scatter(x)


def gather_rows(comm: Communicator, x: tf.Tensor, name: str) -> tf.Tensor:
    """Every process's rows of ``x`` in rank order (the whole batch). Gradient: this process's
    rows of the upstream gradient, which every process computed alike from the whole batch."""
    @tf.custom_gradient
    def _gather(v):
        with tf.control_dependencies([comm.count("tail", nbytes(v))]):
            y = comm.allgather(not_folded(comm, v), name)

        def grad(dy):
            lo, hi = shard_rows(tf.shape(dy, out_type=tf.int64)[0], comm.rank, comm.world_size)
            return dy[lo:hi]
        return y, grad

    return _gather(x)


class ShardRows(tf.keras.layers.Layer):
    """This process's rows of a model input that the tail reads."""

    def __init__(self, comm: Communicator, **kwargs):
        super().__init__(trainable=False, **kwargs)
        self.comm = comm

    def call(self, x):
        if isinstance(x, tf.SparseTensor):
            raise TypeError(f"{self.name}: the data-parallel tail cannot read a sparse input")
        lo, hi = shard_rows(tf.shape(x, out_type=tf.int64)[0], self.comm.rank, self.comm.world_size)
        return x[lo:hi]


class GatherRows(tf.keras.layers.Layer):
    """The whole batch of a model output computed on each process's rows (``gather_rows``)."""

    def __init__(self, comm: Communicator, collective: str, **kwargs):
        super().__init__(trainable=False, **kwargs)
        self.comm, self.collective = comm, collective

    def call(self, x):
        return gather_rows(self.comm, x, self.collective)


def sum_tail_gradients(model: tf.keras.Model, comm: Communicator, tail_variables: list) -> None:
    """Make the optimizer that ``model`` is compiled with (now and at every later ``compile``)
    sum the gradients of ``tail_variables`` over processes before it applies them: one fused
    allreduce ``des_tail_gradients`` per step, counted under ``tail``. Other variables (the
    tables and kernel rows a process owns) keep their own gradients."""
    refs = {v.ref() for v in tail_variables}

    def wrap(optimizer) -> None:
        if optimizer is None or getattr(optimizer, "_des_sums_tail", False):
            return
        apply = optimizer.apply_gradients

        def apply_summed(grads_and_vars, *args, **kwargs):
            pairs = list(grads_and_vars)
            mine = [i for i, (g, v) in enumerate(pairs) if g is not None and v.ref() in refs]
            if mine:
                grads = [tf.reshape(tf.convert_to_tensor(pairs[i][0]), pairs[i][1].shape) for i in mine]
                # after every other gradient (those of owned rows wait for the all-gather of the
                # backward): one order of collectives on every process, whatever the scheduler does
                others = [g for g, v in pairs if g is not None and v.ref() not in refs]
                with tf.control_dependencies(others):
                    flat = tf.concat([tf.reshape(tf.cast(g, tf.float32), [-1]) for g in grads], 0)
                total = comm.allreduce_counted(not_folded(comm, flat), "tail")
                parts = tf.split(total, [int(g.shape.num_elements()) for g in grads])
                for i, g, part in zip(mine, grads, parts):
                    pairs[i] = (tf.cast(tf.reshape(part, g.shape), g.dtype), pairs[i][1])
            return apply(pairs, *args, **kwargs)

        optimizer.apply_gradients = apply_summed
        optimizer._des_sums_tail = True

    compile_ = model.compile

    def compile_and_wrap(*args, **kwargs):
        compile_(*args, **kwargs)
        wrap(getattr(model, "optimizer", None))

    model.compile = compile_and_wrap
    wrap(getattr(model, "optimizer", None))


def count_tail_penalties_once(layers: list, rank: int) -> None:
    """Weight penalties (regularizers) of tail layers: every process adds their value to its loss
    (the same loss everywhere), but only rank 0 their gradient, since the tail's gradients are
    summed over processes."""
    if rank > 0:
        for layer in layers:
            stop_penalty_gradients(layer)


def batchwise(layers: list) -> list[str]:
    """Why ``layers`` give other results on a slice of the batch than on the whole (empty: they do
    not): a BatchNormalization's statistics, an activity regularizer's penalty on its rows."""
    why = []
    for layer in layers:
        for inner in [layer, *(m for m in layer.submodules if isinstance(m, tf.keras.layers.Layer))]:
            name = f"'{layer.name}'" + (f" holds '{inner.name}', which" if inner is not layer else "")
            if isinstance(inner, tf.keras.layers.BatchNormalization):
                why.append(f"{name} (BatchNormalization) computes statistics over the whole batch")
            if getattr(inner, "activity_regularizer", None):
                why.append(f"{name} has an activity regularizer (a penalty on its rows of the batch)")
    return why


def tail_obstacles(layers: list, tables: list[str], comm: Communicator) -> list[str]:
    """Why the tail made of ``layers`` cannot run data-parallel here (empty: it can)."""
    why = []
    if tables:
        why.append(f"the tail reads tables that are not substituted ({', '.join(tables)}): their sparse "
                   f"gradients would have to be gathered")
    why += batchwise(layers)
    for layer in layers:
        if any(w.dtype != tf.float32 for w in layer.trainable_weights):
            why.append(f"'{layer.name}' has weights that are not float32")
    if comm.world_size > 1 and type(comm).allgather is Communicator.allgather:
        why.append(f"the {comm.name} communicator has no all-gather")
    return why

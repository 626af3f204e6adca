"""Keras callbacks of the DES runtime: throughput, bytes per step, replica agreement, checkpoints."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np
import tensorflow as tf

from des.compiler.handle import distributed


class _StepClock(tf.keras.callbacks.Callback):
    """A clock read at each training step's begin and end; ``median`` over the steps after the
    first (which traces the graph). ``clock``: time.perf_counter (wall) or time.process_time (CPU)."""
    clock = staticmethod(time.perf_counter)

    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        self._t = self.clock()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(self.clock() - self._t)

    def median(self) -> float:
        t = self.times[1:] or self.times
        return float(np.median(t)) if t else 0.0


class Throughput(_StepClock):
    """Samples per second of training (median over batches after the first, which traces), and
    ``seconds_to_first_step``: from ``started`` (a time.perf_counter() reading) to the end of the
    first training step (reading the first batch, building, transforming and tracing the model);
    ``samples_per_second_by_epoch``: the same per epoch trained (a list, in the order trained).

        >>> speed = Throughput(100)          # model.fit(..., callbacks=[speed])
        >>> speed.times, speed.epochs = [9.0, 0.5, 0.5, 0.25, 0.2, 0.25], [0, 0, 0, 1, 1, 1]
        >>> speed.samples_per_second(), speed.samples_per_second_by_epoch()
        (400.0, [200.0, 400.0])
    """

    def __init__(self, batch_size: int, started: float | None = None):
        super().__init__()
        self.batch_size = batch_size
        self.started = time.perf_counter() if started is None else started
        self.seconds_to_first_step: float | None = None
        self.epochs: list[int] = []       # the epoch of each step in ``times``
        self._epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        super().on_train_batch_end(batch, logs)
        self.epochs.append(self._epoch)
        if self.seconds_to_first_step is None:
            self.seconds_to_first_step = time.perf_counter() - self.started

    def samples_per_second(self) -> float:
        t = self.median()
        return float(self.batch_size / t) if t else 0.0

    def samples_per_second_by_epoch(self) -> list[float]:
        """Per epoch trained, in order: the batch over the median time of its steps (the run's
        first step, which traces, left out unless it is its epoch's only step)."""
        out = []
        for epoch in dict.fromkeys(self.epochs):
            steps = [(k, t) for k, (t, e) in enumerate(zip(self.times, self.epochs)) if e == epoch]
            t = float(np.median([t for k, t in steps if k > 0] or [t for _, t in steps]))
            out.append(float(self.batch_size / t) if t else 0.0)
        return out


class BytesPerStep(tf.keras.callbacks.Callback):
    """Bytes handed to the DES allreduce per training step, from the communicator's counter."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm
        self.per_step: list[int] = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = int(self.comm.payload_bytes.numpy())

    def on_train_batch_end(self, batch, logs=None):
        self.per_step.append(int(self.comm.payload_bytes.numpy()) - self._start)

    def median(self) -> float:
        return float(np.median(self.per_step)) if self.per_step else 0.0


class WireBytes(tf.keras.callbacks.Callback):
    """Bytes this host put on its network interface per training step, from the kernel's counter
    (``/sys/class/net/IF/statistics/tx_bytes``): on the netbed (des.netbed) each process is alone
    on its host, so this is what it really sent - headers, MPI's algorithm and Horovod's own
    coordination messages included."""

    def __init__(self, interface: str):
        super().__init__()
        self.path = f"/sys/class/net/{interface}/statistics/tx_bytes"
        self.per_step: list[int] = []

    def _read(self) -> int:
        with open(self.path) as fh:
            return int(fh.read())

    def on_train_batch_begin(self, batch, logs=None):
        self._start = self._read()

    def on_train_batch_end(self, batch, logs=None):
        self.per_step.append(self._read() - self._start)

    def median(self) -> float:
        return float(np.median(self.per_step)) if self.per_step else 0.0


class CPUTime(_StepClock):
    """CPU seconds this process used per training step (every thread: TensorFlow's, Horovod's
    background thread, MPI's progress); ``median`` over the steps after the first. Next to the
    step's wall time it tells a CPU-bound step (CPU ~ the host's budget x the step) from one that
    waits on the wire (CPU well below it).

        >>> cpu = CPUTime()          # model.fit(..., callbacks=[cpu]); then cpu.median()
    """
    clock = staticmethod(time.process_time)


class ReplicaCheck(tf.keras.callbacks.Callback):
    """Every ``every`` steps, allreduce per-layer checksums of the replicated weights and, in
    the same allreduce, the fingerprint of the step's batch (des_ops DESFirstLayer, which computes
    it on the steps this callback arms, before each checked step); raise if processes disagree
    (names the step, and the layers or the batch)."""

    def __init__(self, comm, every: int):
        super().__init__()
        self.comm, self.every, self.step, self.checks = comm, every, 0, 0
        self._armed = None           # what this callback last set the DES layer's switch to

    def _des_layer(self):
        handle = distributed(self.model)
        return handle.layer if handle is not None else None

    def replicated_layers(self):
        des_layer = self._des_layer()
        return [l for l in self.model.layers if l.weights and l is not des_layer
                and not getattr(l, "des_embedding", False)]

    def check(self) -> None:
        layers = self.replicated_layers()
        des_layer = self._des_layer()
        own = np.array([_checksum(l) for l in layers] +
                       [float(des_layer.batch_fingerprint.numpy()) if des_layer is not None else 0.0], np.float64)
        table = np.zeros((self.comm.world_size, len(layers) + 1), np.float64)
        table[self.comm.rank] = own
        table = self.comm.allreduce_counted(tf.constant(table), "check").numpy()
        self.checks += 1
        if not np.all(table[:, -1] == table[0, -1]):
            raise RuntimeError(f"processes read different batches at step {self.step} (batch fingerprints per "
                               f"rank: {table[:, -1].tolist()}): every process must read the same batches in "
                               f"the same order (same files, --seed and --shuffle-buffer)")
        table = table[:, :-1].astype(np.float32)
        bad = [layers[j].name for j in range(len(layers)) if not np.all(table[:, j] == table[0, j])]
        if bad:
            raise RuntimeError(f"replicas diverged at step {self.step}: layers {bad} differ across "
                               f"processes (checksums per rank: {table[:, [l.name for l in layers].index(bad[0])]})")

    def on_train_batch_begin(self, batch, logs=None):
        # the DES layer fingerprints only the batches of the steps checked (its other steps skip it)
        des_layer = self._des_layer()
        armed = bool(self.every) and (self.step + 1) % self.every == 0
        if des_layer is not None and armed != self._armed:
            des_layer.fingerprint_armed.assign(armed)
            self._armed = armed

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.every and self.step % self.every == 0:
            self.check()

    def on_train_end(self, logs=None):
        des_layer = self._des_layer()
        if des_layer is not None and self._armed:        # a later fit without this check skips it again
            des_layer.fingerprint_armed.assign(False)
            self._armed = False


def _checksum(layer) -> float:
    """Sum of the weights of a replicated layer."""
    total = 0.0
    for w in layer.weights:
        total += float(tf.reduce_sum(tf.cast(w, tf.float64)).numpy())
    return total


class CounterDeltas(tf.keras.callbacks.Callback):
    """Per training step, how much each counter (a dict of int64 tf.Variables, scalars or vectors
    such as bytes per destination process) grew. The counters are read by one function call (a
    read per counter was ~85 eager operations a step on the PS's Python thread, 23 counters).

        >>> sent = tf.Variable([1, 2], dtype=tf.int64)                 # e.g. bytes per destination
        >>> c = CounterDeltas({"bytes": tf.Variable(5, dtype=tf.int64), "sent": sent})
        >>> c.on_train_batch_begin(0); _ = c.counters["sent"].assign_add([3, 0]); c.on_train_batch_end(0)
        >>> c.steps
        [{'bytes': 0, 'sent': [3, 0]}]
    """

    def __init__(self, counters: dict):
        super().__init__()
        self.counters = counters
        self.steps: list[dict] = []
        self._read_all = tf.function(lambda: {k: tf.identity(v) for k, v in counters.items()})

    def _read(self) -> dict:
        return {k: v.numpy() for k, v in self._read_all().items()}

    def on_train_batch_begin(self, batch, logs=None):
        self._start = self._read()

    def on_train_batch_end(self, batch, logs=None):
        now = self._read()
        self.steps.append({k: int(now[k] - self._start[k]) if np.ndim(now[k]) == 0 else (now[k] - self._start[k]).tolist()
                           for k in now})

    def median(self, key: str) -> float:
        return float(np.median([s[key] for s in self.steps])) if self.steps else 0.0


class PeriodicCheckpoint(tf.keras.callbacks.Callback):
    """Save every ``steps`` training steps (counted over epochs), or every ``seconds`` of training, and at every epoch's end, with the data position: ``save({"epoch": e, "step": s})``
    where s batches of epoch e are done.

    A save due after a step runs before the next step (or at the epoch's end, as the start of
    the next epoch), so a checkpoint never points past the end of an epoch. By time, the
    processes agree at the same steps: ``sum_across([late, gap])`` (every process calls it at
    the same step; des.jobs.modes) says whether any process's clock has passed the interval, and
    rank 0's measured step time sets how many steps to the next such call (about ten per interval).
    The clock starts after the run's first step (which traces the graph) and again at each save.

        >>> saved = []
        >>> every3 = PeriodicCheckpoint(saved.append, steps=3)
        >>> for b in range(7): every3.on_train_batch_begin(b); every3.on_train_batch_end(b)
        >>> saved
        [{'epoch': 0, 'step': 3}, {'epoch': 0, 'step': 6}]
    """
    PROBES = 10           # agreement calls per time interval

    def __init__(self, save, steps: int = 0, seconds: float = 0.0, epoch: int = 0, step: int = 0, *,
                 sum_across: Callable[[list[float]], list[float]] = list, rank: int = 0,
                 clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.save, self.steps, self.seconds = save, steps, seconds
        self.sum_across, self.rank, self.clock = sum_across, rank, clock
        self.epoch, self.step, self.due, self.saves, self.total = epoch, step, False, 0, 0
        self.seconds_by_save: list[float] = []          # wall seconds of each save, in order
        self.last = self.probed = clock()
        self.next_probe, self.probed_total = 1, 0

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self.epoch:
            self.epoch, self.step = epoch, 0

    def on_train_batch_begin(self, batch, logs=None):
        if self.due:
            self._save(self.epoch, self.step)

    def on_train_batch_end(self, batch, logs=None):
        self.step, self.total = self.step + 1, self.total + 1
        if self.total == 1:                       # the clock starts after the first step, which traces
            self.last = self.probed = self.clock()
            self.probed_total, self.next_probe = 1, 2
        self.due = self.steps > 0 and self.total % self.steps == 0
        if self.seconds and self.total >= self.next_probe:
            self._probe()

    def _probe(self) -> None:
        """Agree on whether the interval has passed and on the steps to the next agreement."""
        now = self.clock()
        per_step = (now - self.probed) / max(1, self.total - self.probed_total)
        gap = max(1, int(self.seconds / self.PROBES / max(per_step, 1e-9))) if self.rank == 0 else 0
        late, gap = self.sum_across([float(now - self.last >= self.seconds), float(gap)])
        self.due = self.due or late > 0
        self.next_probe, self.probed, self.probed_total = self.total + max(1, int(gap)), now, self.total

    def on_epoch_end(self, epoch, logs=None):
        self._save(epoch + 1, 0)
        self.epoch, self.step = epoch + 1, 0

    def _save(self, epoch: int, step: int) -> None:
        began = time.perf_counter()
        self.save({"epoch": epoch, "step": step})
        self.seconds_by_save.append(time.perf_counter() - began)
        self.due, self.saves, self.last = False, self.saves + 1, self.clock()

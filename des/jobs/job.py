"""One training job of des.train: read the layout, build the mode, check the inputs, train,
evaluate and write the summary. ``des.jobs.train.main`` parses the options and calls ``run``; the
heavy imports (TensorFlow, the modes) happen here, after the options are checked.
"""
from __future__ import annotations

import json
import os
import resource
import sys
import time

import tensorflow as tf

import models
from des.runtime import checkpoint
from des.runtime.bounded import bound_rows, table_rows
from des.jobs import modes
from des.runtime.callbacks import CPUTime, PeriodicCheckpoint, Throughput, WireBytes
from des.jobs.config import RunConfig
from des.data import DataError, SkipReport
from des.data.errors import op_error_message
from des.jobs.inputs import JobInputs, bayes_auc
from des.compiler.handle import distributed
from des.compiler.keys import create_slots
from des_ops.comm import launcher_rank


def _config(a, spec) -> dict:
    """What a checkpoint of this run is: written to config.json, checked on --restore."""
    return {"model": a.model, "mode": a.mode, "format": a.format, "dim": a.dim, "hidden": a.hidden,
            "seed": a.seed, "optimizer": a.optimizer, "linear_optimizer": a.linear_optimizer,
            "spec": json.loads(spec.to_json())}


class _Stop(Exception):
    """des.train ends with exit status 2; the message was printed where the problem was met."""


def _fail(message: str, once: bool = True) -> _Stop:
    """Print ``error: message`` (by rank 0 only when every process meets it alike) and stop."""
    if once:
        print_once(f"error: {message}")
    else:
        print(f"error: {message}", file=sys.stderr)
    return _Stop()


def run(config: RunConfig, started: float) -> int:
    """Train as ``config`` says; the exit status (2: a problem the job printed)."""
    if config.threads:
        tf.config.threading.set_intra_op_parallelism_threads(config.threads)
        tf.config.threading.set_inter_op_parallelism_threads(config.threads)
    try:
        job = _Job.start(config, started)
        return job.train()
    except _Stop:
        return 2


class _Job:
    """One des.train run from its checked configuration: data, mode, model, fit, summary."""

    @classmethod
    def start(cls, config: RunConfig, started: float) -> "_Job":
        """Read the data's layout and the first batch, make the mode and build the model (or stop)."""
        job = cls()
        job.started = started
        job._read_layout(config)
        job._make_mode()
        job._check_inputs()
        job._build()
        return job

    def _read_layout(self, config: RunConfig) -> None:
        """The data's format, spec and the split into training and evaluation lines (des.jobs.inputs)."""
        try:
            self.inputs = JobInputs.read(config)
        except (FileNotFoundError, DataError) as e:
            raise _fail(str(e)) from None
        for message in self.inputs.messages:
            print_once(message)
        self.config, self.meta, self.spec = self.inputs.config, self.inputs.meta, self.inputs.spec
        self.eval_name, self.n_train = self.inputs.eval_name, self.inputs.n_train
        if config.checkpoint_every and not config.checkpoint:
            raise _fail("--checkpoint-every needs --checkpoint FOLDER", once=False)

    def _make_mode(self) -> None:
        a, spec, first_lines = self.config, self.spec, self.inputs.first_lines
        self.run = modes.Run(a, spec, lambda: first_lines(a.batch),
                             lambda: models.build(a.model, spec, seed=a.seed, hidden=a.hidden_units),
                             read_lines=first_lines)
        try:
            self.mode = modes.make(a.mode, self.run)     # --mode auto: des or ps (des.jobs.auto), from the first batch
        except (DataError, FileNotFoundError, modes.ModeError) as e:
            raise _fail(str(e)) from None
        self.config = self.run.config                    # with the mode --mode auto chose
        self.rank0 = self.mode.rank == 0
        self.log = self.run.log = (lambda *m: print(*m, flush=True)) if self.rank0 else (lambda *m: None)
        self.skips = SkipReport()
        self.global_batch = self.mode.global_batch

    def train_data(self, epoch: int, shard):
        """The batches of one epoch: shuffled by (seed, epoch), so a resumed job sees the
        same order as an uninterrupted one."""
        a = self.config
        return self.inputs.training(a, self.global_batch, modes.epoch_seed(a.seed, epoch), self.mode.read_inputs(),
                                    shard, self.skips)

    def evaluation_data(self):
        """The evaluation batches, or None."""
        return self.inputs.evaluation(self.config, self.global_batch, self.mode.read_inputs(), self.mode.eval_shard(),
                                      self.skips)

    def _check_inputs(self) -> None:
        """A bad path, format or line among the first, before the model is built and traced;
        then where a restored job continues."""
        try:
            self.train_data(0, self.mode.eval_shard())
            self.evaluation_data()
            if not self.config.skip_bad_lines:
                self.run.first_batch()
        except (DataError, FileNotFoundError) as e:
            raise _fail(str(e)) from None
        except tf.errors.OpError as e:
            raise _fail(op_error_message(e)) from None
        self.start = {"epoch": 0, "step": 0}
        a = self.config
        if a.restore:
            try:
                checkpoint.check_config(a.restore, _config(a, self.spec))
                self.start, seed = _start_position(a, checkpoint.load_config(a.restore), self.global_batch)
            except ValueError as e:
                raise _fail(str(e)) from None
            self.config = a.replace(seed=seed)

    def _build(self) -> None:
        """The mode's model, compiled, its optimizer's slots made (and restored with --restore)."""
        a, mode = self.config, self.mode
        if mode.auto is not None:
            self.log(mode.auto)
        try:
            model = mode.prepare(self.run.reference_model())
        except (DataError, modes.ModeError) as e:
            raise _fail(str(e)) from None
        if a.row_policy.active and not hasattr(model, "des_row_states"):     # des.transform bounds its own
            bound_rows(model, a.row_policy)
        optimizer = models.make_optimizer(a.optimizer, a.lr, linear=a.linear_optimizer,
                                          linear_learning_rate=a.linear_lr)
        model.compile(optimizer, "binary_crossentropy",
                      metrics=[tf.keras.metrics.AUC(num_thresholds=10_000, name="auc"),
                               tf.keras.metrics.BinaryCrossentropy(name="logloss")])
        create_slots(model, optimizer)      # before the first step: Keras traces the step once, not twice
        self.restore_seconds = None
        if a.restore:
            began = time.perf_counter()
            try:
                path = checkpoint.restore(a.restore, model, optimizer, mode.rank, mode.world_size)
            except checkpoint.CheckpointError as e:
                raise _fail(str(e), once=False) from None
            self.restore_seconds = time.perf_counter() - began
            self.log(f"restored {path}; continuing at epoch {self.start['epoch'] + 1}, step {self.start['step']}")
        self.model, self.optimizer = model, optimizer

    def _callbacks(self) -> list:
        a, mode, model = self.config, self.mode, self.model
        self.speed, self.cpu, self.curve = Throughput(self.global_batch, self.started), CPUTime(), _AucCurve()
        callbacks = [self.speed, self.cpu, self.curve] + mode.callbacks(model)
        self.wire = self.saver = self.rss_before_save = None
        if os.environ.get("DES_WIRE_INTERFACE"):        # set by des.netbed: one process per emulated host
            self.wire = WireBytes(os.environ["DES_WIRE_INTERFACE"])
            callbacks.append(self.wire)
        if a.checkpoint:
            barrier = mode.barrier()
            handle = distributed(model)
            plan = handle.plan if handle is not None else None

            def save(pos: dict) -> None:
                if self.rss_before_save is None:          # the training's own peak, before a save's exports
                    self.rss_before_save = _peak_rss_mib()
                mode.flush(model)
                checkpoint.save(a.checkpoint, model, self.optimizer, plan, mode.rank, mode.world_size,
                                config=_config(a, self.spec),
                                position=dict(pos, seed=a.seed, global_batch=self.global_batch), barrier=barrier)

            self.saver = PeriodicCheckpoint(
                save,
                a.checkpoint_every.steps, a.checkpoint_every.seconds, self.start["epoch"], self.start["step"],
                sum_across=mode.sum_across, rank=mode.rank)
            callbacks.append(self.saver)
        if a.fail_at_step is not None and mode.rank == mode.world_size - 1:
            callbacks.append(_FailAt(a.fail_at_step))
        return callbacks

    def train(self) -> int:
        """fit epoch by epoch from the start position, evaluate, summarise."""
        a, mode, model = self.config, self.mode, self.model
        evald = self.evaluation_data()
        callbacks = self._callbacks()
        self.log(f"training {a.model} ({a.mode}, {mode.world_size} process(es)) on "
                 f"{'all lines of --data' if self.n_train is None else f'{self.n_train} lines'}, evaluating on "
                 f"{self.eval_name}; batch {a.batch}, optimizer {a.optimizer}"
                 f"{f' ({a.linear_optimizer} on the linear part)' if a.linear_optimizer else ''}")
        try:
            verbose = (1 if sys.stdout.isatty() else 2) if self.rank0 else 0
            if self.start["epoch"] >= a.epochs:
                self.log(f"the checkpoint has {self.start['epoch']} epoch(s) done; --epochs {a.epochs}: "
                         f"nothing to train")
            for epoch in range(self.start["epoch"], a.epochs):
                skip = self.start["step"] if epoch == self.start["epoch"] else 0
                steps = None if a.steps is None else a.steps - skip
                if steps is not None and steps <= 0:
                    continue
                data = self.train_data(epoch, mode.train_shard(epoch))
                if skip:
                    data = data.skip(skip)
                    try:
                        left = batches_left(data, mode)
                    except ValueError as e:
                        raise _fail(f"epoch {epoch + 1} after step {skip}: {e}", once=False) from None
                    if not left:
                        self.log(f"epoch {epoch + 1} has no batch after step {skip} (the checkpoint was at its "
                                 f"end): going on with the next")
                        if self.saver is not None:
                            self.saver.on_epoch_end(epoch)       # the epoch's end, as the uninterrupted run saved it
                        continue
                model.fit(data, initial_epoch=epoch, epochs=epoch + 1,
                          steps_per_epoch=steps, verbose=verbose, callbacks=callbacks)
            result = mode.evaluate(model, evald) if evald is not None else {}
        except tf.errors.OpError as e:
            print(f"error: {op_error_message(e)}", file=sys.stderr)
            return 2
        self._summarise(result, evald is not None)
        return 0

    def _summarise(self, result: dict, evaluated: bool) -> None:
        a, mode, log = self.config, self.mode, self.log
        read = mode.read_inputs()
        summary = {"model": a.model, "mode": a.mode, "world_size": mode.world_size,
                   "auc": result.get("auc"), "logloss": result.get("logloss"),
                   "samples_per_second": self.speed.samples_per_second(), "cpu_seconds_per_step": self.cpu.median(),
                   "samples_per_second_by_epoch": self.speed.samples_per_second_by_epoch(),
                   "tail": a.tail, "seconds_to_first_step": self.speed.seconds_to_first_step,
                   "bayes_auc": bayes_auc(a, self.meta), "bad_lines_skipped": self.skips.total,
                   "global_batch": self.global_batch, "train_auc_by_step": self.curve.points,
                   "peak_rss_mib": _peak_rss_mib(),
                   "inputs_read": len(read) if read is not None else len(self.spec.input_names()),
                   "options": a.to_argv()}       # what ran: every option off its default
        if mode.auto is not None:
            summary["auto"] = {"chosen": mode.auto.mode, "des_bytes_estimate": mode.auto.des_bytes,
                               "ps_bytes_estimate": mode.auto.ps_bytes}
        summary["table_rows"] = table_rows(self.model)
        rows = summary["table_rows"]
        log(f"table rows on this process: {rows['held']:,} held" + (
            f" ({rows['admitted']:,} admitted, {rows['evicted']:,} evicted, {rows['counting']:,} keys counted without "
            f"a row; {a.row_policy})" if a.row_policy.active else "") + f"; peak RSS {summary['peak_rss_mib']:.0f} MiB")
        mode.summarise(self.model, summary)
        if self.saver is not None and self.saver.saves:
            summary.update(checkpoint_save_seconds=self.saver.seconds_by_save,
                           peak_rss_mib_before_first_save=self.rss_before_save)
        if self.restore_seconds is not None:
            summary["restore_seconds"] = self.restore_seconds
        if self.wire is not None:
            summary["wire_bytes_per_step"] = self.wire.median()
            log(f"bytes/step this host sent on its interface (measured, {os.environ['DES_WIRE_INTERFACE']}): "
                f"{summary['wire_bytes_per_step']:.0f}")
        if a.skip_bad_lines:
            log(str(self.skips))
        if evaluated:
            log(f"AUC {summary['auc']:.4f} (Bayes-optimal {summary['bayes_auc'] or 'unknown'}), "
                f"log loss {summary['logloss']:.4f} on {self.eval_name}")
        log(f"first step done {summary['seconds_to_first_step'] or 0:.1f} s after start; "
            f"{summary['samples_per_second']:.0f} samples/s (global batch {self.global_batch} / median step time); "
            f"{summary['cpu_seconds_per_step']:.3f} CPU s per step on this process (median)")
        if self.saver is not None and self.saver.saves:
            log(f"checkpoint written to {a.checkpoint} ({self.saver.saves} save(s); the last at epoch "
                f"{self.saver.epoch}, step {self.saver.step})")
        if a.summary_json:
            path = a.summary_json if mode.world_size == 1 else f"{a.summary_json}.rank{mode.rank}"
            with open(path, "w") as fh:
                json.dump(summary, fh, indent=1)


def batches_left(data: tf.data.Dataset, mode) -> bool:
    """Whether the rest of a resumed epoch (``data``, its done batches skipped) has a batch, on
    every process: a checkpoint can fall on an epoch's last step (a save due after a step runs
    before the next one, which the data then lacked), and Keras refuses an empty epoch. One small
    sum over the processes (``mode.sum_across``, called by all), so all of them go on alike; a
    ValueError names the ranks when some have batches left and others not. It reads the skipped
    batches once more (their order is stateless: fit then reads the same ones).

        >>> class One: rank, world_size, sum_across = 0, 1, staticmethod(list)
        >>> batches_left(tf.data.Dataset.range(3).skip(3), One()), batches_left(tf.data.Dataset.range(3).skip(2), One())
        (False, True)
    """
    mine = [0.0] * mode.world_size
    mine[mode.rank] = float(any(True for _ in data.take(1)))
    having = mode.sum_across(mine)
    if all(having) or not any(having):
        return bool(all(having))
    raise ValueError(f"the data of rank(s) {[r for r, h in enumerate(having) if h]} has batches left, "
                     f"that of rank(s) {[r for r, h in enumerate(having) if not h]} none")


def _start_position(a: RunConfig, saved: dict, global_batch: int) -> tuple[dict, int]:
    """Where a restored job continues: the checkpoint's epoch and step, and its shuffle seed."""
    pos = saved.get("position") or {}
    start = {"epoch": int(pos.get("epoch", 0)), "step": int(pos.get("step", 0))}
    if start["step"] and pos.get("global_batch") not in (None, global_batch):
        raise ValueError(f"{a.restore}: saved in the middle of epoch {start['epoch'] + 1} with a global batch "
                         f"of {pos['global_batch']}; this run's is {global_batch}: resume with the same "
                         f"batch (or from a checkpoint at an epoch's end)")
    return start, int(pos.get("seed", a.seed))


def print_once(message: str) -> None:
    """An error every process meets alike (options, the data's layout, the spec): printed by
    the launcher's rank 0 only, not once per process."""
    if launcher_rank()[0] == 0:
        print(message, file=sys.stderr)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _AucCurve():
    """Running training AUC of the epoch (Keras logs) every few steps: [(step, auc), ...]."""

    class Curve(tf.keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.points, self.step = [], 0

        def on_train_batch_end(self, batch, logs=None):
            self.step += 1
            if logs and "auc" in logs and (self.step <= 10 or self.step % 5 == 0):
                self.points.append((self.step, float(logs["auc"])))
    return Curve()


class _FailAt:
    """Test hook: the last rank dies hard at a given step (to check the job does not hang)."""

    def __new__(cls, step):

        class Fail(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch + 1 >= step:
                    print(f"--fail-at-step {step}: this rank exits with code 17", file=sys.stderr, flush=True)
                    os._exit(17)
        return Fail()

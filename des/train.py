"""Train a reference model, single-process or with DES under mpirun.

    python -m des.train --model deepfm --data train.txt --format criteo
    mpirun -np 4 python -m des.train --mode des --model deepfm --data train.txt

The last ``--holdout`` lines are held out for AUC / log loss (or ``--eval-data FILE`` is
evaluated, and all of ``--data`` trains without a line-count pass). Under DES every process
reads the same batches; logs and the progress bar come from rank 0 only.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from des.timemodel import parse_rate


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    from des.modes import MODES
    ap.add_argument("--mode", choices=[*MODES, "auto"], default="single",
                    help="des: field-partitioned first layers; ps: tables sharded by key (baseline); "
                         "cache: ps plus HET's bounded-staleness embedding cache on every worker; "
                         "auto: des or ps, whichever moves fewer bytes on the first batch (des.auto)")
    ap.add_argument("--staleness", default="100", metavar="S",
                    help="cache: a cached row is read while it lacks at most S of its owner's updates, and "
                         "a row's updates are pushed every max(S, 1) of them; 0: exact (= ps); inf: never "
                         "re-read (the asynchronous limit)")
    ap.add_argument("--cache-size", default="10%", metavar="ROWS|FRACTION",
                    help="cache: rows per table and process (e.g. 5000), or a fraction (0.1 / 10%%) of each "
                         "field's cardinality")
    ap.add_argument("--eviction", choices=["lru", "lfu"], default="lru", help="cache: which rows leave a full cache")
    ap.add_argument("--ps-batch", choices=["global", "per-process"], default="global",
                    help="ps, cache: each process reads batch/N rows of every global batch (global), "
                         "or batch rows of a global batch of N*batch (per-process)")
    ap.add_argument("--allocate", choices=["contiguous", "random", "laia"], default="contiguous",
                    help="ps, cache: which process trains which sample of a global batch (des.allocate): "
                         "contiguous slices, a seeded random split, or laia (Herald's locality-aware "
                         "allocation: samples go where their keys are owned or cached); exact in every case")
    ap.add_argument("--allocate-top-k", type=int, default=None, metavar="K",
                    help="laia: score only the K inputs with the most distinct ids in the first batch "
                         "(Herald's top-k; faster on data with many inputs, a little less locality)")
    ap.add_argument("--on-demand", action="store_true",
                    help="cache at --staleness 0: no queries; every process knows from the allocation which "
                         "keys the others update, and asks only for rows it lacks or holds outdated (exact)")
    ap.add_argument("--plan-pushes", action="store_true",
                    help="with --on-demand and plain SGD: Herald's plan pushes - an update stays in its worker's "
                         "cache line until another process reads the key (exact, fewer rows pushed)")
    ap.add_argument("--model", default="deepfm", choices=["lr", "fm", "dnn", "wdl", "deepfm"])
    ap.add_argument("--data", required=True, nargs="+", help="input files (.gz allowed)")
    ap.add_argument("--format", default=None, choices=["criteo", "avazu", "libsvm", "libffm", "columnar"],
                    help="default: columnar for a folder written by des.data.convert (a DES process then "
                         "reads only its own fields' columns), else the format in <data>.meta.json, else criteo")
    ap.add_argument("--libsvm-layout", default="auto", choices=["auto", "positional", "bag"],
                    help="libsvm: positional (the k-th feature of a line is field k), bag (one field of all "
                         "features) or auto (positional when every line has as many features, else stop and ask)")
    ap.add_argument("--holdout", type=float, default=0.1,
                    help="held-out lines at the end: a fraction (<1) or a count")
    ap.add_argument("--eval-data", nargs="+", default=None,
                    help="evaluate on these files (same format) instead of holding out lines of --data")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--epochs", type=int, default=1,
                    help="epochs in total: with --restore, training continues from the saved epoch/step")
    ap.add_argument("--steps", type=int, default=None, help="stop each epoch after this many steps")
    ap.add_argument("--optimizer", default="adam", choices=["sgd", "adagrad", "adam", "ftrl"])
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--linear-optimizer", default=None, choices=["sgd", "adagrad", "adam", "ftrl"],
                    help="another optimizer for the linear part (sparse linear sum, bias), e.g. ftrl")
    ap.add_argument("--linear-lr", type=float, default=None)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--shuffle-buffer", type=int, default=50_000)
    ap.add_argument("--skip-bad-lines", action="store_true", help="drop and count malformed lines")
    ap.add_argument("--plan", default="balanced", choices=["balanced", "mod"])
    ap.add_argument("--tables", default=None, choices=["fused", "per-field"],
                    help="single, des and ps: a process keeps its fields' rows of one width in one TFRA table "
                         "(fused, their default; the PS then does one set of all-to-alls per width and step) or one "
                         "table per field (per-field: single trains the model untouched); cache keeps one table per "
                         "field")
    ap.add_argument("--tail", default="replicated", choices=["replicated", "data_parallel", "auto"],
                    help="des: every process runs the layers after the first one on the whole batch (replicated) "
                         "or on its own rows of it (data_parallel: less computation per process, two all-gathers "
                         "and one gradient allreduce more; the same results); auto: the cost model picks one for "
                         "--batch and the report says why")
    ap.add_argument("--link", default="10gbit",
                    help="--tail auto: each process's network rate (tc units, e.g. 100mbit) the cost model assumes")
    ap.add_argument("--comm", default="auto", choices=["auto", "horovod", "mpi4py", "local", "noop", "sync", "meet"],
                    help="noop: the launcher's rank and size but no collective (times the computation "
                         "alone, for des.timemodel; results are not the model's); sync: the same, but each "
                         "step waits for every process (one 4-byte allreduce), as training does; meet: "
                         "every collective is a real call without its payload (the PS's all-to-alls of no "
                         "rows): the computation with every meeting and wait, but no bytes")
    ap.add_argument("--replica-check", type=int, default=100, metavar="K",
                    help="DES: every K steps check that replicated weights agree and that every process "
                         "read the same batch, in one small allreduce (0: off)")
    ap.add_argument("--checkpoint", default=None, help="save to this folder at every epoch's end")
    ap.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                    help="also save every K training steps (needs --checkpoint)")
    ap.add_argument("--restore", default=None,
                    help="start from this checkpoint (any mode, any number of processes) and continue "
                         "at its epoch and step")
    ap.add_argument("--check-bytes", type=int, default=20, metavar="K",
                    help="ps: recompute the analytic bytes of the first K steps and compare")
    ap.add_argument("--threads", type=int, default=0, help="TF intra/inter-op threads (0: TF default)")
    ap.add_argument("--summary-json", default=None,
                    help="write the results here (with several processes: PATH.rank<r> each)")
    ap.add_argument("--fail-at-step", type=int, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    try:
        parse_rate(a.link)
    except ValueError as e:
        ap.error(f"--link: {e}")
    return a


def count_lines(paths) -> int:
    import gzip
    from des.data import columnar
    if columnar.is_columnar(paths):
        return int(columnar.manifest(paths[0])["rows"])
    n = 0
    for p in paths:
        with (gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")) as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                n += block.count(b"\n")
    return n


def _config(a, spec) -> dict:
    """What a checkpoint of this run is: written to config.json, checked on --restore."""
    return {"model": a.model, "mode": a.mode, "format": a.format, "dim": a.dim, "hidden": a.hidden,
            "seed": a.seed, "optimizer": a.optimizer, "linear_optimizer": a.linear_optimizer,
            "spec": json.loads(spec.to_json())}


def main(argv=None) -> int:
    started = time.perf_counter()
    a = _args(argv)
    import des  # noqa: F401 - first: it quiets TF logs before TF loads
    import tensorflow as tf
    if a.threads:
        tf.config.threading.set_intra_op_parallelism_threads(a.threads)
        tf.config.threading.set_inter_op_parallelism_threads(a.threads)
    import models
    from des import checkpoint, modes
    from des.state import create_slots
    from des.callbacks import CPUTime, Throughput
    from des.data import DataError, SkipReport
    from des.data.errors import op_error_message

    from des.data import columnar
    from des.data.resolve import metadata
    meta = metadata(a.data[0])
    if a.format in (None, "columnar") and columnar.is_columnar(a.data):
        a.format, meta = "columnar", columnar.manifest(a.data[0])
    a.format = a.format or meta.get("format", "criteo")
    try:
        spec = _spec(a, meta)
        if a.format in ("libsvm", "libffm") and not meta.get("spec"):
            from des.data.resolve import describe
            print_once(f"{a.format}: scanned {', '.join(a.data)}: {describe(spec)}")
        header = 1 if a.format == "avazu" else 0
        total = None if a.eval_data else count_lines(a.data) - header * len(a.data)
    except (FileNotFoundError, DataError) as e:
        print_once(f"error: {e}")
        return 2
    if total is not None and total <= 0:
        print_once(f"error: {a.data[0]}: file is empty")
        return 2
    if a.eval_data:  # train on every line of --data; no counting pass
        held, n_train, eval_files, eval_skip = 0, None, a.eval_data, 0
        eval_name = " ".join(a.eval_data)
    else:
        held = int(a.holdout * total) if a.holdout < 1 else int(a.holdout)
        n_train, eval_files, eval_skip = total - held, a.data, total - held
        eval_name = f"{held} held-out lines"
    if a.checkpoint_every and not a.checkpoint:
        print("error: --checkpoint-every needs --checkpoint FOLDER", file=sys.stderr)
        return 2

    def first_lines(n: int) -> dict:
        return next(iter(_dataset(a, spec, n, take_lines=min(n, n_train or n))))[0]
    run = modes.Run(a, spec, lambda: first_lines(a.batch),
                    lambda: models.build(a.model, spec, seed=a.seed, hidden=_hidden(a)), read_lines=first_lines)
    try:
        mode = modes.make(a.mode, run)     # --mode auto: des or ps (des.auto), from the first batch
    except (DataError, FileNotFoundError, modes.ModeError) as e:
        print_once(f"error: {e}")
        return 2
    rank0 = mode.rank == 0
    log = run.log = (lambda *m: print(*m, flush=True)) if rank0 else (lambda *m: None)

    skips = SkipReport()
    common = dict(skip_bad_lines=a.skip_bad_lines, skip_report=skips)
    global_batch = mode.global_batch

    def train(epoch: int, shard):
        """The batches of one epoch: shuffled by (seed, epoch), so a resumed job sees the
        same order as an uninterrupted one."""
        return _dataset(a, spec, global_batch, shuffle_buffer=a.shuffle_buffer, inputs=mode.read_inputs(),
                        seed=modes.epoch_seed(a.seed, epoch), take_lines=n_train, shard=shard, **common)

    def evaluation():
        return _dataset(a, spec, max(global_batch, 4096), eval_files, skip_lines=eval_skip,
                        inputs=mode.read_inputs(), shard=mode.eval_shard(), **common) if (held or a.eval_data) else None
    try:
        train(0, mode.eval_shard())   # reports a bad path or format now
        evaluation()
        if not a.skip_bad_lines:
            run.first_batch()         # and a bad line among the first, before the model is built and traced
    except (DataError, FileNotFoundError) as e:
        print_once(f"error: {e}")
        return 2
    except tf.errors.OpError as e:
        print_once(f"error: {op_error_message(e)}")
        return 2

    start = {"epoch": 0, "step": 0}
    if a.restore:
        try:
            checkpoint.check_config(a.restore, _config(a, spec))
            start = _start_position(a, checkpoint.load_config(a.restore), global_batch)
        except ValueError as e:
            print_once(f"error: {e}")
            return 2
    if mode.auto is not None:
        log(mode.auto)
    try:
        model = mode.prepare(run.reference_model())
    except (DataError, modes.ModeError) as e:
        print_once(f"error: {e}")
        return 2
    optimizer = models.make_optimizer(a.optimizer, a.lr, linear=a.linear_optimizer,
                                      linear_learning_rate=a.linear_lr)
    model.compile(optimizer, "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(num_thresholds=10_000, name="auc"),
                           tf.keras.metrics.BinaryCrossentropy(name="logloss")])
    create_slots(model, optimizer)      # before the first step: Keras traces the step once, not twice
    if a.restore:
        try:
            path = checkpoint.restore(a.restore, model, optimizer, mode.rank, mode.world_size)
        except checkpoint.CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        log(f"restored {path}; continuing at epoch {start['epoch'] + 1}, step {start['step']}")

    evald = evaluation()
    speed = Throughput(global_batch, started)
    curve = _AucCurve()
    cpu = CPUTime()
    callbacks = [speed, cpu, curve] + mode.callbacks(model)
    wire = None
    if os.environ.get("DES_WIRE_INTERFACE"):        # set by des.netbed: one process per emulated host
        from des.callbacks import WireBytes
        wire = WireBytes(os.environ["DES_WIRE_INTERFACE"])
        callbacks.append(wire)
    saver = None
    if a.checkpoint:
        from des.callbacks import PeriodicCheckpoint
        barrier = mode.barrier()
        saver = PeriodicCheckpoint(
            lambda pos: mode.flush(model) or checkpoint.save(
                a.checkpoint, model, optimizer, getattr(model, "des_plan", None), mode.rank, mode.world_size,
                config=_config(a, spec), position=dict(pos, seed=a.seed, global_batch=global_batch),
                barrier=barrier),
            a.checkpoint_every, start["epoch"], start["step"])
        callbacks.append(saver)
    if a.fail_at_step is not None and mode.rank == mode.world_size - 1:
        callbacks.append(_FailAt(a.fail_at_step))
    log(f"training {a.model} ({a.mode}, {mode.world_size} process(es)) on "
        f"{'all lines of --data' if n_train is None else f'{n_train} lines'}, evaluating on {eval_name}; "
        f"batch {a.batch}, optimizer {a.optimizer}"
        f"{f' ({a.linear_optimizer} on the linear part)' if a.linear_optimizer else ''}")
    try:
        verbose = (1 if sys.stdout.isatty() else 2) if rank0 else 0
        if start["epoch"] >= a.epochs:
            log(f"the checkpoint has {start['epoch']} epoch(s) done; --epochs {a.epochs}: nothing to train")
        for epoch in range(start["epoch"], a.epochs):
            skip = start["step"] if epoch == start["epoch"] else 0
            steps = None if a.steps is None else a.steps - skip
            if steps is not None and steps <= 0:
                continue
            data = train(epoch, mode.train_shard(epoch))
            model.fit(data.skip(skip) if skip else data, initial_epoch=epoch, epochs=epoch + 1,
                      steps_per_epoch=steps, verbose=verbose, callbacks=callbacks)
        result = mode.evaluate(model, evald) if evald is not None else {}
    except tf.errors.OpError as e:
        print(f"error: {op_error_message(e)}", file=sys.stderr)
        return 2
    read = mode.read_inputs()
    summary = {"model": a.model, "mode": a.mode, "world_size": mode.world_size,
               "auc": result.get("auc"), "logloss": result.get("logloss"),
               "samples_per_second": speed.samples_per_second(), "cpu_seconds_per_step": cpu.median(),
               "tail": getattr(a, "tail", "replicated"),
               "seconds_to_first_step": speed.seconds_to_first_step,
               "bayes_auc": _bayes_auc(a, meta),
               "bad_lines_skipped": skips.total, "global_batch": global_batch,
               "train_auc_by_step": curve.points, "peak_rss_mib": _peak_rss_mib(),
               "inputs_read": len(read) if read is not None else len(spec.input_names())}
    if mode.auto is not None:
        summary["auto"] = {"chosen": mode.auto.mode, "des_bytes_estimate": mode.auto.des_bytes,
                           "ps_bytes_estimate": mode.auto.ps_bytes}
    mode.summarise(model, summary)
    if wire is not None:
        summary["wire_bytes_per_step"] = wire.median()
        log(f"bytes/step this host sent on its interface (measured, {os.environ['DES_WIRE_INTERFACE']}): "
            f"{summary['wire_bytes_per_step']:.0f}")
    if a.skip_bad_lines:
        log(str(skips))
    if evald is not None:
        log(f"AUC {summary['auc']:.4f} (Bayes-optimal {summary['bayes_auc'] or 'unknown'}), "
            f"log loss {summary['logloss']:.4f} on {eval_name}")
    log(f"first step done {summary['seconds_to_first_step'] or 0:.1f} s after start; "
        f"{summary['samples_per_second']:.0f} samples/s (global batch {global_batch} / median step time); "
        f"{summary['cpu_seconds_per_step']:.3f} CPU s per step on this process (median)")
    if saver is not None and saver.saves:
        log(f"checkpoint written to {a.checkpoint} ({saver.saves} save(s); the last at epoch "
            f"{saver.epoch}, step {saver.step})")
    if a.summary_json:
        path = a.summary_json if mode.world_size == 1 else f"{a.summary_json}.rank{mode.rank}"
        with open(path, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 0


def _start_position(a, saved: dict, global_batch: int) -> dict:
    """Where a restored job continues: the checkpoint's epoch and step, with its shuffle seed."""
    pos = saved.get("position") or {}
    start = {"epoch": int(pos.get("epoch", 0)), "step": int(pos.get("step", 0))}
    if start["step"] and pos.get("global_batch") not in (None, global_batch):
        raise ValueError(f"{a.restore}: saved in the middle of epoch {start['epoch'] + 1} with a global batch "
                         f"of {pos['global_batch']}; this run's is {global_batch}: resume with the same "
                         f"batch (or from a checkpoint at an epoch's end)")
    if "seed" in pos:
        a.seed = int(pos["seed"])
    return start


def print_once(message: str) -> None:
    """An error every process meets alike (options, the data's layout, the spec): printed by
    the launcher's rank 0 only, not once per process."""
    from des_ops.comm import launcher_rank
    if launcher_rank()[0] == 0:
        print(message, file=sys.stderr)


def _spec(a, meta: dict):
    """The FeatureSpec of the data (des.data.resolve.spec_for): the training AND the --eval-data
    files are scanned, so an evaluation file with longer bags than any training line works."""
    from des.data.resolve import spec_for
    return spec_for(a.format, a.data, a.dim, meta, getattr(a, "eval_data", None) or [],
                    layout=getattr(a, "libsvm_layout", "auto"))


def _hidden(a) -> tuple[int, ...]:
    return tuple(int(h) for h in a.hidden.split(",") if h)


def _dataset(a, spec, batch_size: int, paths=None, inputs=None, skip_bad_lines: bool = False,
             skip_report=None, **kw):
    """The text readers (des.data.readers) or, for a folder of des.data.convert, the columnar
    reader reading only ``inputs`` (None: all)."""
    from des.data import DataError, columnar
    from des.data.readers import make_dataset
    paths = list(paths or a.data)
    if a.format == "columnar":
        bad = [p for p in paths if not columnar.is_columnar([p])]
        if bad or len(paths) != 1:
            raise DataError(f"{(bad or paths)[0]}: with columnar --data, --eval-data must be one columnar "
                            f"folder too (python -m des.data.convert)")
        return columnar.make_dataset(paths[0], spec, batch_size, inputs=inputs, **kw)
    return make_dataset(paths, a.format, spec, batch_size, skip_bad_lines=skip_bad_lines,
                        skip_report=skip_report, **kw)


def _bayes_auc(a, meta: dict):
    """The generator's Bayes-optimal AUC of the evaluated data, if it wrote one."""
    if not a.eval_data:
        return meta.get("bayes_auc")
    path = a.eval_data[0] + ".meta.json"
    if len(a.eval_data) == 1 and os.path.exists(path):
        with open(path) as fh:
            return json.load(fh).get("bayes_auc")
    return None


def _peak_rss_mib() -> float:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _AucCurve():
    """Running training AUC of the epoch (Keras logs) every few steps: [(step, auc), ...]."""
    import tensorflow as tf

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
        import tensorflow as tf

        class Fail(tf.keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                if batch + 1 >= step:
                    print(f"--fail-at-step {step}: this rank exits with code 17", file=sys.stderr, flush=True)
                    os._exit(17)
        return Fail()


if __name__ == "__main__":
    sys.exit(main())

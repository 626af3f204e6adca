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


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", choices=["single", "des", "ps", "cache", "auto"], default="single",
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
    ap.add_argument("--on-demand", action="store_true",
                    help="cache at --staleness 0: no queries; every process knows from the allocation which "
                         "keys the others update, and asks only for rows it lacks or holds outdated (exact)")
    ap.add_argument("--model", default="deepfm", choices=["lr", "fm", "dnn", "wdl", "deepfm"])
    ap.add_argument("--data", required=True, nargs="+", help="input files (.gz allowed)")
    ap.add_argument("--format", default=None, choices=["criteo", "avazu", "libsvm", "libffm", "columnar"],
                    help="default: columnar for a folder written by des.data.convert (a DES process then "
                         "reads only its own fields' columns), else the format in <data>.meta.json, else criteo")
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
    ap.add_argument("--comm", default="auto", choices=["auto", "horovod", "mpi4py", "local", "noop"],
                    help="noop: the launcher's rank and size but no collective (times the computation "
                         "alone, for des.timemodel; results are not the model's)")
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
    return ap.parse_args(argv)


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
    a = _args(argv)
    import des  # first: it quiets TF logs before TF loads
    import tensorflow as tf
    if a.threads:
        tf.config.threading.set_intra_op_parallelism_threads(a.threads)
        tf.config.threading.set_inter_op_parallelism_threads(a.threads)
    import models
    from des import checkpoint
    from des.callbacks import BytesPerStep, ReplicaCheck, Throughput
    from des.data import DataError, SkipReport
    from des.data.errors import op_error_message
    from des_ops.comm import default_communicator

    from des.data import columnar
    from des.data.resolve import metadata
    meta = metadata(a.data[0])
    if a.format in (None, "columnar") and columnar.is_columnar(a.data):
        a.format, meta = "columnar", columnar.manifest(a.data[0])
    a.format = a.format or meta.get("format", "criteo")
    try:
        spec = _spec(a, meta)
        header = 1 if a.format == "avazu" else 0
        total = None if a.eval_data else count_lines(a.data) - header * len(a.data)
    except (FileNotFoundError, DataError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if total is not None and total <= 0:
        print(f"error: {a.data[0]}: file is empty", file=sys.stderr)
        return 2
    if a.eval_data:  # train on every line of --data; no counting pass
        held, n_train, eval_files, eval_skip = 0, None, a.eval_data, 0
        eval_name = " ".join(a.eval_data)
    else:
        held = int(a.holdout * total) if a.holdout < 1 else int(a.holdout)
        n_train, eval_files, eval_skip = total - held, a.data, total - held
        eval_name = f"{held} held-out lines"
    prebuilt, auto, first = None, None, None
    if a.mode == "auto":          # des or ps for this model, from the first global batch (des.auto)
        from des import auto as auto_mode
        from des_ops.comm import launcher_rank
        try:
            first, _ = next(iter(_dataset(a, spec, a.batch, take_lines=min(a.batch, n_train or a.batch))))
        except (DataError, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        prebuilt = models.build(a.model, spec, seed=a.seed, hidden=_hidden(a))
        auto = auto_mode.choose(prebuilt, {k: v.numpy() for k, v in first.items()}, launcher_rank()[1], a.allocate)
        a.mode = auto.mode
    from des_ops.comm import under_launcher
    from des_ops.sharded import KeyExchange
    exchange = None
    sharded = a.mode in ("ps", "cache")        # data parallel over key-sharded tables
    if a.allocate != "contiguous" and auto is not None and not sharded:
        print(f"--mode auto chose des: --allocate {a.allocate} does not apply (every process reads the whole batch)")
        a.allocate = "contiguous"
    if a.allocate != "contiguous" and not sharded:
        print(f"error: --allocate {a.allocate} is for --mode ps and cache (under {a.mode} "
              f"{'every process reads the whole batch' if a.mode == 'des' else 'there is one process'})",
              file=sys.stderr)
        return 2
    if sharded:
        exchange = (KeyExchange.noop() if a.comm == "noop" else
                    KeyExchange.horovod() if under_launcher() else KeyExchange.local())
        comm = default_communicator("local")
        comm.rank, comm.world_size = exchange.rank, exchange.world_size
    else:
        comm = default_communicator(a.comm) if a.mode == "des" else default_communicator("local")
    rank0 = comm.rank == 0
    log = (lambda *m: print(*m, flush=True)) if rank0 else (lambda *m: None)

    skips = SkipReport()
    common = dict(skip_bad_lines=a.skip_bad_lines, skip_report=skips)
    global_batch, shard_of = a.batch, None
    if sharded:
        shard_of = (comm.rank, comm.world_size)
        global_batch = a.batch * (comm.world_size if a.ps_batch == "per-process" else 1)
    try:
        def train(epoch: int):
            """The batches of one epoch: shuffled by (seed, epoch), so a resumed job sees the
            same order as an uninterrupted one."""
            return _dataset(a, spec, global_batch, shuffle_buffer=a.shuffle_buffer, inputs=read_inputs,
                            seed=epoch_seed(a.seed, epoch), take_lines=n_train,
                            shard=allocation(epoch) if allocation else shard_of, **common)

        def evaluation():
            return _dataset(a, spec, max(global_batch, 4096), eval_files, skip_lines=eval_skip, inputs=read_inputs,
                            shard=shard_of, **common) if (held or a.eval_data) else None
        read_inputs = None         # all; a DES process on columnar data: its own fields' (set below)
        allocation = None          # ps, cache: epoch -> des.allocate.Share (set below)
        train(0)   # reports a bad path or format now
        evaluation()
    except (DataError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    start = {"epoch": 0, "step": 0}
    if a.checkpoint_every and not a.checkpoint:
        print("error: --checkpoint-every needs --checkpoint FOLDER", file=sys.stderr)
        return 2
    if a.restore:
        try:
            checkpoint.check_config(a.restore, _config(a, spec))
            start = _start_position(a, checkpoint.load_config(a.restore), global_batch)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    model = prebuilt or models.build(a.model, spec, seed=a.seed, hidden=_hidden(a))
    if auto is not None:
        log(auto)
    plan = a.plan
    if a.restore and a.mode == "des":
        plan = checkpoint.load_plan(a.restore, comm.world_size) or plan
    report = None
    if a.mode == "des":
        model, report = des.transform(model, comm=comm, plan=plan, spec=spec)
        from des.cost import unique_ids_per_slice
        if first is None:      # --mode auto read it already
            first, _ = next(iter(_dataset(a, spec, a.batch, take_lines=min(a.batch, n_train or a.batch))))
        report.estimate_costs(a.batch, unique_ids_per_slice({k: v.numpy() for k, v in first.items()},
                                                            spec, comm.world_size))
        log(report)
        if a.format == "columnar":
            read_inputs = _own_inputs(model, spec, comm.rank)
            log(f"columnar data: each process reads the labels and its own fields' columns (rank 0: "
                f"{len(read_inputs)} of {len(spec.input_names())} inputs)")
    elif a.mode == "ps":
        from des import ps
        model = ps.shard(model, exchange)
        model.record_ids = a.check_bytes
        log(f"PS: {len(ps.table_inputs(model))} tables sharded by key over {comm.world_size} process(es), "
            f"{ps.dense_parameters(model)} dense parameters allreduced; global batch {global_batch}")
    elif a.mode == "cache":
        from des import cache, ps
        try:
            model = cache.cache(model, exchange, cache.parse_staleness(a.staleness),
                                cache.parse_cache_size(a.cache_size), a.eviction, spec=spec, on_demand=a.on_demand)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        sizes = sorted({l.config.capacity for l, _ in model.cached_tables()})
        log(f"cache: {len(model.cached_tables())} tables sharded by key over {comm.world_size} "
            f"process(es), each cached on every process (staleness {a.staleness}, {a.eviction}, "
            f"{sizes[0]}..{sizes[-1]} rows per table); global batch {global_batch}")
    allocators = []
    if a.on_demand and a.mode != "cache":
        print("error: --on-demand is a plan of --mode cache --staleness 0", file=sys.stderr)
        return 2
    if sharded and (a.allocate != "contiguous" or a.on_demand):
        allocation = _allocation(a, model, comm, allocators)
        if a.on_demand:
            log("cache: on-demand plan (each process reads the keys the others use this step; no queries)")
        how = {"laia": "samples go to the process that owns or caches their keys", "random": "a seeded random split",
               "contiguous": "contiguous slices"}[a.allocate]
        log(f"allocation: {a.allocate} ({how}, {global_batch // comm.world_size}-{-(-global_batch // comm.world_size)} "
            f"per process; evaluation: contiguous slices)")
    optimizer = models.make_optimizer(a.optimizer, a.lr, linear=a.linear_optimizer,
                                      linear_learning_rate=a.linear_lr)
    model.compile(optimizer, "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(num_thresholds=10_000, name="auc"),
                           tf.keras.metrics.BinaryCrossentropy(name="logloss")])
    if a.restore:
        try:
            path = checkpoint.restore(a.restore, model, optimizer, comm.rank, comm.world_size)
        except checkpoint.CheckpointError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        log(f"restored {path}; continuing at epoch {start['epoch'] + 1}, step {start['step']}")

    evald = evaluation()
    speed = Throughput(global_batch)
    curve = _AucCurve()
    callbacks = [speed, curve]
    traffic = None
    if a.mode == "des":
        traffic = BytesPerStep(comm)
        callbacks.append(traffic)
        if a.replica_check:
            callbacks.append(ReplicaCheck(comm, a.replica_check))
    if sharded:
        from des.callbacks import CounterDeltas
        counters = dict(exchange.counters)
        counters.update({f"sent_{k}": v for k, v in exchange.sent.items()})
        counters.update({f"received_{k}": v for k, v in exchange.received.items()})
        if a.mode == "cache":
            counters.update(model.cached_tables()[0][0].counters)
            callbacks.append(_FlushAtEpochEnd())
        traffic = CounterDeltas(counters)
        callbacks.append(traffic)
    wire = None
    if os.environ.get("DES_WIRE_INTERFACE"):        # set by des.netbed: one process per emulated host
        from des.callbacks import WireBytes
        wire = WireBytes(os.environ["DES_WIRE_INTERFACE"])
        callbacks.append(wire)
    saver = None
    if a.checkpoint:
        from des.callbacks import PeriodicCheckpoint
        barrier = _barrier(a.mode, comm, exchange)
        saver = PeriodicCheckpoint(
            lambda pos: _flush(model) or checkpoint.save(a.checkpoint, model, optimizer, getattr(model, "des_plan", None),
                                        comm.rank, comm.world_size, config=_config(a, spec),
                                        position=dict(pos, seed=a.seed, global_batch=global_batch),
                                        barrier=barrier),
            a.checkpoint_every, start["epoch"], start["step"])
        callbacks.append(saver)
    if a.fail_at_step is not None and comm.rank == comm.world_size - 1:
        callbacks.append(_FailAt(a.fail_at_step))
    log(f"training {a.model} ({a.mode}, {comm.world_size} process(es)) on "
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
            data = train(epoch)
            model.fit(data.skip(skip) if skip else data, initial_epoch=epoch, epochs=epoch + 1,
                      steps_per_epoch=steps, verbose=verbose, callbacks=callbacks)
        result = model.evaluate(evald, verbose=0, return_dict=True) if evald is not None else {}
        if sharded and evald is not None:
            result = ps.aggregate_metrics(model, exchange)
    except tf.errors.OpError as e:
        print(f"error: {op_error_message(e)}", file=sys.stderr)
        return 2
    summary = {"model": a.model, "mode": a.mode, "world_size": comm.world_size,
               "auc": result.get("auc"), "logloss": result.get("logloss"),
               "samples_per_second": speed.samples_per_second(), "bayes_auc": _bayes_auc(a, meta),
               "bad_lines_skipped": skips.total, "global_batch": global_batch,
               "train_auc_by_step": curve.points, "peak_rss_mib": _peak_rss_mib()}
    summary["inputs_read"] = len(read_inputs) if read_inputs is not None else len(spec.input_names())
    if auto is not None:
        summary["auto"] = {"chosen": auto.mode, "des_bytes_estimate": auto.des_bytes,
                           "ps_bytes_estimate": auto.ps_bytes}
    if report is not None:
        counted = comm.counted()
        summary.update(floats_per_sample=report.floats_per_sample,
                       bytes_per_step_measured=traffic.median(),
                       bytes_per_step_analytic=report.payload_bytes(a.batch),
                       ring_bytes_per_step=report.ring_bytes(a.batch), collectives=counted,
                       check_bytes_per_step=counted["check"]["bytes"] / max(1, len(traffic.per_step)))
    if sharded:
        summary["allocate"] = a.allocate
        if allocators:
            trained = [x.hashes[:a.steps] for x in allocators]   # not the batches prefetched past --steps
            seconds = sum(x.seconds for x in allocators)
            summary["allocation"] = {"batches": sum(map(len, trained)),
                                     "digest": "-".join(x.digest(a.steps) for x in allocators),
                                     "samples_per_second": sum(x.samples for x in allocators) / seconds if seconds else None}
            if seconds:
                log(f"allocation ({a.allocate}): {summary['allocation']['samples_per_second']:.0f} samples/s of "
                    f"allocator time, {summary['allocation']['samples_per_second'] / speed.samples_per_second():.1f}x "
                    f"the training's {speed.samples_per_second():.0f}")
        summary["collectives"] = {k: v for k, v in exchange.snapshot().items() if k in ("metrics_bytes", "barrier_bytes")}
    if a.mode == "cache":
        summary.update(cache.traffic_summary(traffic.steps, comm.rank, comm.world_size),
                       staleness=a.staleness, cache_size=a.cache_size, eviction=a.eviction)
        log(f"cache bytes/step sent per process: measured {summary['sent_bytes_per_step']:.0f} (all-to-all "
            f"{summary['alltoall_bytes_per_step']:.0f}, analytic {summary['analytic_alltoall_bytes_per_step']:.0f}; "
            f"equal in {summary['bytes_exact_steps']} steps); rows fetched {summary['rows_fetched_per_step']:.0f}, "
            f"pushed {summary['rows_pushed_per_step']:.0f} of {summary['remote_lookups_per_step']:.0f} remote "
            f"lookups per step; hit rate {summary['hit_rate']:.3f}")
    if a.mode == "ps":
        summary.update(ps.traffic_summary(model, traffic.steps, comm.rank, comm.world_size),
                       tables=len(ps.table_inputs(model)))
        log(f"PS bytes/step sent per process: measured {summary['sent_bytes_per_step']:.0f} "
            f"(all-to-all {summary['alltoall_bytes_per_step']:.0f} + dense ring model "
            f"{summary['dense_ring_bytes_per_step']:.0f}), analytic {summary['analytic_sent_bytes_per_step']:.0f}; "
            f"{summary['unique_ids_per_step']:.0f} unique ids per step; measured == analytic in "
            f"{summary['bytes_exact_steps']} steps")
    elif report is not None:
        summary.update(sent_bytes_per_step=comm.ring_bytes(summary["bytes_per_step_measured"]
                                                           + summary["check_bytes_per_step"]),
                       analytic_sent_bytes_per_step=report.ring_bytes(a.batch),
                       costs=[dict(rule=c.rule, layer=c.layer, des_bytes=c.des_bytes, ps_bytes=c.ps_bytes,
                                   verdict=c.verdict) for c in report.costs])
    if wire is not None:
        summary["wire_bytes_per_step"] = wire.median()
        log(f"bytes/step this host sent on its interface (measured, {os.environ['DES_WIRE_INTERFACE']}): "
            f"{summary['wire_bytes_per_step']:.0f}")
    if a.skip_bad_lines:
        log(str(skips))
    if evald is not None:
        log(f"AUC {summary['auc']:.4f} (Bayes-optimal {summary['bayes_auc'] or 'unknown'}), "
            f"log loss {summary['logloss']:.4f} on {eval_name}")
    log(f"{summary['samples_per_second']:.0f} samples/s (global batch {global_batch} / median step time)")
    if report is not None:
        c = summary["collectives"]
        log(f"DES bytes/step handed to allreduce: measured {summary['bytes_per_step_measured']:.0f}, "
            f"analytic {summary['bytes_per_step_analytic']} (4*B*{report.floats_per_sample}); a ring would send "
            f"{summary['ring_bytes_per_step']:.0f} per process (model); replica checks "
            f"{c['check']['bytes']} B in {c['check']['calls']} allreduce(s), broadcasts {c['broadcast']['bytes']} B")
    if saver is not None and saver.saves:
        log(f"checkpoint written to {a.checkpoint} ({saver.saves} save(s); the last at epoch "
            f"{saver.epoch}, step {saver.step})")
    if a.summary_json:
        path = a.summary_json if comm.world_size == 1 else f"{a.summary_json}.rank{comm.rank}"
        with open(path, "w") as fh:
            json.dump(summary, fh, indent=1)
    return 0


def epoch_seed(seed: int, epoch: int) -> int:
    """The shuffle seed of one epoch (epoch 0: ``seed`` itself)."""
    return seed + 1_000_003 * epoch


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


def _barrier(mode: str, comm, exchange):
    """Waits for every process (one tiny allreduce): checkpoints are written together."""
    import tensorflow as tf
    if mode in ("ps", "cache") and exchange.world_size > 1:
        return lambda: exchange.sum_across(tf.zeros([1]), counter="barrier_bytes")
    if mode == "des" and comm.world_size > 1:
        return lambda: comm.allreduce_counted(tf.zeros([1]), "barrier")
    return None


def _allocation(a, model, comm, allocators: list):
    """epoch -> a des.allocate.Share of a new allocator (one per epoch's dataset, so that
    batches the input pipeline prefetched but fit never trained cannot make the processes'
    allocators differ); ``allocators`` collects them for the summary."""
    from des import allocate, ps
    # The allocator runs in the input pipeline's thread and holds the GIL for most of its
    # numpy work; with Python's default 5 ms switch interval Keras's step loop, which takes the
    # GIL hundreds of times per step (callbacks, counters), waits up to 5 ms each time and the
    # step slowed several-fold (measured: PS laia 831 vs 3,700 samples/s on 2 processes).
    sys.setswitchinterval(2e-4)
    keys = [ids for ids, _, _ in ps.table_inputs(model)]
    capacity = {ids: layer.config.capacity for layer, ids in model.cached_tables()} if a.mode == "cache" else None

    def for_epoch(epoch: int):
        sgd = a.optimizer == "sgd" and a.linear_optimizer in (None, "sgd")    # the cache's local update
        allocators.append(allocate.make(a.allocate, comm.world_size, keys, capacity, seed=epoch_seed(a.seed, epoch),
                                        keeps_own_updates=sgd))
        return allocate.Share(allocators[-1], comm.rank, others=a.on_demand)
    return for_epoch


def _flush(model) -> None:
    """Cache mode: push every pending update before the owners' rows are saved."""
    if hasattr(model, "flush"):
        model.flush()


def _FlushAtEpochEnd():
    """Cache mode: every epoch ends with a flush (a sync point), before checkpoints and evaluation."""
    import tensorflow as tf

    class Flush(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.flush()
    return Flush()


def _spec(a, meta: dict):
    """The FeatureSpec of the data (des.data.resolve.spec_for): the training AND the --eval-data
    files are scanned, so an evaluation file with longer bags than any training line works."""
    from des.data.resolve import spec_for
    return spec_for(a.format, a.data, a.dim, meta, getattr(a, "eval_data", None) or [])


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


def _own_inputs(model, spec, rank: int) -> list[str]:
    """The inputs a DES process needs: its own fields' ids (and weights), plus the first field's,
    which every process reads so the replica check's batch fingerprint stays comparable."""
    plan = model.des_plan
    first = spec.sparse()[0].name
    fields = [f for f in spec if f.kind == "numeric" or plan.owner.get(f.name) == rank or f.name == first]
    unknown = [f.name for f in spec.sparse() if f.name not in plan.owner]
    if unknown:            # the plan's fields are not the spec's: read everything
        return spec.input_names()
    model.des_layer.fingerprint_inputs = (first,)
    return [n for f in fields for n in ([f.name, f.weight_name] if f.weighted else [f.name])]


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

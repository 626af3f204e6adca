"""A user's own DeepFM (or W&D) through ``des.transform`` with no options, for scripts/bench_peer.py:
the DES system next to TFRA's HvdAllToAllEmbedding (scripts/peer_tfra.py), same data, widths, optimizer
and summary keys.

    mpirun -np 2 python scripts/user_deepfm.py --data train.txt --batch 4096 --steps 12 --summary-json out.json

The model is written as a user writes it, knowing nothing of DES: one TFRA table per sparse field
(``de.keras.layers.Embedding(dim, RandomUniform(-0.05, 0.05))``) and a 1-wide one (Zeros) for its
linear weight, FM with tf ops (``0.5 * reduce_sum(square(sum over fields) - sum of squares)``), an MLP
(ReLU Dense layers of ``--hidden``, then Dense(1)) on the concatenated embeddings, Add and a Dense(1)
sigmoid, as peer_tfra.build (``--model wdl``: no FM). Numeric fields are skipped (as the peer does);
multi-valued fields are refused. It is compiled with the peer's optimizer, TFRA's
``DynamicEmbeddingOptimizer(legacy Adam(1e-3))`` (TFRA 0.7.2 trains its tables through nothing else; a
bare Keras Adam fails on TFRA tables, with or without DES), then ``des.transform(model)`` (``--options
KEY=VALUE,...``: a non-default des.Options, e.g. ``tail=data_parallel,first_dense=rows``), its report
printed on rank 0, and fitted on batches every process reads WHOLE (DES's contract: the global batch
on every process, no shard). Compiling before the transform makes des.Options(tables="auto") choose
joined tables, as for a compiled model, and the returned model comes compiled the same way (TFRA's
wrapper included). Writes ``--summary-json`` (rank r: ``.rank<r>``) with
peer_tfra.py's keys (samples/s of the global batch, median step; seconds to the end of the first step;
CPU seconds per step; train AUC; on the netbed, bytes this host sent per step), the final loss and the
report's lines.
"""
import argparse
import json
import os
import sys
import time

STARTED = time.perf_counter()

import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(spec, dim: int, hidden, model: str = "deepfm", tables: str = "per-field") -> tf.keras.Model:
    """The user's Keras model over ``spec``'s categorical fields: linear + FM + MLP (``wdl``: no FM).
    ``tables="one"``: TFRA's one-table style, the fields' ids (already distinct across fields) stacked
    into [B, F] and looked up in ONE table of width ``dim`` and one of width 1."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    L = tf.keras.layers
    multi = [f.name for f in spec.sparse() if f.kind == "multi"]
    if multi:
        raise SystemExit(f"user_deepfm.py: multi-valued fields ({', '.join(multi[:5])}...) are not written here; "
                         f"use the criteo-like preset (one id per field)")
    fields = spec.sparse()
    x = {f.name: tf.keras.Input(shape=(), dtype=tf.int64, name=f.name) for f in fields}
    if tables == "one":
        ids = tf.stack([x[f.name] for f in fields], axis=1)                              # [B, F]
        e = de.keras.layers.Embedding(dim, initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05),
                                      name="emb_all")(ids)                               # [B, F, dim]
        embs = [L.Flatten(name="embed_flat")(e)]
        terms = [tf.reduce_sum(de.keras.layers.Embedding(1, initializer=tf.keras.initializers.Zeros(),
                                                         name="w_all")(ids), axis=1)]    # [B, 1]
    else:
        embs = [de.keras.layers.Embedding(dim, initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05),
                                          name=f"emb_{f.name}")(x[f.name]) for f in fields]
        weights = [de.keras.layers.Embedding(1, initializer=tf.keras.initializers.Zeros(),
                                             name=f"w_{f.name}")(x[f.name]) for f in fields]
        terms = [L.Add(name="linear")(weights)]                                         # [B, 1]
        e = tf.stack(embs, axis=1)                                                       # [B, F, dim]
    if model == "deepfm":
        terms.append(0.5 * tf.reduce_sum(tf.square(tf.reduce_sum(e, axis=1)) - tf.reduce_sum(tf.square(e), axis=1),
                                          axis=1, keepdims=True))                        # [B, 1]
    h = L.Concatenate(name="embed_concat")(embs) if len(embs) > 1 else embs[0]           # [B, F * dim]
    for i, units in enumerate(hidden):
        h = L.Dense(units, activation="relu", name=f"dnn_{i}")(h)
    terms.append(L.Dense(1, name="dnn_out")(h))
    return tf.keras.Model(x, L.Dense(1, activation="sigmoid", name="prob")(L.Add(name="logit")(terms)))


def compile_user(model: tf.keras.Model) -> None:
    """Compile as a TFRA user must (TFRA 0.7.2 trains its tables only through its
    DynamicEmbeddingOptimizer, around a legacy Keras optimizer), with the peer's Adam(1e-3)."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    model.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(1e-3)), "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(name="auc")])


def parse_options(text: str) -> dict:
    """``KEY=VALUE,...`` -> des.Options keywords; a numeric value as an int."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--options {text}: KEY=VALUE,... (got {item!r})")
        out[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return out


def global_batches(path: str, batch: int, dim: int):
    """(spec, dataset): batches of the GLOBAL batch size, the same whole batch on every process
    (no shard), text (with its .meta.json) or a columnar folder (des.data.convert)."""
    from des.data import columnar
    from des.data.readers import make_dataset
    from des.data.resolve import metadata, spec_for
    if columnar.is_columnar([path]):
        spec = columnar.spec_of(path).with_dim(dim)
        ds = columnar.make_dataset(path, spec, batch, drop_remainder=True)
    else:
        meta = metadata(path)
        spec = spec_for(meta.get("format", "criteo"), [path], dim, meta)
        ds = make_dataset(path, meta.get("format", "criteo"), spec, batch_size=batch, drop_remainder=True)
    names = {f.name for f in spec.sparse()}
    return spec, ds.map(lambda x, y: ({k: v for k, v in x.items() if k in names}, y))


def main() -> None:
    ap = runner_parser()
    ap.add_argument("--model", default="deepfm", choices=["deepfm", "wdl"])
    ap.add_argument("--options", default="", help="des.Options keywords KEY=VALUE,... (default: none)")
    ap.add_argument("--tables", default="per-field", choices=["per-field", "one"],
                    help="one TFRA table per field (default) or TFRA's one-table style (one table for all fields)")
    ap.add_argument("--comm", default="auto", choices=["auto", "mpi4py", "horovod"],
                    help="des.transform's communicator: its default (under mpirun, mpi4py or Horovod as des.transform "
                         "settles it), des_ops.mpi.Mpi4pyCommunicator or Horovod's")
    a = started(ap)
    import des
    from des_ops.comm import launcher_rank
    from des_ops.mpi import default_communicator
    spec, ds = global_batches(a.data, a.batch, a.dim)
    model = build(spec, a.dim, [int(u) for u in a.hidden.split(",") if u], a.model, a.tables)
    compile_user(model)
    options = parse_options(a.options)
    # a global batch (the first one: the same on every process): the plan balances the fields by their
    # distinct ids in it, the cost model measures the share of distinct rows, mode="auto" weighs DES
    # against a PS on it
    sample = next(iter(ds))[0]
    comm = default_communicator(a.comm)        # auto: des.transform's default, settled by it under mpirun
    model, report = des.transform(model, des.Options(**options) if options else None, comm=comm, sample=sample)
    rank, n = launcher_rank()
    if rank == 0:
        print(report, flush=True)
    hist, timed = timed_fit(model, ds, a.steps, a.batch, STARTED)
    write_summary(a.summary_json, rank, n, {
        "mode": "des-transform-user", "world_size": n, "options": a.options, "tables": a.tables, **timed,
        "train_auc_by_step": [[timed["steps"], hist["auc"][-1]]], "train_loss": hist["loss"][-1],
        "report": str(report).splitlines()})


def runner_parser() -> argparse.ArgumentParser:
    """The flags a benchmark's process shares with scripts/arch_runner.py: data, global batch, steps,
    width, hidden units, the dense layers' seed and the summary's path."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True, help="criteo-like text with its .meta.json, or a columnar folder")
    ap.add_argument("--batch", type=int, default=4096, help="the global batch")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--seed", type=int, default=0, help="the dense layers' initial values (the same at any N)")
    ap.add_argument("--summary-json", required=True)
    return ap


def started(ap: argparse.ArgumentParser) -> argparse.Namespace:
    """The parsed flags, with TensorFlow at one thread per pool and the seed set."""
    a = ap.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.keras.utils.set_random_seed(a.seed)
    return a


def timed_fit(model, ds, steps: int, batch: int, started: float) -> tuple[dict, dict]:
    """``model.fit`` on ``steps`` batches of ``ds``: (the history, samples/s of the global ``batch``
    (median step), seconds from ``started`` (perf_counter) to the end of the first step, CPU seconds per step, steps and,
    on the netbed (des.netbed), the bytes this host sent per step)."""
    from des.runtime.callbacks import CPUTime, Throughput, WireBytes
    speed, cpu = Throughput(batch, started), CPUTime()
    wire = WireBytes(os.environ["DES_WIRE_INTERFACE"]) if os.environ.get("DES_WIRE_INTERFACE") else None
    hist = model.fit(ds.take(steps), verbose=0, callbacks=[speed, cpu] + [wire] * bool(wire)).history
    timed = {"samples_per_second": speed.samples_per_second(), "seconds_to_first_step": speed.seconds_to_first_step,
             "cpu_seconds_per_step": cpu.median(), "steps": len(speed.times)}
    return hist, {**timed, **({"wire_bytes_per_step": wire.median()} if wire else {})}


def write_summary(path: str, rank: int, n: int, summary: dict) -> None:
    """``summary`` as JSON at ``path`` (rank r of several: ``path.rank<r>``); rank 0 prints it (no report)."""
    with open(path + (f".rank{rank}" if n > 1 else ""), "w") as fh:
        json.dump(summary, fh, indent=1)
    if rank == 0:
        print(json.dumps({k: v for k, v in summary.items() if k != "report"}))


if __name__ == "__main__":
    main()

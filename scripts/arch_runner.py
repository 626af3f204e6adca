"""One process of scripts/bench_arch.py: DCN-v2, AutoInt or DLRM on criteo-like data, as one of
three systems, trained for a few steps under mpirun (or alone), summary written as JSON.

    mpirun -np 2 python scripts/arch_runner.py --system des --arch dcn --data train.txt --batch 4096 \
        --steps 12 --summary-json out.json

Systems (``--system``):
  * ``des``: the user's Keras model (one TFRA ``de.keras.layers.Embedding(dim, RandomUniform(-0.05, 0.05))``
    per sparse field, the architecture's layers on top), compiled with TFRA's
    ``DynamicEmbeddingOptimizer(legacy Adam(1e-3))``, then ``des.transform(model, sample=first global
    batch)`` with NO options; every process reads the GLOBAL batch. The report is printed on rank 0 and kept in the summary.
  * ``tfra``: the same architecture over TFRA's ``HvdAllToAllEmbedding`` (one table of width dim for all
    fields, keys ``slot << 55 | id``: scripts/peer_tfra.py's ``field_keys``/``pool_fields``), data-parallel
    (each process parses its rows ``shard=(rank, N)``), ``DynamicEmbeddingOptimizer(legacy Adam(1e-3),
    synchronous=True)``.
  * ``des-spec``: as ``des``, with ``spec=`` the data's feature spec, whose cardinalities size the
    fields (so a field too big for one owner is split by key stripe: des.compiler.big_tables).
  * ``des-offsets``: the user's model spelled as DLRM / pytorch-fm ports write it: ONE Keras
    ``Embedding(F * vocab, dim)`` read as ids mod ``--vocab`` + per-field offsets ([B, F] -> [B, F, dim]),
    compiled with legacy Adam(1e-3), then ``des.transform(model)`` with NO options (the table split by key
    range: each field's range with its owner); every process reads the GLOBAL batch.
  * ``replicated``: the same user model with Keras ``Embedding(vocab, dim)`` tables over ids mod
    ``--vocab`` (default 2**18: hashed, colliding ids share a row), every table whole on every process,
    classic Horovod data parallelism: each process its shard of the batch, gradients averaged by
    ``horovod.tensorflow.keras.DistributedOptimizer(legacy Adam(1e-3))`` (the tables' IndexedSlices by
    allgather). TFRA local tables would diverge across processes (TFRA's synchronous wrapper does not
    aggregate its tables' gradients), hence dense tables. Every process starts from the same weights
    (the same seed). Keras's Adam updates a dense table's slots in full each step.

Architectures (``--arch``), over the F sparse fields' embeddings e_f [B, dim] (numeric fields skipped):
  * ``dcn``: x0 = concat(e) [B, F*dim]; two DCN-v2 crosses x_{l+1} = x0 * (W x_l + b) + x_l
    (``tfrs.layers.dcn.Cross``) beside an MLP (``--hidden``, ReLU) on x0; concat; Dense(1, sigmoid).
  * ``autoint``: stack(e) [B, F, dim]; two ``MultiHeadAttention(num_heads=2, key_dim=dim)`` with residual;
    flatten; MLP; Dense(1, sigmoid).
  * ``dlrm``: stack(e); pairwise dots E E^T, upper triangle (F(F-1)/2) by tf.gather; top MLP; Dense(1, sigmoid).

Summary (``--summary-json``, rank r: ``.rank<r>``): samples/s of the global batch (median step, the
first excluded), seconds to the end of the first step, CPU seconds per step, the final train loss,
table rows this process holds at the end, on the netbed (des.netbed) the bytes this host sent per
step, and for des the report's lines, its choices and the tables it left whole.
"""
import os
import sys
import time

STARTED = time.perf_counter()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
L = tf.keras.layers
INIT = (-0.05, 0.05)


def mlp(h, hidden, prefix: str):
    """ReLU Dense layers of ``hidden`` on h."""
    for i, units in enumerate(hidden):
        h = L.Dense(units, activation="relu", name=f"{prefix}_{i}")(h)
    return h


def head(arch: str, embs: list, dim: int, hidden) -> tf.Tensor:
    """The architecture's layers on the field embeddings ``embs`` (F tensors [B, dim]): the
    click probability [B, 1]."""
    if arch == "dcn":
        import tensorflow_recommenders as tfrs
        x0 = L.Concatenate(name="x0")(embs)                                            # [B, F*dim]
        x = tfrs.layers.dcn.Cross(kernel_initializer="glorot_uniform", name="cross_0")(x0)
        x = tfrs.layers.dcn.Cross(kernel_initializer="glorot_uniform", name="cross_1")(x0, x)
        top = L.Concatenate(name="cross_deep")([x, mlp(x0, hidden, "deep")])
    elif arch == "autoint":
        e = tf.stack(embs, axis=1)                                                       # [B, F, dim]
        for i in range(2):
            e = L.Add(name=f"residual_{i}")([e, L.MultiHeadAttention(num_heads=2, key_dim=dim, name=f"attn_{i}")(e, e)])
        top = mlp(L.Flatten(name="flat")(e), hidden, "deep")
    elif arch == "dlrm":
        f = len(embs)
        e = tf.stack(embs, axis=1)                                                       # [B, F, dim]
        dots = L.Reshape((f * f,), name="dots")(tf.matmul(e, e, transpose_b=True))      # [B, F*F]
        i, j = np.triu_indices(f, 1)
        top = mlp(tf.gather(dots, tf.constant(i * f + j, tf.int32), axis=1), hidden, "top")   # [B, F(F-1)/2]
    else:
        raise SystemExit(f"--arch {arch}: dcn, autoint or dlrm")
    return L.Dense(1, activation="sigmoid", name="prob")(top)


def user_model(spec, arch: str, dim: int, hidden, vocab: int = 0, offsets: bool = False) -> tf.keras.Model:
    """The user's model: one TFRA table per sparse field (``vocab`` > 0: a Keras Embedding(vocab, dim)
    over ids mod vocab instead; ``offsets``: ONE Keras Embedding(F * vocab, dim) over ids mod vocab +
    per-field offsets), the architecture on top."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    init = lambda i: tf.keras.initializers.RandomUniform(*INIT, seed=i)  # noqa: E731 - one per table
    fields = spec.sparse()
    x = {f.name: tf.keras.Input(shape=(), dtype=tf.int64, name=f.name) for f in fields}
    if offsets:
        ids = tf.stack([tf.math.floormod(x[f.name], vocab) for f in fields], axis=1)                 # [B, F]
        e = L.Embedding(len(fields) * vocab, dim, embeddings_initializer=init(0), name="emb_all")(
            ids + tf.constant(np.arange(len(fields)) * vocab, tf.int64))                              # [B, F, dim]
        embs = tf.unstack(e, axis=1)
    elif vocab:
        embs = [L.Embedding(vocab, dim, embeddings_initializer=init(i), name=f"emb_{f.name}")(
            tf.math.floormod(x[f.name], vocab)) for i, f in enumerate(fields)]
    else:
        embs = [de.keras.layers.Embedding(dim, initializer=init(i), name=f"emb_{f.name}")(x[f.name])
                for i, f in enumerate(fields)]
    return tf.keras.Model(x, head(arch, embs, dim, hidden))


def tfra_model(spec, arch: str, dim: int, hidden, world_size: int) -> tf.keras.Model:
    """The same architecture over ONE HvdAllToAllEmbedding of width dim, all fields' keys
    ``slot << 55 | id`` (scripts/peer_tfra.py)."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    from peer_tfra import field_keys, pool_fields
    fields = spec.sparse()
    x = {f.name: tf.keras.Input(shape=(), dtype=tf.int64, name=f.name) for f in fields}
    keys, weights = L.Lambda(lambda t: field_keys(spec, t), name="keys")(x)
    table = de.keras.layers.HvdAllToAllEmbedding(
        embedding_size=dim, key_dtype=tf.int64, value_dtype=tf.float32,
        initializer=tf.keras.initializers.RandomUniform(*INIT), mpi_size=world_size, name="peer_emb")
    e = L.Lambda(lambda t: pool_fields(spec, t[0], t[1]), name="pool")([table(keys), weights])   # [B, F, dim]
    return tf.keras.Model(x, head(arch, tf.unstack(e, axis=1), dim, hidden))


def sharded_batches(path: str, batch: int, dim: int, shard):
    """(spec, dataset) of the global batches (``shard`` None: whole on every process, as
    scripts/user_deepfm.py reads them) or of this process's rows of each (shard=(rank, N), only those
    lines parsed, as scripts/peer_tfra.py reads them); sparse fields only."""
    from user_deepfm import global_batches
    if shard is None:
        return global_batches(path, batch, dim)
    from des.data import columnar
    from des.data.readers import make_dataset
    from des.data.resolve import metadata, spec_for
    if columnar.is_columnar([path]):
        spec = columnar.spec_of(path).with_dim(dim)
        ds = columnar.make_dataset(path, spec, batch, drop_remainder=True, shard=shard)
    else:
        meta = metadata(path)
        spec = spec_for(meta.get("format", "criteo"), [path], dim, meta)
        ds = make_dataset(path, meta.get("format", "criteo"), spec, batch_size=batch, drop_remainder=True, shard=shard)
    names = {f.name for f in spec.sparse()}
    return spec, ds.map(lambda x, y: ({k: v for k, v in x.items() if k in names}, y))


def rows_held(model, system: str) -> int:
    """Table rows this process holds: its owned TFRA tables (des), its shard of the all-to-all
    table (tfra), every Keras table's vocabulary (replicated)."""
    if system == "replicated":
        return sum(int(layer.input_dim) for layer in model.layers if isinstance(layer, L.Embedding))
    if system.startswith("des"):
        import des
        from des.graph.sources import source_of
        owned = des.distributed(model).layer.owned       # fused TFRA tables (params) or key-range tables
        return sum(int(t.params.size()) if hasattr(t, "params") else int(source_of(t).rows(t)) for t in owned
                   if hasattr(t, "params") or source_of(t) is not None)
    return sum(int(layer.params.size()) for layer in model.layers if hasattr(layer, "params"))


def des_choices(report) -> dict:
    """What des.transform chose and left: tail, field rows, first Dense, the link, tables left whole."""
    from collections import Counter
    rules = Counter(m.rule for m in report.substitutions)
    return {"tail": report.tail, "field_rows": "samples" if report.by_samples else "partials",
            "by_rows": list(report.by_rows), "substitutions": dict(rules), "unsubstituted": list(report.unsubstituted),
            "rejections": [str(r) for r in report.rejections], "link": report.link,
            "tail_reason": report.tail_reason, "field_rows_reason": report.field_rows_reason,
            "by_samples": list(report.by_samples), "big_fields": list(report.big_fields)}


def build_system(a, rank: int, n: int):
    """(model, dataset, extra summary) of ``a.system``, compiled (des: transformed too)."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    hidden = [int(u) for u in a.hidden.split(",") if u]
    adam = tf.keras.optimizers.legacy.Adam(1e-3)
    if a.system in ("des", "des-spec"):
        import des
        from user_deepfm import compile_user
        spec, ds = sharded_batches(a.data, a.batch, a.dim, None)
        model = user_model(spec, a.arch, a.dim, hidden)
        compile_user(model)                     # TFRA's DynamicEmbeddingOptimizer(legacy Adam(1e-3)), AUC
        # the first global batch as sample=: the plan balances the fields by their distinct ids in it
        # (des-spec: by the spec's cardinalities)
        model, report = des.transform(model, sample=next(iter(ds))[0], spec=spec if a.system == "des-spec" else None)
        if rank == 0:
            print(report, flush=True)
        return model, ds, {"report": str(report).splitlines(), "des": des_choices(report)}
    if a.system == "des-offsets":
        import des
        spec, ds = sharded_batches(a.data, a.batch, a.dim, None)
        model = user_model(spec, a.arch, a.dim, hidden, vocab=a.vocab, offsets=True)
        model.compile(adam, "binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
        model, report = des.transform(model)
        if rank == 0:
            print(report, flush=True)
        return model, ds, {"report": str(report).splitlines(), "des": des_choices(report)}
    spec, ds = sharded_batches(a.data, a.batch, a.dim, (rank, n))
    if a.system == "tfra":
        model = tfra_model(spec, a.arch, a.dim, hidden, n)
        optimizer = de.DynamicEmbeddingOptimizer(adam, synchronous=True)
    else:
        import horovod.tensorflow.keras as hvd_keras
        model = user_model(spec, a.arch, a.dim, hidden, vocab=a.vocab)
        optimizer = hvd_keras.DistributedOptimizer(adam) if n > 1 else adam
    model.compile(optimizer, "binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
    return model, ds, {}


def main() -> None:
    from user_deepfm import runner_parser, started, timed_fit, write_summary
    ap = runner_parser()
    ap.add_argument("--system", required=True, choices=["des", "des-spec", "des-offsets", "tfra", "replicated"])
    ap.add_argument("--arch", required=True, choices=["dcn", "autoint", "dlrm"])
    ap.add_argument("--vocab", type=int, default=1 << 18, help="replicated: rows of each hashed Keras table")
    a = started(ap)
    from des_ops.comm import launcher_rank
    from des_ops.mpi import init_horovod
    rank, n = launcher_rank()
    if n > 1 and not a.system.startswith("des"):
        init_horovod()                          # des.transform starts Horovod itself under mpirun
    model, ds, extra = build_system(a, rank, n)
    hist, timed = timed_fit(model, ds, a.steps, a.batch, STARTED)
    write_summary(a.summary_json, rank, n, {
        "system": a.system, "arch": a.arch, "world_size": n, "rank": rank, **timed, "train_loss": hist["loss"][-1],
        "train_auc": hist["auc"][-1], "rows_held": rows_held(model, a.system), **extra})


if __name__ == "__main__":
    main()

"""The peer users pick today, for scripts/bench_peer.py: one process of a Keras DeepFM or W&D
whose embeddings are TFRA's ``HvdAllToAllEmbedding`` (TFRA 0.7.2), trained data-parallel under mpirun.

    mpirun -np 2 python scripts/peer_tfra.py --data train.txt --batch 4096 --steps 12 --summary-json out.json

Written as a TFRA user writes it (its Horovod Keras demo): all fields in ONE table per width,
keyed ``slot << 55 | id`` (as DES's fused tables), every process reads the global batch and
keeps (and parses) its rows ``shard_rows(B, rank, N)``; lookups go to the key's owner by Horovod
all-to-all (TFRA de-duplicates the keys first); ``DynamicEmbeddingOptimizer(Adam, synchronous=True)``
averages the dense gradients with Horovod. Multi-valued fields (libsvm / libffm, the wide preset)
are looked up column by column and pooled per field with their weights (``field_keys``,
``pool_fields``). The same architecture as models.deepfm / models.wdl: linear sum (+ FM) + MLP
(ReLU), sigmoid. ``--data``: a text file with its ``.meta.json`` or a columnar folder
(des.data.convert). Writes ``--summary-json`` (rank r: ``.rank<r>``): samples/s of the global
batch (median step), seconds from start to the end of the first step, CPU seconds per step
(median), train AUC, and on the netbed (des.netbed) the bytes this host sent per step.
"""
import argparse
import json
import os
import sys
import time

STARTED = time.perf_counter()

import tensorflow as tf  # noqa: E402


def field_keys(spec, x):
    """Every field's ids as keys ``slot << 55 | id`` side by side, [B, S] (S = the sum of the
    fields' lengths: 1 for a one-hot field, max_len for a multi-valued one), and the weight of each
    column, [B, S] (a multi-valued field's weights; 1 for one-hot; 0 on padding, whose key is the
    field's id 0: looked up, weighted 0, so its row gets no gradient)."""
    from models.spec import PAD_ID
    keys, weights = [], []
    for slot, f in enumerate(spec.sparse()):
        ids = x[f.name] if f.kind == "multi" else x[f.name][:, None]
        pad = tf.equal(ids, PAD_ID)
        keys.append(tf.bitwise.bitwise_or(tf.where(pad, tf.zeros_like(ids), ids), tf.constant(slot << 55, tf.int64)))
        w = tf.cast(x[f.weight_name], tf.float32) if f.weighted else tf.ones(tf.shape(ids), tf.float32)
        weights.append(tf.where(pad, tf.zeros_like(w), w))
    return tf.concat(keys, axis=1), tf.concat(weights, axis=1)


def pool_fields(spec, rows, weights):
    """Rows [B, S, w] of ``field_keys``' columns -> each field's weighted sum, [B, F, w]."""
    lengths = [f.max_len if f.kind == "multi" else 1 for f in spec.sparse()]
    parts = tf.split(rows * weights[..., None], lengths, axis=1)
    return tf.stack([tf.reduce_sum(p, axis=1) for p in parts], axis=1)


def build(spec, dim: int, hidden, world_size: int, model: str = "deepfm"):
    """The peer's Keras model: ``deepfm`` (linear + FM + MLP) or ``wdl`` (linear + MLP), all
    fields' keys looked up in one HvdAllToAllEmbedding per width, pooled per field."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    from models.layers import FMInteraction
    from models.zoo import inputs_for
    L = tf.keras.layers
    numeric = {f.name for f in spec if f.kind == "numeric"}
    x = {name: t for name, t in inputs_for(spec).items() if name not in numeric}
    keys, weights = L.Lambda(lambda t: field_keys(spec, t), name="keys")(x)
    pool = L.Lambda(lambda t: pool_fields(spec, t[0], t[1]), name="pool")

    def table(width, init, name):
        return de.keras.layers.HvdAllToAllEmbedding(embedding_size=width, key_dtype=tf.int64, value_dtype=tf.float32,
                                                    initializer=init, mpi_size=world_size, name=name)
    emb = pool([table(dim, tf.keras.initializers.RandomUniform(-0.05, 0.05), "peer_emb")(keys), weights])  # [b, F, dim]
    linear = tf.reduce_sum(pool([table(1, tf.keras.initializers.Zeros(), "peer_linear")(keys), weights]),
                           axis=1)                                                                   # [b, 1]
    h = L.Reshape((len(spec.sparse()) * dim,))(emb)
    for i, units in enumerate(hidden):
        h = L.Dense(units, activation="relu", name=f"dnn_{i}")(h)
    terms = [linear, L.Dense(1, name="dnn_out")(h)] + ([FMInteraction(name="fm")(emb)] if model == "deepfm" else [])
    return tf.keras.Model(x, L.Dense(1, activation="sigmoid", name="prob")(L.Add()(terms)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--model", default="deepfm", choices=["deepfm", "wdl"])
    ap.add_argument("--summary-json", required=True)
    a = ap.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tensorflow_recommenders_addons import dynamic_embedding as de
    from des.runtime.callbacks import CPUTime, Throughput, WireBytes
    from des.data import columnar
    from des.data.readers import make_dataset
    from des.data.resolve import metadata, spec_for
    from des_ops.mpi import init_horovod
    hvd = init_horovod()
    rank, n = hvd.rank(), hvd.size()
    # rows shard_rows(batch, rank, N) of every global batch, only those lines parsed (as the PS reads)
    if columnar.is_columnar([a.data]):
        spec = columnar.spec_of(a.data).with_dim(a.dim)
        ds = columnar.make_dataset(a.data, spec, a.batch, drop_remainder=True, shard=(rank, n))
    else:
        meta = metadata(a.data)
        spec = spec_for(meta.get("format", "criteo"), [a.data], a.dim, meta)
        ds = make_dataset(a.data, meta.get("format", "criteo"), spec, batch_size=a.batch, drop_remainder=True,
                          shard=(rank, n))
    ds = ds.take(a.steps)
    ds = ds.map(lambda x, y: ({k: v for k, v in x.items() if k in spec.input_names()}, y))
    model = build(spec, a.dim, [int(u) for u in a.hidden.split(",") if u], n, a.model)
    model.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(1e-3), synchronous=True),
                  "binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
    speed, cpu = Throughput(a.batch, STARTED), CPUTime()
    wire = WireBytes(os.environ["DES_WIRE_INTERFACE"]) if os.environ.get("DES_WIRE_INTERFACE") else None   # des.netbed
    hist = model.fit(ds, verbose=0, callbacks=[speed, cpu] + [wire] * bool(wire)).history
    summary = {"mode": "tfra-alltoall", "world_size": n, "samples_per_second": speed.samples_per_second(),
               "seconds_to_first_step": speed.seconds_to_first_step, "cpu_seconds_per_step": cpu.median(),
               "train_auc_by_step": [[len(hist["auc"]), hist["auc"][-1]]]}
    if wire:
        summary["wire_bytes_per_step"] = wire.median()
    with open(a.summary_json + (f".rank{rank}" if n > 1 else ""), "w") as fh:
        json.dump(summary, fh, indent=1)
    if rank == 0:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()

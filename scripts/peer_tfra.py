"""The peer users pick today, for scripts/bench_peer.py: one process of a Keras DeepFM whose
embeddings are TFRA's ``HvdAllToAllEmbedding`` (TFRA 0.7.2), trained data-parallel under mpirun.

    mpirun -np 2 python scripts/peer_tfra.py --data train.txt --batch 4096 --steps 12 --summary-json out.json

Written as a TFRA user writes it (its Horovod Keras demo): all fields in ONE table per width,
keyed ``slot << 55 | id`` (as DES's fused tables), every process reads the global batch and
keeps (and parses) its rows ``shard_rows(B, rank, N)``; lookups go to the key's owner by Horovod all-to-all;
``DynamicEmbeddingOptimizer(Adam, synchronous=True)`` averages the dense gradients with Horovod.
The same architecture as models.deepfm: linear sum + FM + MLP (ReLU) + bias, sigmoid. Writes
``--summary-json`` (rank r: ``.rank<r>``): samples/s of the global batch (median step), seconds
from start to the end of the first step, CPU seconds per step (median), train AUC per step.
"""
import argparse
import json
import os
import sys
import time

STARTED = time.perf_counter()

import tensorflow as tf  # noqa: E402


def build(spec, dim: int, hidden, world_size: int):
    from tensorflow_recommenders_addons import dynamic_embedding as de
    from models.layers import FMInteraction
    L = tf.keras.layers
    fields = [f.name for f in spec.sparse()]
    x = {f: tf.keras.Input(shape=(), dtype=tf.int64, name=f) for f in fields}
    slots = tf.constant([s << 55 for s in range(len(fields))], tf.int64)
    keys = L.Lambda(lambda t: tf.bitwise.bitwise_or(tf.stack(t, axis=1), slots), name="keys")([x[f] for f in fields])

    def table(width, init, name):
        return de.keras.layers.HvdAllToAllEmbedding(embedding_size=width, key_dtype=tf.int64, value_dtype=tf.float32,
                                                    initializer=init, mpi_size=world_size, name=name)
    emb = table(dim, tf.keras.initializers.RandomUniform(-0.05, 0.05), "peer_emb")(keys)      # [b, F, dim]
    linear = tf.reduce_sum(table(1, tf.keras.initializers.Zeros(), "peer_linear")(keys), axis=1)   # [b, 1]
    h = L.Reshape((len(fields) * dim,))(emb)
    for i, units in enumerate(hidden):
        h = L.Dense(units, activation="relu", name=f"dnn_{i}")(h)
    logit = L.Add()([linear, FMInteraction(name="fm")(emb), L.Dense(1, name="dnn_out")(h)])
    return tf.keras.Model(x, L.Dense(1, activation="sigmoid", name="prob")(logit))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--hidden", default="128,64")
    ap.add_argument("--summary-json", required=True)
    a = ap.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tensorflow_recommenders_addons import dynamic_embedding as de
    from des.callbacks import CPUTime, Throughput
    from des.data.readers import make_dataset
    from des.data.resolve import metadata, spec_for
    from des_ops.comm import init_horovod
    hvd = init_horovod()
    rank, n = hvd.rank(), hvd.size()
    spec = spec_for("criteo", [a.data], a.dim, metadata(a.data))
    # rows shard_rows(batch, rank, N) of every global batch, only those lines parsed (as the PS reads)
    ds = make_dataset(a.data, "criteo", spec, batch_size=a.batch, drop_remainder=True, shard=(rank, n)).take(a.steps)
    ds = ds.map(lambda x, y: ({k: v for k, v in x.items() if k in spec.input_names()}, y))
    model = build(spec, a.dim, [int(u) for u in a.hidden.split(",") if u], n)
    model.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(1e-3), synchronous=True),
                  "binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
    speed, cpu = Throughput(a.batch, STARTED), CPUTime()
    hist = model.fit(ds, verbose=0, callbacks=[speed, cpu]).history
    summary = {"mode": "tfra-alltoall", "world_size": n, "samples_per_second": speed.samples_per_second(),
               "seconds_to_first_step": speed.seconds_to_first_step, "cpu_seconds_per_step": cpu.median(),
               "train_auc_by_step": [[len(hist["auc"]), hist["auc"][-1]]]}
    with open(a.summary_json + (f".rank{rank}" if n > 1 else ""), "w") as fh:
        json.dump(summary, fh, indent=1)
    if rank == 0:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()

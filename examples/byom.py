"""Bring your own model: a DeepCTR DeepFM (or a hand-written Keras DeepFM) on Criteo-format data,
trained with DES by adding ONE line, ``des.transform``, to an ordinary Keras script.

    python examples/byom.py --model deepctr --data data/demo/train.txt                  # 1 process
    mpirun -np 2 --oversubscribe python examples/byom.py --model deepctr --data data/demo/train.txt --save out

The model has static Keras Embedding tables (DeepCTR's SparseFeat), so the reader's 64-bit ids
are folded into [0, vocabulary) in the input pipeline, as a user of such a model does.
"""
from __future__ import annotations

import argparse
import os
import time

STARTED = time.perf_counter()
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

import des  # noqa: E402
from des.data import criteo_spec  # noqa: E402
from des.data.readers import make_dataset  # noqa: E402

L = tf.keras.layers


def deepctr_deepfm(fields: list[str], vocabulary: int, dim: int) -> tf.keras.Model:
    from deepctr.feature_column import SparseFeat
    from deepctr.models import DeepFM
    cols = [SparseFeat(f, vocabulary_size=vocabulary, embedding_dim=dim, dtype="int64") for f in fields]
    return DeepFM(cols, cols, dnn_hidden_units=(64, 32))


def keras_deepfm(fields: list[str], vocabulary: int, dim: int) -> tf.keras.Model:
    """DeepFM as written by hand: one Embedding per field, FM with tf ops, linear part summed."""
    x = {f: tf.keras.Input(shape=(1,), dtype=tf.int64, name=f) for f in fields}
    e = L.Concatenate(axis=1)([L.Embedding(vocabulary, dim)(x[f]) for f in fields])       # [B, F, k]
    s = tf.reduce_sum(e, axis=1)
    fm = 0.5 * tf.reduce_sum(s * s - tf.reduce_sum(e * e, axis=1), axis=1, keepdims=True)
    linear = L.Add()([L.Flatten()(L.Embedding(vocabulary, 1)(x[f])) for f in fields])
    deep = L.Dense(1)(L.Dense(32, activation="relu")(L.Dense(64, activation="relu")(L.Flatten()(e))))
    return tf.keras.Model(x, tf.sigmoid(linear + fm + deep))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["deepctr", "keras"], default="deepctr")
    p.add_argument("--data", required=True)
    p.add_argument("--vocabulary", type=int, default=20_000, help="rows per static table (ids mod this)")
    p.add_argument("--dim", type=int, default=8)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--holdout", type=int, default=20_000, help="last lines of --data for the AUC")
    p.add_argument("--seed", type=int, default=0, help="initial weights (rank 0's are broadcast)")
    p.add_argument("--summary-json", default=None, help="write AUC, log loss and DES bytes per step here (rank 0)")
    p.add_argument("--save", default=None, help="folder: the trained model as Keras saves it (SAVE/model, the "
                                                "untouched DeepFM) and its serving export (SAVE/served)")
    a = p.parse_args()
    tf.keras.utils.set_random_seed(a.seed)

    spec = criteo_spec(dim=a.dim)
    fields = [f.name for f in spec]
    model = (deepctr_deepfm if a.model == "deepctr" else keras_deepfm)(fields, a.vocabulary, a.dim)
    model, report = des.transform(model)        # <- the one DES line: Horovod world under mpirun
    if report.rank == 0:
        print(report, flush=True)

    def fold(x, y):                             # 64-bit ids -> [0, vocabulary), [B, 1] as the model wants
        return {f: tf.reshape(tf.math.floormod(x[f], a.vocabulary), [-1, 1]) for f in fields}, y

    lines = sum(1 for _ in open(a.data))
    train = make_dataset(a.data, "criteo", spec, a.batch, take_lines=lines - a.holdout, shuffle_buffer=50_000,
                         seed=1).map(fold).take(a.steps)
    test = make_dataset(a.data, "criteo", spec, 4096, skip_lines=lines - a.holdout).map(fold)
    model.compile(tf.keras.optimizers.Adam(1e-3), "binary_crossentropy", metrics=[tf.keras.metrics.AUC(name="auc")])
    comm = des.distributed(model).comm           # the collective DES put in the model (des_ops.comm)
    before = comm.counted()["step"]
    first_step = []                              # seconds from the start to the end of the first step
    note = tf.keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: first_step or first_step.append(time.perf_counter() - STARTED))
    model.fit(train, epochs=1, verbose=2 if report.rank == 0 else 0, callbacks=[note])
    after = comm.counted()["step"]
    handed = (after["bytes"] - before["bytes"]) / max(1, after["calls"] - before["calls"])   # one allreduce a step
    result = model.evaluate(test, verbose=0, return_dict=True)
    if a.save:                                   # every process calls them; rank 0 writes
        model.save(os.path.join(a.save, "model"))
        des.export(model, os.path.join(a.save, "served"))
    if report.rank == 0:
        print(f"{a.model} DeepFM, {report.world_size} process(es): held-out AUC {result['auc']:.4f}, "
              f"log loss {result['loss']:.4f}; first step done {first_step[0]:.1f} s after start", flush=True)
        if a.summary_json:
            import json
            with open(a.summary_json, "w") as fh:
                json.dump({"model": f"{a.model} DeepFM", "world_size": report.world_size, "auc": result["auc"],
                           "logloss": result["loss"], "batch": a.batch, "steps": a.steps,
                           "seconds_to_first_step": first_step[0],
                           "des_bytes_handed_per_step": handed,
                           "sent_bytes_per_step": comm.ring_bytes(handed)}, fh, indent=1)


if __name__ == "__main__":
    main()

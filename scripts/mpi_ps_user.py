"""One process of the parameter-server baseline on a user's own model under mpirun (used by
tests/test_mpi.py):

    mpirun -np 3 python scripts/mpi_ps_user.py OUT_DIR

tests/gallery.py's TFRA DeepFM (a TFRA Embedding per field and per linear weight), every rank
built from seed 0, each table sharded by key (des.baselines.ps.rewrite.shard), TFRA's
DynamicEmbeddingOptimizer(legacy Adam 0.02); each rank trains ITS slice of 4 global batches of 31
rows and one of 2 (a rank gets none) and predicts the shared probe; it pickles its predictions and
the rows it holds to OUT_DIR/ps_user.rank<r>.pkl. Then the same model compiled (with an AUC) and
given to ``des.transform(model, des.Options(mode="ps"))``, which takes every global batch whole:
its logged loss and AUC per step and its predictions go in the same file under "transform"; and
DeepCTR's DeepFM with its defaults (Keras Embedding tables, an L2 penalty on them) the same way,
with SGD 0.5, under "keras": it writes a des.checkpoint after the second batch to
OUT_DIR/ps_keras_ckpt and, trained, saves itself (model.save) to OUT_DIR/ps_keras_saved.
"""
import os
import pickle
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

import tensorflow as tf  # noqa: E402

import des  # noqa: E402
from des.baselines.ps.rewrite import shard  # noqa: E402
from des.baselines.ps.tables import KeyExchange, ShardedKeyedEmbedding  # noqa: E402
from des.data.readers import _slice_batch  # noqa: E402
from gallery import BUILDERS, batches_for  # noqa: E402

ROWS, BATCH = 4 * 31 + 2, 31


def user_batches(model):
    """The global batches (4 of 31 rows, one of 2) and the probe every rank and the reference use."""
    x, y = batches_for(model, 1, ROWS, seed=4)[0]
    return ([({k: v[i:i + BATCH] for k, v in x.items()}, y[i:i + BATCH]) for i in range(0, ROWS, BATCH)],
            batches_for(model, 1, 16, seed=99)[0][0])


def build():
    """The user's model, the same on every rank and in the reference (seed 0), keyed."""
    tf.keras.utils.set_random_seed(0)
    model = BUILDERS["tfra_deepfm"]()
    des.make_keyed(model, seed=0)
    return model


def main(out: str) -> None:
    from tensorflow_recommenders_addons import dynamic_embedding as de
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    exchange = KeyExchange()
    rank, n = exchange.rank, exchange.world_size
    model = build()
    batches, probe = user_batches(model)
    ps = shard(model, exchange)
    ps.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(0.02)), "binary_crossentropy")
    sizes = []
    for x, y in batches:
        xs, ys = _slice_batch(x, y, rank, n)
        sizes.append(int(ys.shape[0]))
        ps.train_on_batch(xs, ys)
    rows = {l.field: l.params.export()[0].numpy().tolist() for l in ps.layers if isinstance(l, ShardedKeyedEmbedding)}
    predictions = ps.predict_on_batch(probe)
    user = compiled(build())
    whole, report = des.transform(user, des.Options(mode="ps"), sample=batches[0][0])
    logs = [whole.train_on_batch(x, y, return_dict=True) for x, y in batches]
    transform = {"logs": [(d["loss"], d["auc"]) for d in logs], "predictions": whole.predict_on_batch(probe),
                 "report": str(report)}
    keras_model, keras_batches, keras_probe = deepctr_user()
    whole, _ = des.transform(keras_model, des.Options(mode="ps"), sample=keras_batches[0][0])
    logs = []
    for i, (x, y) in enumerate(keras_batches):
        logs.append(whole.train_on_batch(x, y, return_dict=True))
        if i == 1:                  # every rank its key shard, rows and slots
            des.checkpoint.save(os.path.join(out, "ps_keras_ckpt"), whole, whole.optimizer)
    whole.save(os.path.join(out, "ps_keras_saved"))          # every rank; rank 0 writes the user's model
    keras = {"logs": [(d["loss"], d["auc"]) for d in logs], "predictions": whole.predict_on_batch(keras_probe)}
    with open(os.path.join(out, f"ps_user.rank{rank}.pkl"), "wb") as fh:
        pickle.dump({"rank": rank, "predictions": predictions, "keys": rows, "slice_rows": sizes,
                     "transform": transform, "keras": keras}, fh)


def deepctr_user():
    """DeepCTR's DeepFM with its defaults (seed 0), compiled with SGD 0.5 and an AUC; its batches."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    tf.keras.utils.set_random_seed(0)
    model = BUILDERS["deepctr_deepfm_defaults"]()
    model.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.SGD(0.5)), "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(name="auc")])
    batches, probe = user_batches(model)
    return model, batches, probe


def compiled(model):
    """``model`` compiled as the des.transform check's user compiles it: legacy Adam, an AUC."""
    from tensorflow_recommenders_addons import dynamic_embedding as de
    model.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(0.02)), "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(name="auc")])
    return model


if __name__ == "__main__":
    main(sys.argv[1])

"""Export a checkpoint (any mode, any number of processes) as one SavedModel for serving.

    python -m des.export --checkpoint ckpt --out served

or in Python, here from a checkpoint written in place of a des.train run:

    >>> import json, tempfile, models, numpy as np, tensorflow as tf
    >>> from des import checkpoint
    >>> from des.verify import random_batches, small_spec
    >>> from models.optim import make_optimizer
    >>> spec = small_spec(n_fields=2, dim=4)
    >>> model = models.deepfm(spec, hidden=(8,)); model.compile(make_optimizer("sgd"), "binary_crossentropy")
    >>> loss = model.train_on_batch(*random_batches(spec, steps=1, batch=16)[0])
    >>> tmp = tempfile.mkdtemp(); ckpt, served = os.path.join(tmp, "ckpt"), os.path.join(tmp, "served")
    >>> config = {"model": "deepfm", "hidden": "8", "seed": 0, "spec": json.loads(spec.to_json())}
    >>> _ = checkpoint.save(ckpt, model, None, config=config)
    >>> export(ckpt, served)["rows"]                          # rows of the four tables
    24
    >>> serve = tf.saved_model.load(served).signatures["serving_default"]
    >>> x = {"f0": tf.constant([1000003, 123], tf.int64), "f1": tf.constant([7, 8], tf.int64)}   # a seen id, unseen ones
    >>> p = serve(**x)["probability"]                                      # [B]
    >>> p.shape, bool(np.allclose(p, model.predict_on_batch(x)[:, 0], atol=1e-6))
    (TensorShape([2]), True)
    >>> fresh = models.deepfm(spec, hidden=(8,))      # never trained: its tables hold no rows
    >>> _ = checkpoint.save(os.path.join(tmp, "fresh"), fresh, None, config=config)
    >>> export(os.path.join(tmp, "fresh"), os.path.join(tmp, "fresh_served"))["rows"]
    0
    >>> serve = tf.saved_model.load(os.path.join(tmp, "fresh_served")).signatures["serving_default"]
    >>> bool(np.allclose(serve(**x)["probability"], fresh.predict_on_batch(x)[:, 0], atol=1e-6))
    True
    >>> shutil.rmtree(tmp)

The signature takes the model's inputs as the readers give them: per field int64 ids (FarmHash
Fingerprint64 of ``field\\x1fvalue``, des.data.hashing), [B] or [B, max_len] padded with -1,
``<field>_weight`` float32 for weighted fields, float32 numeric inputs. The dynamic tables
become plain TensorFlow: a ``tf.lookup`` hash table of key -> row index and a [rows, dim]
matrix. A key the checkpoint does not hold reads the row ``key_init(field, key, seed)``, the
same row the trained model reads for an unseen key in inference, so the export predicts what
the checkpoint predicts. It loads with ``tf.saved_model.load`` alone: neither this package nor
TFRA needs to be importable where it is served.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

import tensorflow as tf

from des import checkpoint
from des.checkpoint import CheckpointError
from des.state import state_keys
from models.layers import key_init, pool
from models.spec import PAD_ID

CONFIG = "des_export.json"


def is_export(path: str) -> bool:
    return os.path.exists(os.path.join(path, "saved_model.pb"))


def load_config(path: str) -> dict:
    """The training config saved beside an export (model, spec, format)."""
    name = os.path.join(path, CONFIG)
    if not os.path.exists(name):
        raise FileNotFoundError(f"{path}: a SavedModel without {CONFIG}; des.export writes both")
    with open(name) as fh:
        return json.load(fh)


def serving_inputs(x: dict, signature) -> dict:
    """The reader's batch ``x`` restricted to the inputs of ``signature``."""
    names = signature.structured_input_signature[1].keys()
    return {n: x[n] for n in names}


def _static_embedding_class():


    class StaticFieldEmbedding(tf.keras.layers.Layer):
        """A FieldEmbedding's rows frozen into core TensorFlow (hash table of key -> row, matrix)."""

        def __init__(self, keys, values, dim: int, salt: int, init_scale: float, **kwargs):
            super().__init__(**kwargs)
            self.dim, self.salt, self.init_scale = int(dim), int(salt), float(init_scale)
            self.rows = len(keys)          # the checkpoint's rows (the matrix has at least one)
            self.index = tf.lookup.experimental.MutableHashTable(tf.int64, tf.int64, default_value=-1)
            if len(keys):
                self.index.insert(tf.constant(keys, tf.int64), tf.range(len(keys), dtype=tf.int64))
            # a table with no rows (a field never trained) keeps one unused zero row: tf.gather
            # on a [0, dim] matrix fails even where tf.where then takes key_init's row
            rows = (tf.constant(values, tf.float32, shape=[len(keys), self.dim]) if len(keys)
                    else tf.zeros([1, self.dim]))
            self.matrix = tf.Variable(rows, trainable=False, name="rows")

        def call(self, inputs):
            ids, weights = (inputs[0], inputs[1]) if isinstance(inputs, (list, tuple)) else (inputs, None)
            ids = tf.convert_to_tensor(ids, tf.int64)
            uniq, idx = tf.unique(tf.reshape(ids, [-1]))
            at = self.index.lookup(uniq)
            rows = tf.where((at >= 0)[:, None], tf.gather(self.matrix, tf.maximum(at, 0)),
                            key_init(uniq, self.salt, self.dim, self.init_scale))
            rows = tf.where((uniq == PAD_ID)[:, None], tf.zeros_like(rows), rows)
            return pool(tf.gather(rows, idx), ids, weights, self.dim)

    return StaticFieldEmbedding


def serving_model(model):
    """A copy of a single-process reference model whose FieldEmbedding tables are static lookups."""

    static = _static_embedding_class()
    tables = {id(layer): src for layer, src in state_keys(model).tables.values()}

    def clone(layer):
        if id(layer) in tables:
            if not hasattr(layer, "salt"):
                raise ValueError(f"export handles this project's FieldEmbedding tables; {layer.name!r} is "
                                 f"a {tables[id(layer)].name}")
            keys, values = tables[id(layer)].export(layer)
            return static(keys, values, layer.dim, layer.salt, layer.init_scale, name=layer.name)
        return layer.__class__.from_config(layer.get_config())
    copy = tf.keras.models.clone_model(model, clone_function=clone)
    by_name = {l.name: l for l in copy.layers}
    for layer in model.layers:
        if id(layer) not in tables and layer.weights:
            by_name[layer.name].set_weights(layer.get_weights())
    return copy


def export(checkpoint_dir: str, out: str) -> dict:
    """Write the SavedModel of ``checkpoint_dir`` to ``out`` (which must not exist yet, or be
    empty). Returns {"bytes", "rows"}."""

    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"{out}: exists and is not empty; nothing was written (choose another --out)")
    config = checkpoint.load_config(checkpoint_dir)
    model, _ = checkpoint.reference_model(config)
    checkpoint.restore(checkpoint_dir, model)
    served = serving_model(model)
    specs = {k: tf.TensorSpec([None] + list(t.shape[1:]), t.dtype, name=k) for k, t in served.input.items()}
    fn = tf.function(lambda **x: {"probability": tf.reshape(served(x, training=False), [-1])})
    module = tf.Module()
    module.model = served
    tmp = out.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    tf.saved_model.save(module, tmp, signatures={"serving_default": fn.get_concrete_function(**specs)})
    with open(os.path.join(tmp, CONFIG), "w") as fh:
        json.dump({k: config.get(k) for k in ("model", "format", "dim", "hidden", "seed", "spec")}, fh, indent=1)
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    rows = sum(layer.rows for layer in served.layers if hasattr(layer, "matrix"))
    return {"bytes": size, "rows": rows}


LOAD_CHECK = """
import sys, time
import tensorflow as tf
t = time.perf_counter()
tf.saved_model.load(sys.argv[1]).signatures["serving_default"]
print(f"{time.perf_counter() - t:.2f}", any(m.split(".")[0] in ("des", "tensorflow_recommenders_addons", "models")
                                             for m in sys.modules))
"""


def load_seconds(path: str) -> float:
    """Load ``path`` with plain tf.saved_model.load in a fresh process that imports neither this
    package nor TFRA; the seconds it took."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH="")
    done = subprocess.run([sys.executable, "-c", LOAD_CHECK, os.path.abspath(path)], capture_output=True, text=True,
                          env=env, cwd="/")
    if done.returncode != 0:
        raise RuntimeError(f"{path}: tf.saved_model.load failed: {done.stderr.strip().splitlines()[-1:]}")
    seconds, imported = done.stdout.split()[-2:]
    if imported != "False":
        raise RuntimeError(f"{path}: loading it imported des or TFRA")
    return float(seconds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="folder written by des.train --checkpoint")
    ap.add_argument("--out", required=True, help="new folder for the SavedModel")
    a = ap.parse_args(argv)
    try:
        info = export(a.checkpoint, a.out)
    except (CheckpointError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        seconds = load_seconds(a.out)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"exported {a.checkpoint} to {a.out}: {info['rows']} table rows, {info['bytes'] / 2**20:.1f} MiB; "
          f"tf.saved_model.load in a process without des/TFRA: {seconds:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Export a checkpoint (any mode, any number of processes) as one SavedModel for serving.

    python -m des.export --checkpoint ckpt --out served

or in Python, here from a checkpoint written in place of a des.train run:

    >>> import json, tempfile, models, numpy as np, tensorflow as tf
    >>> from des.runtime import checkpoint
    >>> from des.jobs.verify import random_batches, small_spec
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
import types

import tensorflow as tf

from des.runtime import checkpoint
from des.runtime import saving
from des.runtime.checkpoint import CheckpointError
from des.compiler.handle import comm_of
from des.compiler.keys import state_keys
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

    class StaticTable(tf.keras.layers.Layer):
        """A dynamic table's rows frozen into core TensorFlow: a hash table of key -> row index
        and a matrix; a key it does not hold reads key_init's row, as the trained model does in
        inference."""

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

        def distinct_rows(self, ids):
            """(the rows of the distinct ids, each id's place among them)."""
            uniq, idx = tf.unique(tf.cast(tf.reshape(ids, [-1]), tf.int64))
            at = self.index.lookup(uniq)
            rows = tf.where((at >= 0)[:, None], tf.gather(self.matrix, tf.maximum(at, 0)),
                            key_init(uniq, self.salt, self.dim, self.init_scale))
            return uniq, rows, idx

    class StaticFieldEmbedding(StaticTable):
        """This project's FieldEmbedding, frozen (padding ids read zeros; pooled as it pools)."""

        def call(self, inputs):
            ids, weights = (inputs[0], inputs[1]) if isinstance(inputs, (list, tuple)) else (inputs, None)
            ids = tf.convert_to_tensor(ids, tf.int64)
            uniq, rows, idx = self.distinct_rows(ids)
            rows = tf.where((uniq == PAD_ID)[:, None], tf.zeros_like(rows), rows)
            return pool(tf.gather(rows, idx), ids, weights, self.dim)

    class StaticTFRAEmbedding(StaticTable):
        """A TFRA (Squashed)Embedding made key-deterministic by des.transform / des.make_keyed,
        frozen: what its inference call computes (SquashedEmbedding: reduced as TFRA's
        reduce_pooling reduces)."""

        def __init__(self, keys, values, dim: int, salt: int, init_scale: float, combiner: str | None, **kwargs):
            super().__init__(keys, values, dim, salt, init_scale, **kwargs)
            self.combiner = combiner

        def call(self, ids):
            ids = tf.convert_to_tensor(ids)
            _, rows, idx = self.distinct_rows(ids)
            out = tf.reshape(tf.gather(rows, idx), tf.concat([tf.shape(ids), [self.dim]], 0))
            if self.combiner is None:
                return out
            reduce = getattr(tf.math, f"reduce_{self.combiner}")
            if out.shape.ndims == 2:
                return reduce(out, 0)
            for _ in range(out.shape.ndims - 2):
                out = reduce(out, 1)
            return out

    return StaticFieldEmbedding, StaticTFRAEmbedding


def _has_dynamic_tables(model) -> bool:
    return any(src.dynamic for _, src in state_keys(model).tables.values())


def serving_model(model):
    """A copy of a single-process model whose dynamic tables (this project's FieldEmbedding,
    TFRA's made key-deterministic) are static lookups; a model without them is served as it is."""
    if not _has_dynamic_tables(model):
        return model
    static, static_tfra = _static_embedding_class()
    tables = {id(layer): src for layer, src in state_keys(model).tables.values()}

    def clone(layer):
        if id(layer) in tables and tables[id(layer)].dynamic:
            keys, values = tables[id(layer)].export(layer)
            if hasattr(layer, "salt"):
                return static(keys, values, layer.dim, layer.salt, layer.init_scale, name=layer.name)
            if not hasattr(layer, "des_salt"):
                raise ValueError(f"{layer.name!r} ({tables[id(layer)].name}): a key it does not hold would read a random "
                                 f"row; des.transform (or des.make_keyed) makes its new rows key-deterministic first")
            return static_tfra(keys, values, layer.embedding_size, layer.des_salt, layer.des_scale,
                               layer.combiner if layer.des_squashed else None, name=layer.name)
        return layer.__class__.from_config(layer.get_config())
    copy = tf.keras.models.clone_model(model, clone_function=clone)
    by_name = {l.name: l for l in copy.layers}
    for layer in model.layers:
        if not (id(layer) in tables and tables[id(layer)].dynamic) and layer.weights:
            by_name[layer.name].set_weights(layer.get_weights())
    return copy


def export(checkpoint_dir: str, out: str) -> dict:
    """Write the SavedModel of ``checkpoint_dir`` to ``out`` (which must not exist yet, or be
    empty). Returns {"bytes", "rows"}."""

    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"{out}: exists and is not empty; nothing was written (choose another --out)")
    config = checkpoint.load_config(checkpoint_dir)
    if not {"model", "spec", "hidden", "seed"} <= set(config):
        raise CheckpointError(f"{checkpoint_dir}: a checkpoint of your own model (des.checkpoint.save): it holds its rows "
                              f"and weights, not its architecture; build the model, des.transform it, "
                              f"des.checkpoint.restore into it and call des.export(model, out) on every process")
    model, _ = checkpoint.reference_model(config)
    checkpoint.restore(checkpoint_dir, model)
    served = serving_model(model)
    specs = {k: tf.TensorSpec([None] + list(t.shape[1:]), t.dtype, name=k) for k, t in served.input.items()}
    fn = tf.function(lambda **x: {"probability": tf.reshape(served(x, training=False), [-1])})
    module = tf.Module()
    module.model = served
    tmp = _staging(out)
    tf.saved_model.save(module, tmp, signatures={"serving_default": fn.get_concrete_function(**specs)})
    with open(os.path.join(tmp, CONFIG), "w") as fh:
        json.dump({k: config.get(k) for k in ("model", "format", "dim", "hidden", "seed", "spec")}, fh, indent=1)
    return _published(tmp, out, served)


def _staging(out: str) -> str:
    """An empty folder beside ``out`` to write the SavedModel in before it takes ``out``'s place."""
    tmp = out.rstrip("/") + ".tmp-export"
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _published(tmp: str, out: str, served) -> dict:
    """Move the finished export ``tmp`` to ``out``; {"bytes" on disk, "rows" of its static tables}."""
    if os.path.isdir(out):
        os.rmdir(out)
    os.rename(tmp, out)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    return {"bytes": size, "rows": sum(layer.rows for layer in served.layers if hasattr(layer, "matrix"))}


def _input_specs(model) -> dict:
    """{name: TensorSpec} of ``model``'s inputs, batch dimension free (names: the dict's keys or
    the Input layers' names)."""
    named = model.input.items() if isinstance(model.input, dict) else \
        [(t.name.split(":")[0], t) for t in tf.nest.flatten(model.input)]
    return {k: tf.TensorSpec([None] + list(t.shape[1:]), t.dtype, name=k) for k, t in named}


def export_model(model, out: str) -> dict | None:
    """Write ``model`` (one des.transform returned, on every process at once, or any single-process
    Keras model) as one SavedModel in ``out`` with a ``serving_default`` signature over the model's
    own inputs and outputs (named as Keras names them). Dynamic tables become ``tf.lookup``
    tables: it loads with ``tf.saved_model.load`` or ``tf.keras.models.load_model`` where neither
    des nor TFRA is imported. Every process calls it; rank 0 writes and returns {"bytes", "rows"},
    the others None. ``out`` must not exist or be empty (checked on every process first)."""
    if os.path.exists(out) and os.listdir(out):
        raise ValueError(f"{out}: exists and is not empty; nothing was written (choose another path)")
    if comm_of(model) is None:
        return _write_export(model, out)
    return saving.written_by_root(model, "des.export(model, out)", out, lambda full: _write_export(full, out),
                                  own_class=False)          # a subclassed model: the functional model of its call


def _write_export(model, out: str) -> dict:
    served = serving_model(model)
    specs = _input_specs(served)
    keyed, names = isinstance(served.input, dict), served.output_names

    def serve(**x):
        args = x if keyed else [x[k] for k in specs] if len(specs) > 1 else x[next(iter(specs))]
        return dict(zip(names, tf.nest.flatten(served(args, training=False))))
    tmp = _staging(out)
    signature = tf.function(serve).get_concrete_function(**specs)
    served.save(tmp, save_format="tf", include_optimizer=False, signatures={"serving_default": signature})
    return _published(tmp, out, served)

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


class _ExportModule(types.ModuleType):
    """``des.export(model, out)`` (every process of a DES model, or one process) and
    ``des.export(checkpoint_folder, out)``: this module is callable."""

    def __call__(self, model_or_checkpoint, out: str):
        if isinstance(model_or_checkpoint, (str, os.PathLike)):
            return export(os.fspath(model_or_checkpoint), out)
        return export_model(model_or_checkpoint, out)


sys.modules[__name__].__class__ = _ExportModule


if __name__ == "__main__":
    sys.exit(main())

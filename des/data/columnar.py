"""Columnar copies of a data set, so that a DES process reads only the columns of its own fields.

Under DES every process needs the labels of the whole global batch but only the ids of the fields
it owns. Parsing text makes each process pay for every field, so its input cost does not fall with N
(on ~950-feature lines the run is parse-bound). ``convert`` parses the text once, with the same
readers and the same errors, into one raw binary file per model input; ``make_dataset`` then gathers
just the requested columns of each batch from memory-mapped files.

    python -m des.data.convert --data train.ffm --format libffm --out train.cols
    mpirun -np 4 python -m des.train --mode des --data train.cols      # the format is found from the folder

    >>> import os, shutil, tempfile
    >>> from des.data.libsvm import scan_spec
    >>> tmp = tempfile.mkdtemp()
    >>> with open(os.path.join(tmp, "train.ffm"), "w") as fh:
    ...     _ = fh.write("1 0:5:1 1:7:1\\n0 0:6:1 1:7:1 1:8:1\\n1 0:5:1\\n")
    >>> spec = scan_spec([os.path.join(tmp, "train.ffm")], "libffm", dim=8)
    >>> manifest = convert([os.path.join(tmp, "train.ffm")], "libffm", spec, os.path.join(tmp, "train.cols"))
    >>> manifest["rows"]
    3
    >>> ds = make_dataset(os.path.join(tmp, "train.cols"), spec, 4096, shuffle_buffer=50_000, seed=1, inputs=["F1"])
    >>> x, y = next(iter(ds)); sorted(x), sorted(y.numpy().tolist())     # rows in a seeded shuffled order
    (['F0', 'F0_weight', 'F1', 'F1_weight'], [0.0, 1.0, 1.0])
    >>> bool((x["F0"].numpy() == PAD_ID).all()), bool((x["F1"].numpy() != PAD_ID).any())   # F0 not read
    (True, True)
    >>> shutil.rmtree(tmp)

Same arguments, same batches: the row order is ``des.data.readers.order`` of the row numbers,
the very order the text reader gives lines, so a columnar run sees the batches
a text run sees (tests/test_columnar.py checks it batch by batch). Inputs not requested are filled
with padding (ids ``PAD_ID``, weights and numbers 0) and must not be read by the model on this
process.

The folder: ``columns.json`` (rows, spec, source files and format, each input's dtype and trailing
shape) and ``<input>.bin`` / ``label.bin``, little-endian, row-major.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Sequence

import numpy as np
import tensorflow as tf

from des.data.errors import DataError, op_error_message
from des.data.readers import make_dataset as text_dataset, order
from models.spec import PAD_ID, FeatureSpec

MANIFEST = "columns.json"
LABEL = "label"


def is_columnar(path: str | Sequence[str]) -> bool:
    """True for a folder written by ``convert`` (or a one-element list of one)."""
    if not isinstance(path, (str, os.PathLike)):
        path = list(path)
        if len(path) != 1:
            return False
        path = path[0]
    return os.path.isfile(os.path.join(path, MANIFEST))


def manifest(folder: str) -> dict:
    path = os.path.join(folder, MANIFEST)
    if not os.path.isfile(path):
        raise DataError(f"{folder}: not a columnar data folder (no {MANIFEST}; write one with "
                        f"python -m des.data.convert)")
    with open(path) as fh:
        return json.load(fh)


def spec_of(folder: str) -> FeatureSpec:
    return FeatureSpec.from_json(json.dumps(manifest(folder)["spec"]))


def convert(paths: Sequence[str], fmt: str, spec: FeatureSpec, out: str, *, chunk: int = 65_536,
            skip_bad_lines: bool = False, skip_report=None, extra: dict | None = None) -> dict:
    """Parse ``paths`` once with the text readers (same checks, same file:line errors) and write
    one column file per model input plus the labels into the new folder ``out``. Returns the
    manifest (``extra`` is merged into it, e.g. the generator's Bayes-optimal AUC). Written to
    ``out + '.incoming'`` first and renamed when complete."""
    if os.path.exists(out):
        raise DataError(f"{out}: already exists; remove it or choose another --out")
    tmp = out + ".incoming"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    os.makedirs(tmp)
    ds = text_dataset(list(paths), fmt, spec, chunk, skip_bad_lines=skip_bad_lines, skip_report=skip_report)
    files, columns, rows = {}, {}, 0
    try:
        for feats, label in _batches(ds):
            arrays = dict({k: v.numpy() for k, v in feats.items()}, **{LABEL: label.numpy()})
            for name, arr in arrays.items():
                arr = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
                col = {"dtype": arr.dtype.str, "shape": list(arr.shape[1:])}
                if name not in files:
                    files[name] = open(os.path.join(tmp, f"{name}.bin"), "wb")
                    columns[name] = col
                elif columns[name] != col:
                    raise DataError(f"{name}: column shape changed from {columns[name]} to {col}")
                files[name].write(arr.tobytes())
            rows += len(arrays[LABEL])
    except DataError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        for fh in files.values():
            fh.close()
    if rows == 0:
        raise DataError(f"{paths[0]}: no data lines")
    meta = {"rows": rows, "spec": json.loads(spec.to_json()), "source": [str(p) for p in paths],
            "source_format": fmt, "columns": columns, **(extra or {})}
    with open(os.path.join(tmp, MANIFEST), "w") as fh:
        json.dump(meta, fh, indent=1)
    os.rename(tmp, out)
    return meta


def _batches(ds):
    """Iterate a reader; a bad line (an OpError carrying the reader's DataError) is a DataError."""
    it = iter(ds)
    while True:
        try:
            yield next(it)
        except StopIteration:
            return
        except tf.errors.OpError as e:
            msg = op_error_message(e)
            raise DataError(msg.split("DataError: ", 1)[-1]) from None


def _column(folder: str, name: str, col: dict, rows: int) -> np.ndarray:
    path = os.path.join(folder, f"{name}.bin")
    shape = (rows, *col["shape"])
    want = int(np.prod(shape)) * np.dtype(col["dtype"]).itemsize
    if not os.path.isfile(path) or os.path.getsize(path) != want:
        have = os.path.getsize(path) if os.path.isfile(path) else "missing"
        raise DataError(f"{path}: expected {want} bytes for {shape} {col['dtype']}, found {have}; "
                        f"convert the data again")
    return np.memmap(path, dtype=np.dtype(col["dtype"]), mode="r", shape=shape)


def make_dataset(folder: str, spec: FeatureSpec, batch_size: int, *, shuffle_buffer: int = 0, seed: int = 0,
                 epochs: int = 1, shard=None, drop_remainder: bool = False,
                 take_lines: int | None = None, skip_lines: int = 0,
                 inputs: Sequence[str] | None = None) -> tf.data.Dataset:
    """Batches of ``({input: tensor}, label)`` like ``des.data.readers.make_dataset`` over the text
    the folder was converted from; only ``inputs`` (default: all) are read, the others padded."""
    meta = manifest(folder)
    rows, columns = int(meta["rows"]), meta["columns"]
    names = spec.input_names()
    missing = [n for n in names if n not in columns]
    if missing:
        raise DataError(f"{folder}: no column for input(s) {missing[:5]}; it holds {sorted(columns)[:8]}...")
    wanted = names if inputs is None else [n for n in names if n in set(inputs)]
    unknown = sorted(set(inputs or ()) - set(names))
    if unknown:
        raise DataError(f"{folder}: inputs {unknown} are not in the spec")
    read = wanted + [LABEL]
    arrays = [_column(folder, n, columns[n], rows) for n in read]
    dtypes = [tf.as_dtype(a.dtype.newbyteorder("=")) for a in arrays]

    def gather(idx):
        return [np.asarray(a[idx]) for a in arrays]

    @tf.autograph.experimental.do_not_convert   # plain TF ops: autograph would only slow the start
    def load(idx):
        got = tf.numpy_function(gather, [idx], dtypes, stateful=False)
        b = tf.shape(idx)[0]
        out = {}
        for n in names:
            col = columns[n]
            if n in wanted:
                t = got[wanted.index(n)]
            else:
                fill = PAD_ID if np.dtype(col["dtype"]).kind in "iu" else 0
                t = tf.fill(tf.concat([[b], tf.constant(col["shape"], tf.int32)], 0),
                            tf.constant(fill, tf.as_dtype(np.dtype(col["dtype"]).newbyteorder("="))))
            out[n] = tf.ensure_shape(t, [None, *col["shape"]])
        return out, tf.ensure_shape(got[-1], [None])

    ds = order(rows, batch_size=batch_size, drop_remainder=drop_remainder, skip_lines=skip_lines,
               take_lines=take_lines, epochs=epochs, shuffle_buffer=shuffle_buffer, seed=seed)
    allocated = shard is not None and hasattr(shard, "take")
    if shard is not None and not allocated:
        rank, world = shard
        ds = ds.map(tf.autograph.experimental.do_not_convert(lambda idx: _slice(idx, rank, world)))
    ds = ds.map(load, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    if allocated:          # an allocator reads the whole batch's ids, then keeps this process's rows
        ds = ds.map(shard.take)
    return ds.prefetch(tf.data.AUTOTUNE)


def _slice(idx, rank: int, world: int):
    """Rows [b*rank//world, b*(rank+1)//world) of a global batch (gathered after slicing: a
    PS process reads only its slice)."""
    b = tf.shape(idx, out_type=tf.int64)[0]
    return idx[b * rank // world: b * (rank + 1) // world]

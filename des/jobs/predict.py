"""Predict click probabilities with a checkpoint written by ``des.train --checkpoint``.

    python -m des.predict --checkpoint ckpt --data test.txt --out predictions.txt
    mpirun -np 4 python -m des.predict --checkpoint ckpt --data test.txt --out predictions.txt

Writes one probability per input line, in input order. The model, widths and FeatureSpec
come from the checkpoint's config. Any checkpoint (single, DES or PS, any number of processes)
is read by one process, or by DES on any number under mpirun (each process restores its own
fields); rank 0 writes. ``--checkpoint`` may also be a folder written by ``des.export``.
Criteo's ``test.txt`` (39 columns, no label) and Avazu's ``test.csv`` (no click column) are
recognised from the first line; labelled files work too, and then AUC and log loss are
printed. A malformed line stops the run naming file and line (predictions must stay aligned
with the input lines, so there is no skip option).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import tensorflow as tf

import des
from des.runtime import checkpoint
from des.runtime import export
from des.data import DataError, FeatureSpec
from des.data.errors import op_error_message
from des.data.files import check_paths, open_text
from des.data.readers import make_dataset
from des_ops.mpi import default_communicator


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True,
                    help="folder written by des.train --checkpoint, or by des.export")
    ap.add_argument("--data", required=True, nargs="+", help="input files (.gz allowed)")
    ap.add_argument("--out", required=True, help="output: one probability per input line")
    ap.add_argument("--format", default=None,
                    choices=["criteo", "criteo-test", "avazu", "avazu-test", "libsvm", "libffm"],
                    help="default: the training format; Criteo/Avazu without a label column "
                         "are recognised from the first line")
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=0, help="TF intra/inter-op threads (0: TF default)")
    return ap.parse_args(argv)


def detect_format(trained_format: str, path: str) -> str:
    """The training format, or its label-less variant when the first line has no label column.

    >>> import os, shutil, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "test.txt")
    >>> with open(path, "w") as fh:
    ...     _ = fh.write("\\t".join(["1"] * 39) + "\\n")
    >>> detect_format("criteo", path)          # 39 TAB-separated columns
    'criteo-test'
    >>> shutil.rmtree(os.path.dirname(path))
    """
    if trained_format not in ("criteo", "avazu"):
        return trained_format
    check_paths([path])
    with open_text(path) as fh:
        first = fh.readline().rstrip(b"\r\n")
    if trained_format == "criteo":
        n = first.count(b"\t") + 1
        if n in (39, 40):
            return "criteo" if n == 40 else "criteo-test"
        raise DataError(f"{path}:1: expected 40 (train) or 39 (test) tab-separated columns, found {n}")
    header = first.decode("utf-8", "replace").split(",")
    return "avazu" if "click" in header else "avazu-test"


def main(argv=None) -> int:
    a = _args(argv)
    if a.threads:
        tf.config.threading.set_intra_op_parallelism_threads(a.threads)
        tf.config.threading.set_inter_op_parallelism_threads(a.threads)

    exported = export.is_export(a.checkpoint)
    try:
        config = export.load_config(a.checkpoint) if exported else checkpoint.load_config(a.checkpoint)
        fmt = a.format or detect_format(config["format"], a.data[0])
    except (FileNotFoundError, DataError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    comm = default_communicator("local" if exported else "auto")
    log = (lambda *m: print(*m, flush=True)) if comm.rank == 0 else (lambda *m: None)

    try:
        if exported:
            spec = FeatureSpec.from_json(json.dumps(config["spec"]))
            serve = tf.saved_model.load(a.checkpoint).signatures["serving_default"]
            predict = lambda x: serve(**export.serving_inputs(x, serve))["probability"]  # noqa: E731
        else:
            model, spec = checkpoint.reference_model(config)
            if comm.world_size > 1:
                plan = checkpoint.load_plan(a.checkpoint, comm.world_size)
                model, _ = des.transform(model, des.Options(plan=plan or "balanced"), comm=comm, spec=spec)
            checkpoint.restore(a.checkpoint, model, None, comm.rank, comm.world_size)
            predict = tf.function(lambda x: model(x, training=False))
        data = make_dataset(a.data, fmt, spec, a.batch)
        probs, labels = [], []
        for x, y in data:
            probs.append(predict(x).numpy().reshape(-1))
            labels.append(y.numpy())
    except (FileNotFoundError, DataError, checkpoint.CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except tf.errors.OpError as e:
        print(f"error: {op_error_message(e)}", file=sys.stderr)
        return 2
    p = np.concatenate(probs) if probs else np.zeros(0, np.float32)
    if comm.rank == 0:
        tmp = a.out + ".tmp"
        np.savetxt(tmp, p, fmt="%.9g")
        os.replace(tmp, a.out)
    how = "export" if exported else f"{config['mode']} checkpoint of {config['world_size']} process(es)"
    log(f"wrote {p.size} predictions to {a.out} ({config['model']}, {how}, read by "
        f"{comm.world_size} process(es), format {fmt})")
    if not fmt.endswith("-test"):
        y = np.concatenate(labels)
        auc = tf.keras.metrics.AUC(num_thresholds=10_000)
        auc.update_state(y, p)
        loss = float(tf.keras.losses.binary_crossentropy(y, p))
        log(f"AUC {float(auc.result()):.4f}, log loss {loss:.4f} against the labels in the file")
    return 0


if __name__ == "__main__":
    sys.exit(main())

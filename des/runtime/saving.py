"""Keras's own saving for a model des.transform returned: ``model.save(path)``,
``model.save_weights(path)`` and ``tf.keras.callbacks.ModelCheckpoint`` write the UNTOUCHED
architecture (the model the user passed to des.transform) with every trained weight.

Every process calls the save (as it calls ``fit``); each hands its rows, kernel rows and, on
rank 0, the replicated weights to rank 0 (des.checkpoint's shard format, gathered in pieces of
``CHUNK`` bytes), rank 0 loads them into the untouched model and lets Keras write it; the other
processes write nothing. The processes first check that they save the same thing to the same
path: a disagreement ends every process at once with one line naming the ranks. A save that
some processes never call is a collective that never completes: Horovod's stall check ends the
job (des_ops.comm: after ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``, 60 s by default), naming
the missing ranks. Nothing is ever written from one process's share alone.

    >>> import des, models, tempfile, numpy as np, tensorflow as tf
    >>> from des.jobs.verify import random_batches, small_spec
    >>> spec = small_spec(n_fields=2, dim=4)
    >>> model, _ = des.transform(models.deepfm(spec, hidden=(8,)))
    >>> model.compile(models.make_optimizer("adam", 0.01), "binary_crossentropy")
    >>> x, y = random_batches(spec, steps=1, batch=16)[0]
    >>> _ = model.fit(x, y, verbose=0)
    >>> path = os.path.join(tempfile.mkdtemp(), "model")
    >>> model.save(path)                        # the untouched DeepFM with its trained weights
    >>> again = tf.keras.models.load_model(path, compile=False)
    >>> bool(np.allclose(again.predict_on_batch(x), model.predict_on_batch(x), atol=1e-6))
    True
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Iterator

import numpy as np
import tensorflow as tf

from des.runtime.checkpoint import Shards, shard_bytes, shard_kinds
from des.compiler.handle import comm_of, distributed
from des.graph.sources import source_of
from des_ops.stripes import keep_own_rows
from des.runtime.state import export_rows, load_rows
from des.compiler.keys import model_keys
from des_ops.comm import Communicator
from des_ops.keras_internals import untrack

CHUNK = 64 << 20        # bytes a process hands to one all-gather of a save


class SaveError(RuntimeError):
    """A save the processes cannot complete together (they disagree on it)."""


def allgather_bytes(comm: Communicator, data: bytes, name: str) -> list[bytes]:
    """Every process's ``data``, in rank order, on every process: all-gathers of at most
    ``CHUNK`` bytes a process, the same number on every process whatever each holds."""
    if comm.world_size == 1:
        return [data]
    sizes = comm.allgather(tf.constant([len(data)], tf.int64), f"{name}_sizes").numpy()
    parts: list[list[bytes]] = [[] for _ in sizes]
    for i in range(int(-(-max(sizes) // CHUNK))):
        mine = np.frombuffer(data[i * CHUNK:(i + 1) * CHUNK], np.uint8)
        got = comm.allgather(tf.constant(mine, tf.uint8), f"{name}_part").numpy()
        at = 0
        for r, size in enumerate(sizes):
            n = int(min(CHUNK, max(0, size - i * CHUNK)))
            parts[r].append(got[at:at + n].tobytes())
            at += n
    return [b"".join(p) for p in parts]


def agree_on(comm: Communicator, what: str, text: str) -> None:
    """Raise SaveError on EVERY process unless all of them pass the same ``text``; the message
    names the ranks of each value. One small all-gather: no process goes on alone."""
    texts = [t.decode() for t in allgather_bytes(comm, text.encode(), "des_save_agree")]
    if len(set(texts)) > 1:
        by: dict[str, list[int]] = {}
        for r, t in enumerate(texts):
            by.setdefault(t, []).append(r)
        raise SaveError(f"{what}: the processes disagree: " + "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {t!r}" for t, rs in by.items()))


@contextlib.contextmanager
def untouched(model: tf.keras.Model, what: str = "save", own_class: bool = True) -> Iterator[tf.keras.Model | None]:
    """On rank 0, the model des.transform was given, holding every process's trained rows and
    weights (None elsewhere); a subclassed model as its own class writes it, or with
    ``own_class=False`` as the functional model of its ``call`` that DES traced (same layers).
    Every process must enter it; afterwards rank 0 drops again the rows it does not own. A model
    des.transform did not change is yielded as it is."""
    handle = distributed(model)
    if handle is None:
        gathered = getattr(model, "des_untouched", None)      # a model that gathers itself (mode ps)
        with gathered() if gathered is not None else contextlib.nullcontext(model) as full:
            yield full
        return
    comm, source = handle.comm, handle.source
    blobs = allgather_bytes(comm, shard_bytes(export_rows(model, None, shard_kinds(model, comm.rank))),
                            "des_save_rows")
    if comm.rank != 0:
        yield None
        return
    kept = set(handle.state.tables)
    consumed = source.__dict__.get("call")          # des.compiler marked the model consumed
    # tables whose rows des.transform moved into a fused table: for the save, their own storage again
    fused = {layer: tuple(layer.des_fused) for layer in source.submodules
             if getattr(layer, "des_fused", None) is not None}
    keys = None
    # TFRA tables split by key stripe hold one stripe here: the save gathers all of them, then drops the others
    striped = {layer: layer.des_key_stripe for layer in source.submodules
               if getattr(layer, "des_key_stripe", None) is not None}
    try:
        for layer in striped:
            layer.des_key_stripe = None
        for layer in fused:
            untrack(layer, "des_fused")             # nor tracked: Keras must not write the fused table with it
        for layer in source.submodules:             # released tables (a nested model's too) get storage back
            if getattr(layer, "des_released", False):
                source_of(layer).reacquire(layer)
        keys = model_keys(source)                   # load_rows and serving_model read the same keys
        if consumed is not None:
            del source.call
        try:
            missing = load_rows(source, None, Shards(blobs=blobs))
        except KeyError as e:
            raise SaveError(f"{what}: {e.args[0]}") from None
        if missing:
            raise SaveError(f"{what}: no process holds {', '.join(missing[:3])}: the model's state is incomplete")
        with as_written(handle.subclassed, handle.frozen) if handle.subclassed is not None and own_class \
                else contextlib.nullcontext(source) as full:
            yield full
    finally:
        for key, (layer, src) in (keys.tables.items() if keys is not None else ()):
            # a fused table's member: its rows live in the fused table; a table split by key range: in ranges
            if key not in kept or layer in fused or handle.state.tables[key][0] is not layer:
                src.release(layer)
        for layer, where in fused.items():
            layer.des_fused = where
        for layer, stripe in striped.items():
            layer.des_key_stripe = stripe
            keep_own_rows(source_of(layer), layer)
        if consumed is not None:
            source.call = consumed


@contextlib.contextmanager
def as_written(model: tf.keras.Model, frozen: list) -> Iterator[tf.keras.Model]:
    """A subclassed model des.transform rewrote in place, as its own class writes it: its own
    ``call`` (not the DES forward pass), without the DES model it holds, the substituted Dense
    layers trainable again (des.compiler froze them: their kernels live in the owners' blocks)."""
    call, forward = model.__dict__.get("call"), model.__dict__.get("des_forward")
    del model.call
    untrack(model, "des_forward")
    for layer in frozen:
        layer.trainable = True
    try:
        yield model
    finally:
        for layer in frozen:
            layer.trainable = False
        model.des_forward = forward
        model.call = call


def written_by_root(model: tf.keras.Model, what: str, path, write: Callable, own_class: bool = True):
    """Every process: check that all save ``what`` to ``path``, gather the untouched model
    (``untouched``), let rank 0 ``write(model)``, then tell every process how that went: a write
    that fails on rank 0 raises the same one-line SaveError on every process (none goes on into
    a collective rank 0 will not join). Returns ``write``'s result on rank 0, None elsewhere."""
    comm = comm_of(model)
    agree_on(comm, what, f"{what} to {os.fspath(path)}")
    result, failure = None, None
    try:
        with untouched(model, what, own_class) as full:
            if full is not None:
                result = write(full)
    except Exception as e:  # noqa: BLE001 - reported to every process below
        if comm.rank != 0 or comm.world_size == 1:
            raise
        failure = e
    said = allgather_bytes(comm, (f"{type(failure).__name__}: {failure}".splitlines()[0] if failure else "").encode(),
                           "des_save_done")[0].decode()
    if said:
        raise SaveError(f"{what}: rank 0 could not write {os.fspath(path)!r}: {said}") from failure
    return result


def _keras_save(model: tf.keras.Model, method: str, filepath, *args, **kwargs) -> None:
    """``model.save`` / ``model.save_weights`` of a DES model: every process calls it, rank 0
    writes the untouched model with Keras's own method."""
    written_by_root(model, f"model.{method}", filepath,
                    lambda full: getattr(type(full), method)(full, filepath, *args, **kwargs))


def save(model: tf.keras.Model, filepath, *args, **kwargs) -> None:
    """``model.save`` of a DES model (the untouched model, written by rank 0)."""
    _keras_save(model, "save", filepath, *args, **kwargs)


def save_weights(model: tf.keras.Model, filepath, *args, **kwargs) -> None:
    """``model.save_weights`` of a DES model (the untouched model's weights, written by rank 0)."""
    _keras_save(model, "save_weights", filepath, *args, **kwargs)


def refuse(model: tf.keras.Model, why: str) -> None:
    """Make ``model.save`` and ``model.save_weights`` raise SaveError(``why``) (a model whose
    towers des.transform rewrote one by one: each tower saves, the whole does not yet)."""
    def refused(*_, **__):
        raise SaveError(why)
    object.__setattr__(model, "save", refused)
    object.__setattr__(model, "save_weights", refused)


def install(model: tf.keras.Model, save_refusal: str = "") -> None:
    """Make ``model.save`` and ``model.save_weights`` (and so ModelCheckpoint) gather and write
    the untouched model: des.transform does, for the model it returns and the towers it rewrote
    in it; ``save_refusal`` (the report's): they raise SaveError with that reason instead."""
    towers = [v for v in vars(model).values() if isinstance(v, tf.keras.Model) and v is not model]
    for m in [model] + towers:
        if distributed(m) is not None:
            for method in ("save", "save_weights"):
                object.__setattr__(m, method, functools.partial(_keras_save, m, method))
    if save_refusal:
        refuse(model, save_refusal)


__all__ = ["save", "save_weights", "untouched", "allgather_bytes", "agree_on", "SaveError"]

"""Checkpoints whose meaning does not depend on the mode or the number of processes that wrote
them, so single, DES on N and PS on N can all restore them on any M.

    >>> import tempfile, models, tensorflow as tf
    >>> from des_ops.mpi import default_communicator
    >>> from models.optim import make_optimizer
    >>> from des.jobs.verify import random_batches, small_spec
    >>> spec = small_spec(n_fields=2, dim=4)
    >>> model, optimizer = models.deepfm(spec, hidden=(8,)), make_optimizer("adam")
    >>> model.compile(optimizer, "binary_crossentropy")
    >>> x, y = random_batches(spec, steps=1, batch=16)[0]
    >>> loss = model.train_on_batch(x, y)
    >>> comm = default_communicator()
    >>> b = lambda: comm.allreduce_counted(tf.zeros([1]), "barrier")   # as des.train's barrier
    >>> ckpt = tempfile.mkdtemp()
    >>> save(ckpt, model, optimizer, rank=comm.rank, world_size=comm.world_size, barrier=b,
    ...      config={"model": "deepfm"}, position={"epoch": 1, "step": 0})
    '.../state'
    >>> restore(ckpt, model, optimizer, rank=0, world_size=1)      # any mode, any M
    '.../state'
    >>> sorted(os.listdir(os.path.join(ckpt, "state")))
    ['config.json', 'rank0-of-1.npz']
    >>> shutil.rmtree(ckpt)

Layout (``ckpt/state/``, swapped in whole; ``state.old``, the save before it, is kept, so the last two
complete checkpoints are there, and read when ``state`` is missing, as after a crash mid-swap):

- ``config.json`` (rank 0): the job's config (model, widths, FeatureSpec, mode, world size,
  field plan), the data position (epoch, step, seed) and the optimizers' step counts;
- ``rank<r>-of-<N>.npz``: what process r held, by rank-independent keys (des.runtime.state.pieces):
  per table its rows as keys, values and each optimizer slot's rows; the kernel rows of each
  field (DES owners); the replicated weights with their slots (rank 0 only).

Restore reads every shard and keeps what the new model holds: a DES process the tables of
its fields (all keys), a PS process the keys it owns (key mod M), one process everything.
Slots travel with their rows. New keys after restore are initialised from (field, key, seed)
as before, so a restored model continues exactly as the model that wrote it would.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import zipfile
from typing import Callable

import numpy as np

import models
from des.data import FeatureSpec
from des.data.hashing import ID_MASK
from des.compiler.handle import comm_of, distributed
from des.compiler.plan import FieldPlan
from des.compiler.keys import create_slots, optimizer_parts
from des.runtime.state import export_rows, load_rows, pieces
from des_ops.fused import FusedTable

FORMAT = 3          # 3: ids of 55 bits (des.data.hashing); 2 (63-bit ids) is read by keeping the low 55 bits


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: the message names the file and the problem."""


def _shard_name(rank: int, world_size: int) -> str:
    return f"rank{rank}-of-{world_size}.npz"


def _npz(fh, entries: dict) -> None:
    """Write ``entries`` ({(kind, key): {name: array}}, des.runtime.state.export_rows) as one npz to ``fh``."""
    index, arrays = [], {}
    for (kind, key), entry in entries.items():
        for name, value in entry.items():
            arrays[f"a{len(index)}"] = np.asarray(value)
            index.append([kind, key, name])
    arrays["index"] = np.array(json.dumps(index))
    np.savez(fh, **arrays)


def shard_bytes(entries: dict) -> bytes:
    """``entries`` as the bytes of one checkpoint shard (what des.runtime.saving gathers on rank 0)."""
    buf = io.BytesIO()
    _npz(buf, entries)
    return buf.getvalue()


def shard_kinds(model, rank: int) -> tuple[str, ...]:
    """What process ``rank`` contributes to a save: under DES the tables and kernel rows of its
    fields, under the PS its key shard of every table, rank 0 also the replicated weights (and
    everything of a replicated model)."""
    kinds = {"table", "owned", "weight"} if rank == 0 else set()
    des_model = distributed(model) is not None
    if rank != 0 and (des_model or _sharded(model)):
        kinds |= {"table", "owned"} if des_model else {"table"}
    return tuple(sorted(kinds))


def _write_npz(path: str, entries: dict) -> None:
    with open(path + ".tmp", "wb") as fh:
        _npz(fh, entries)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(path + ".tmp", path)


def _world(model, rank: int | None, world_size: int | None, barrier=None):
    """(rank, world size, barrier): as given, else those of the DES model's communicator (a
    small allreduce as the barrier; a mode-ps model's too), else one process."""
    comm = comm_of(model)
    if comm is None:
        return rank or 0, world_size or 1, barrier or (lambda: None)
    if barrier is None and comm.world_size > 1:
        barrier = lambda: comm.allreduce_counted(np.zeros([1], np.float32), "barrier")  # noqa: E731
    return (comm.rank if rank is None else rank, comm.world_size if world_size is None else world_size,
            barrier or (lambda: None))


def save(directory: str, model, optimizer, plan: FieldPlan | None = None, rank: int | None = None,
         world_size: int | None = None, config: dict | None = None, position: dict | None = None,
         barrier: Callable[[], None] | None = None) -> str:
    """Every process calls it at the same step (``barrier`` waits for all, as allreduce does).
    A crash before the swap leaves the previous checkpoint as it was. For a model des.transform
    returned, ``rank``, ``world_size`` and ``barrier`` default to its communicator's:
    ``des.checkpoint.save(folder, model, model.optimizer)`` on every process."""
    rank, world_size, barrier = _world(model, rank, world_size, barrier)
    if plan is None and distributed(model) is not None:
        plan = distributed(model).plan
    kinds = shard_kinds(model, rank)
    entries = export_rows(model, optimizer, kinds=kinds) if kinds else {}    # before anything is written
    incoming, final = os.path.join(directory, ".incoming"), os.path.join(directory, "state")
    if rank == 0:
        shutil.rmtree(incoming, ignore_errors=True)
        os.makedirs(incoming)
    barrier()
    _write_npz(os.path.join(incoming, _shard_name(rank, world_size)), entries)
    barrier()
    if rank == 0:
        meta = dict(config or {}, checkpoint_format=FORMAT, world_size=world_size,
                    plan=json.loads(plan.to_json()) if plan is not None else None,
                    position=position or {},
                    iterations=[int(optimizer.iterations.numpy())] +
                               [int(p.iterations.numpy()) for p in optimizer_parts(optimizer)]
                    if optimizer is not None else [])
        with open(os.path.join(incoming, "config.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
        old = final + ".old"                # the previous complete checkpoint stays: the last two are kept
        if os.path.isdir(final):
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(incoming, final)
    barrier()
    return final


def _sharded(model) -> bool:
    return any(kind == "table" and getattr(var, "exchange", None) is not None
               for kind, _, var, _ in pieces(model))


def latest(directory: str) -> str | None:
    """The folder of the newest complete checkpoint in ``directory`` (None if there is none)."""
    for path in (os.path.join(directory, "state"), os.path.join(directory, "state.old")):
        if os.path.exists(os.path.join(path, "config.json")):
            return path
    return None


def _require(directory: str) -> str:
    path = latest(directory)
    if path is None:
        if os.path.isdir(directory) and any(n.startswith("rank") for n in os.listdir(directory)):
            raise CheckpointError(f"{directory}: a checkpoint of an older des.train (per-rank folders); "
                                  f"train again to write one this version reads")
        what = "no such folder" if not os.path.isdir(directory) else "no checkpoint in it (no state/config.json)"
        raise CheckpointError(f"{directory}: {what}; des.train --checkpoint writes one")
    return path


def load_config(directory: str) -> dict:
    """The config saved with the checkpoint: model, spec, mode, world size, plan, position."""
    path = os.path.join(_require(directory), "config.json")
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None


def load_plan(directory: str, world_size: int) -> FieldPlan | None:
    """The saved field plan if it was made for ``world_size`` processes (else None: make a new one)."""
    plan = load_config(directory).get("plan")
    return FieldPlan(**plan) if plan and plan["world_size"] == world_size else None


MUST_MATCH = {"model": "--model", "dim": "--dim", "hidden": "--hidden",
              "optimizer": "--optimizer", "linear_optimizer": "--linear-optimizer"}


def check_config(directory: str, config: dict) -> None:
    """Raise CheckpointError naming every setting in which ``config`` (this run) differs from the
    checkpoint's: its rows would not fit this model (the mode and process count may differ)."""
    saved = load_config(directory)
    diff = [f"{flag} {saved.get(k)} (this run: {config.get(k)})" for k, flag in MUST_MATCH.items()
            if k in config and saved.get(k) != config.get(k)]
    if saved.get("spec") is not None and config.get("spec") is not None and saved["spec"] != config["spec"]:
        diff.append("another feature spec (fields, widths or vocabularies)")
    if diff:
        raise CheckpointError(f"{directory}: the checkpoint was written with {'; '.join(diff)}: "
                              f"restore with the same settings")


class Shards:
    """All shards of one checkpoint (files of a folder, or bytes gathered from every process),
    read lazily: entries(kind, key) -> [{name: array}]."""

    def __init__(self, path: str | None = None, world_size: int = 0, blobs: list[bytes] = ()):
        self.files, self.where = [], {}
        sources = [(os.path.join(path, _shard_name(r, world_size)), None) for r in range(world_size)] if path else \
            [(f"rank {r}'s rows", io.BytesIO(b)) for r, b in enumerate(blobs)]
        for r, (name, data) in enumerate(sources):
            if data is None and not os.path.exists(name):
                raise CheckpointError(f"{name}: missing (the checkpoint was written by {world_size} "
                                      f"processes; this shard is gone)")
            try:
                npz = np.load(name if data is None else data, allow_pickle=False)
                index = json.loads(str(npz["index"]))
            except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as e:
                raise CheckpointError(f"{name}: truncated or not a checkpoint shard ({e})") from None
            self.files.append((name, npz))
            for i, (kind, key, field) in enumerate(index):
                self.where.setdefault((kind, key), {}).setdefault(r, {})[field] = f"a{i}"

    def __call__(self, kind: str, key: str):
        for r, fields in sorted(self.where.get((kind, key), {}).items()):
            name, npz = self.files[r]
            try:
                yield {f: npz[a] for f, a in fields.items()}
            except (OSError, ValueError, zipfile.BadZipFile, EOFError) as e:
                raise CheckpointError(f"{name}: truncated or corrupt ({e})") from None


def _with_55_bit_ids(shards: "Shards", path: str):
    """Entries of a format-2 checkpoint with its table ids as this version's readers make them: the
    low 55 bits of the 63-bit ids (des.data.hashing). Two ids of one table that meet stop the restore."""

    def entries(kind: str, key: str):
        saved = list(shards(kind, key))
        if kind != "table":
            yield from saved
            return
        every = np.concatenate([e["keys"] for e in saved]) if saved else np.zeros(0, np.int64)
        short = np.where(every >= 0, every & ID_MASK, every)
        if len(np.unique(short)) != len(np.unique(every)):
            raise CheckpointError(f"{path}: table {key}: {len(np.unique(every)) - len(np.unique(short))} pair(s) of its "
                                  f"63-bit ids (checkpoint format 2) share their low 55 bits, which this version's "
                                  f"ids keep; their rows cannot be told apart: train again")
        for e in saved:
            yield dict(e, keys=np.where(e["keys"] >= 0, e["keys"] & ID_MASK, e["keys"]))
    return entries


def reference_model(config: dict):
    """(the single-process model a checkpoint's config describes, its FeatureSpec): built from
    this project's reference models, ready for ``restore``."""
    spec = FeatureSpec.from_json(json.dumps(config["spec"]))
    hidden = tuple(int(h) for h in config["hidden"].split(",") if h)
    return models.build(config["model"], spec, seed=config["seed"], hidden=hidden), spec


def restore(directory: str, model, optimizer=None, rank: int | None = None, world_size: int | None = None) -> str:
    """Read the rows, weights and (given ``optimizer``) slots and step counts this process holds;
    the checkpoint may come from any mode and any number of processes. Returns the folder read.
    (``rank`` and ``world_size`` are not needed: each process keeps what its model holds.)"""
    path = _require(directory)
    config = load_config(directory)
    fmt = config.get("checkpoint_format")
    if fmt not in (2, FORMAT):
        raise CheckpointError(f"{path}: checkpoint format {fmt}, this version reads 2 and {FORMAT}")
    shards = Shards(path, int(config["world_size"]))
    if fmt == 2:
        shards = _with_55_bit_ids(shards, path)
    if optimizer is not None:
        create_slots(model, optimizer)

    def keep_key(layer):
        ex = getattr(layer, "exchange", None)
        if ex is None or ex.world_size == 1:
            return None
        return lambda keys: np.mod(keys, ex.world_size) == ex.rank
    try:
        with contextlib.ExitStack() as loading:       # a fused table: one export per table, not per field
            for table in {id(m): m for m in model.submodules if isinstance(m, FusedTable)}.values():
                loading.enter_context(table.loading())
            missing = load_rows(model, optimizer, shards, keep_key)
    except KeyError as e:          # a slot the optimizer has and the checkpoint lacks
        raise CheckpointError(f"{path}: {e.args[0]}") from None
    if missing:
        raise CheckpointError(f"{path}: holds no {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}: "
                              f"it was written by another model")
    if optimizer is not None and config.get("iterations"):
        counters = [optimizer.iterations] + [p.iterations for p in optimizer_parts(optimizer)]
        for var, value in zip(counters, config["iterations"]):
            var.assign(value)
    return path

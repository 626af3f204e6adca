"""Checkpoints that a crash while saving cannot corrupt.

Each process writes ``<dir>/rank<r>-of-<N>/`` (tables, optimizer slots, dense weights via
tf.train.Checkpoint, plus the field plan as plan.json). The new checkpoint is written to a
temporary folder and swapped in by renames; until the swap completes the previous one
stays readable (restore falls back to ``.old``).

    >>> save("ckpt", model, optimizer, plan, rank=0, world_size=1)
    >>> restore("ckpt", model, optimizer, rank=0, world_size=1)
"""
from __future__ import annotations

import os
import shutil
import tempfile

import tensorflow as tf

from des.plan import FieldPlan


def _folder(directory: str, rank: int, world_size: int) -> str:
    return os.path.join(directory, f"rank{rank}-of-{world_size}")


def save(directory: str, model, optimizer, plan: FieldPlan | None = None, rank: int = 0,
         world_size: int = 1) -> str:
    os.makedirs(directory, exist_ok=True)
    final = _folder(directory, rank, world_size)
    tmp = tempfile.mkdtemp(prefix=os.path.basename(final) + ".tmp-", dir=directory)
    tf.train.Checkpoint(model=model, optimizer=optimizer).write(os.path.join(tmp, "ckpt"))
    if plan is not None:
        with open(os.path.join(tmp, "plan.json"), "w") as fh:
            fh.write(plan.to_json())
    old = final + ".old"
    if os.path.isdir(old):
        shutil.rmtree(old)
    if os.path.isdir(final):
        os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def latest(directory: str, rank: int = 0, world_size: int = 1) -> str | None:
    final = _folder(directory, rank, world_size)
    for path in (final, final + ".old"):
        if os.path.exists(os.path.join(path, "ckpt.index")):
            return path
    return None


def load_plan(directory: str, rank: int = 0, world_size: int = 1) -> FieldPlan | None:
    path = latest(directory, rank, world_size)
    if path is None or not os.path.exists(os.path.join(path, "plan.json")):
        return None
    with open(os.path.join(path, "plan.json")) as fh:
        return FieldPlan.from_json(fh.read())


def restore(directory: str, model, optimizer, rank: int = 0, world_size: int = 1) -> str:
    path = latest(directory, rank, world_size)
    if path is None:
        others = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise FileNotFoundError(f"no checkpoint for rank {rank} of {world_size} in {directory!r} "
                                f"(found: {others}); restore needs the same number of processes")
    tf.train.Checkpoint(model=model, optimizer=optimizer).read(os.path.join(path, "ckpt")).expect_partial()
    return path

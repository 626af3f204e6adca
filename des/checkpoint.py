"""Checkpoints that a crash while saving cannot corrupt.

Each process writes ``<dir>/rank<r>-of-<N>/`` (tables, optimizer slots, dense weights via
tf.train.Checkpoint, plus the field plan as plan.json). The new checkpoint is written to a
temporary folder and swapped in by renames; until the swap completes the previous one
stays readable (restore falls back to ``.old``).

The job's configuration (model, widths, spec, mode, number of processes) goes to
``<dir>/config.json`` so that ``des.predict`` can rebuild the model.

    >>> save("ckpt", model, optimizer, plan, rank=0, world_size=1, config={"model": "deepfm"})
    >>> restore("ckpt", model, optimizer, rank=0, world_size=1)
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile

import tensorflow as tf

from des.plan import FieldPlan


def _folder(directory: str, rank: int, world_size: int) -> str:
    return os.path.join(directory, f"rank{rank}-of-{world_size}")


def save(directory: str, model, optimizer, plan: FieldPlan | None = None, rank: int = 0,
         world_size: int = 1, config: dict | None = None) -> str:
    os.makedirs(directory, exist_ok=True)
    if config is not None and rank == 0:
        tmp_config = os.path.join(directory, ".config.json.tmp")
        with open(tmp_config, "w") as fh:
            json.dump(dict(config, world_size=world_size), fh, indent=1)
        os.replace(tmp_config, os.path.join(directory, "config.json"))
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


def load_config(directory: str) -> dict:
    """The job configuration saved with the checkpoint (see ``save``)."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file; checkpoints written by des.train --checkpoint "
                                f"have one")
    with open(path) as fh:
        return json.load(fh)


MUST_MATCH = {"model": "--model", "mode": "--mode", "dim": "--dim", "hidden": "--hidden",
              "optimizer": "--optimizer", "linear_optimizer": "--linear-optimizer"}


def check_config(directory: str, config: dict) -> None:
    """Raise ValueError naming every setting in which ``config`` (this run) differs from the
    checkpoint's config.json: restoring would silently keep what matches and start the rest fresh."""
    saved = load_config(directory)
    diff = [f"{flag} {saved.get(k)} (this run: {config.get(k)})" for k, flag in MUST_MATCH.items()
            if saved.get(k) != config.get(k)]
    if saved.get("spec") is not None and config.get("spec") is not None and saved["spec"] != config["spec"]:
        diff.append("another feature spec (fields, widths or vocabularies)")
    if diff:
        raise ValueError(f"{directory}: the checkpoint was written with {'; '.join(diff)}: "
                         f"restore with the same settings")


def restore(directory: str, model, optimizer=None, rank: int = 0, world_size: int = 1) -> str:
    """Read tables, dense weights and (given ``optimizer``) its slots; returns the folder read."""
    path = latest(directory, rank, world_size)
    if path is None:
        others = sorted(os.listdir(directory)) if os.path.isdir(directory) else []
        raise FileNotFoundError(f"no checkpoint for rank {rank} of {world_size} in {directory!r} "
                                f"(found: {others}); restore needs the same number of processes")
    _check_table_names(os.path.join(path, "ckpt"), model)
    parts = {"model": model} if optimizer is None else {"model": model, "optimizer": optimizer}
    hypers = _hyperparameters(optimizer)
    tf.train.Checkpoint(**parts).read(os.path.join(path, "ckpt")).expect_partial()
    for opt, values in hypers:           # this run's learning rate etc., not the saved ones
        for name, value in values.items():
            opt._get_hyper(name).assign(value)
    return path


def _hyperparameters(optimizer) -> list[tuple]:
    """(optimizer, {hyperparameter: value}) for a Keras (legacy) optimizer and the parts of a
    models.optim.LinearAndRestOptimizer. Their variables are created now, so that restoring a
    checkpoint writes into them at once (not later, when the first step would create them) and
    the caller can put this run's values back: Keras checkpoints the learning rate, and
    restoring it silently would ignore ``--lr``."""
    if optimizer is None:
        return []
    parts = [optimizer.linear, optimizer.rest] if hasattr(optimizer, "rest") else [optimizer]
    out = []
    for opt in parts:
        opt._create_hypers()
        out.append((opt, {n: opt._get_hyper(n).numpy() for n in opt._hyper
                          if isinstance(opt._get_hyper(n), tf.Variable)}))
    return out


def _check_table_names(prefix: str, model) -> None:
    """TFRA keys a table's rows by the table's name; a model whose tables got other names
    (``table_name`` numbers the second model built in a process) would silently keep its own
    rows. Make that an error instead."""
    from des.verify import table_layers
    if model is None:
        return
    saved = set()
    for key, _ in tf.train.list_variables(prefix):
        found = re.search(r"tables_of_(.+?)/\d+/\.ATTRIBUTES/table-keys$", key)
        if found:
            saved.add(found.group(1))
    missing = [t.params.name for t in table_layers(model) if t.params.name not in saved]
    saved = sorted(n for n in saved if n.endswith("-parameter"))  # not the optimizer slot tables
    if missing:
        raise ValueError(
            f"{prefix}: the checkpoint has no rows for tables {missing[:4]} (it holds "
            f"{saved[:4]}{' ...' if len(saved) > 4 else ''}). TFRA keys tables by name, and this "
            f"model's tables were named differently because another model was built first in this "
            f"process: restore in a fresh process, building this model first.")

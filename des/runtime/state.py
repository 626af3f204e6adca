"""What a model (plain, or DES on any process) has learned, keyed so that the same model code
built anywhere lines up (keys: des.compiler.keys), with its optimizer slots: the rows
checkpoints, saves and exports read and write.

    >>> import models
    >>> from des.data import FeatureSpec, Field
    >>> model = models.lr(FeatureSpec((Field("C1", dim=4), Field("C2", dim=4))))
    >>> snap = snapshot(model)        # {"tables": {key: {id: row}}, "owned": {key: array}, "weights": {key: array}}
    >>> {part: sorted(keys) for part, keys in snap.items()}
    {'tables': ['2:FieldEmbedding', '3:FieldEmbedding'], 'owned': [], 'weights': ['5:Bias/0'], 'whole': []}
"""
from __future__ import annotations

import contextlib

import numpy as np
import tensorflow as tf


from des.compiler.keys import state_keys, _part_of
from des_ops.fused import FusedTable
from des_ops.row_policy import state_of


def snapshot(model: tf.keras.Model) -> dict:
    """{"tables": {key: {id: row}}, "owned": {key: array}, "weights": {key: array}, "whole": {keys of
    "owned" that every process holds whole (the first layer by rows: the tail's kernel)}}."""
    sk = state_keys(model)
    tables = {}
    for key, (layer, source) in sk.tables.items():
        ids, values = source.export(layer)
        tables[key] = dict(zip(np.asarray(ids).tolist(), values))
    owned, whole = {}, set()
    for wid, (var, parts) in sk.owned.items():
        value = var.numpy()
        for key, a, b in parts:
            owned[key] = value[a:b] if b is not None else value
            if wid in sk.whole:
                whole.add(key)
    weights = {key: var.numpy() for var, key in sk.weights.values()}
    for wid, (key, reps) in sk.kernel_parts.items():
        value = sk.owned[wid][0].numpy()
        weights[key] = np.concatenate([value[a:b] for a, b in reps])
    return {"tables": tables, "owned": owned, "weights": weights, "whole": whole}


def _trainable_of(layer, source):
    """The variable the optimizer sees for a table layer (TFRA: its shadow or its fused table's; Keras: the matrix)."""
    return source.trainable(layer)


class SlotError(ValueError):
    """An optimizer whose slots cannot be read or matched to the variables they belong to."""


def optimizer_slots(optimizer, var) -> dict:
    """{slot name: slot variable} of ``var`` in ``optimizer`` (the part that updates it): legacy
    Keras optimizers through ``get_slot``; the new ones (Keras 2.11+: Adam, Adagrad, SGD, Ftrl,
    RMSprop, ..., TFRA's DynamicEmbeddingOptimizer around them) through their public
    ``variables``, which name each slot ``[<optimizer>/]<slot>/<variable>`` (a TFRA table's slot:
    its table named ``<table>/<variable>/<slot>``). Empty before the optimizer's first step or
    ``create_slots``.

        >>> v = tf.Variable(tf.ones([2]), name="w")
        >>> opt = tf.keras.optimizers.Adam(); opt.build([v])
        >>> sorted(optimizer_slots(opt, v))
        ['m', 'v']
    """
    part = _part_of(optimizer, var)
    if part is None:
        return {}
    if hasattr(part, "get_slot_names"):                       # legacy Keras (optimizer_v2)
        return {name: part.get_slot(var, name) for name in part.get_slot_names()}
    if not hasattr(part, "variables"):
        raise SlotError(f"optimizer {type(part).__name__}: its slots cannot be read (it has neither "
                        f"get_slot_names nor variables)")
    variables = part.variables() if callable(part.variables) else part.variables
    shared = var._shared_name
    params = getattr(getattr(var, "params", None), "name", None)
    out = {}
    for slot in variables:
        slot_params = getattr(getattr(slot, "params", None), "name", None)
        name = None
        if params is not None and slot_params is not None:      # a TFRA table's slot table
            prefix = f"{params}/{shared}/"
            name = slot_params[len(prefix):] if slot_params.startswith(prefix) else None
        elif params is None and slot_params is None:
            full = slot.name[:-2] if slot.name.endswith(":0") else slot.name
            if full.endswith(f"/{shared}"):
                name = full[:-len(shared) - 1]
                if name.startswith(f"{part.name}/"):
                    name = name[len(part.name) + 1:]
        if not name or "/" in name:
            continue
        if name in out:
            raise SlotError(f"optimizer {part.name!r}: two slots {name!r} match the variable {var.name!r} (two model "
                            f"variables of one name?): give the layers distinct names")
        out[name] = slot
    return out


def _rows(value: np.ndarray, ranges) -> np.ndarray:
    return np.concatenate([value[a:b] for a, b in ranges]) if ranges is not None else value


def _put_rows(full: np.ndarray, ranges, value: np.ndarray) -> np.ndarray:
    if ranges is None:
        return value.reshape(full.shape)
    at = 0
    for a, b in ranges:
        b = len(full) if b is None else b
        full[a:b] = value[at:at + b - a]
        at += b - a
    return full


def pieces(model: tf.keras.Model) -> list[tuple]:
    """Everything a model holds, as (kind, key, var, row ranges): kind "table" (var is the
    layer; rows are keyed), "owned" (one field's block: kernel rows or a field chain's weights)
    or "weight" (replicated). The same key names the same thing in any mode and on any N."""
    sk = state_keys(model)
    out = [("table", key, layer, None) for key, (layer, _) in sk.tables.items()]
    for var, parts in sk.owned.values():
        out += [("owned", key, var, [(a, b)]) for key, a, b in parts]
    out += [("weight", key, var, None) for var, key in sk.weights.values()]
    for wid, (key, reps) in sk.kernel_parts.items():
        out.append(("weight", key, sk.owned[wid][0], reps))
    return out


def export_rows(model: tf.keras.Model, optimizer, kinds=("table", "owned", "weight")) -> dict:
    """{(kind, key): {"keys"?: [n], "value": array, "slot:<name>": array}} for ``kinds``.

    Tables give all the rows this process holds (keys + values + each slot's rows); a fused table
    is exported once for all its members (FusedTable.exporting)."""
    with contextlib.ExitStack() as exporting:
        for table in {id(m): m for m in model.submodules if isinstance(m, FusedTable)}.values():
            exporting.enter_context(table.exporting())
        return _export_rows(model, optimizer, kinds)


def _export_rows(model: tf.keras.Model, optimizer, kinds) -> dict:
    sk = state_keys(model)
    out = {}
    for kind, key, var, ranges in pieces(model):
        if kind not in kinds or (kind == "owned" and id(var) in sk.whole and "weight" not in kinds):
            continue                # a kernel every process holds whole: written once, with the weights
        if kind == "table":
            source = sk.tables[key][1]
            keys, values = source.export(var)
            entry = {"keys": np.asarray(keys, np.int64), "value": np.asarray(values, np.float32)}
            trainable = _trainable_of(var, source)
            for name, slot in optimizer_slots(optimizer, trainable).items():
                if source.dynamic:
                    entry[f"slot:{name}"], entry[f"has:{name}"] = source.slot_rows(var, slot.params, entry["keys"])
                else:
                    entry[f"slot:{name}"] = slot.numpy()
            policy = state_of(var)
            if policy is not None:                  # a RowPolicy's counts and last steps read (des_ops.row_policy)
                entry["seen:keys"], entry["seen:value"] = policy[0].member_seen(policy[1])
        else:
            entry = {"value": _rows(var.numpy(), ranges)}
            for name, slot in optimizer_slots(optimizer, var).items():
                entry[f"slot:{name}"] = _rows(slot.numpy(), ranges)
        out[(kind, key)] = entry
    return out


def load_rows(model: tf.keras.Model, optimizer, entries, keep_key=None) -> list[str]:
    """Write rows saved by ``export_rows`` (possibly by other processes, in another mode) into
    ``model`` and ``optimizer``'s slots. ``entries(kind, key)`` yields every saved entry of
    that piece (one per process that wrote it; none: the piece is missing). ``keep_key(layer)``
    gives a function keys -> bool mask of the rows this process holds (PS: key mod N == rank),
    or None for all. Returns the keys of missing pieces."""
    sk = state_keys(model)
    missing = []
    for kind, key, var, ranges in pieces(model):
        saved = list(entries(kind, key))
        if not saved:
            missing.append(f"{kind} {key}")
            continue
        if kind == "table":
            source = sk.tables[key][1]
            keep = keep_key(var) if keep_key else None
            if keep is None and source.holds_part(var):   # an owner's key ranges or stripe of a table: its keys only
                keep = lambda k, var=var, source=source: source.held(var, k)  # noqa: E731
            every_key = np.concatenate([e["keys"] for e in saved])
            mask = keep(every_key) if keep is not None else slice(None)
            if not source.dynamic:          # a static table's slots are matrices in key order: rows by key
                chosen = np.flatnonzero(mask) if keep is not None else np.arange(len(every_key))
                mask = chosen[np.argsort(every_key[chosen], kind="stable")]
            cat = lambda name: np.concatenate([e[name] for e in saved])[mask]  # noqa: E731
            keys, values = cat("keys"), cat("value")
            dim = source.dim(var)
            if values.ndim != 2 or values.shape[1] != dim:
                raise KeyError(f"table {key} ({var.name}): rows of width {values.shape[1:]} in the checkpoint, {dim} in "
                               f"this model")
            source.load(var, keys, values)
            trainable = _trainable_of(var, source)
            for name, slot in optimizer_slots(optimizer, trainable).items():
                if f"slot:{name}" not in saved[0]:
                    raise KeyError(f"table {key}: the checkpoint has no optimizer slot {name!r}")
                if source.dynamic:
                    has = cat(f"has:{name}")
                    source.load_slot(var, slot.params, keys[has], cat(f"slot:{name}")[has])
                else:
                    slot.assign(cat(f"slot:{name}"))
            _load_seen(var, saved, keep, keys, optimizer)
            continue
        entry = saved[0]
        want = _rows(np.zeros(var.shape, np.float32), ranges).shape if ranges is not None else tuple(var.shape)
        if tuple(entry["value"].shape) != tuple(want):
            raise KeyError(f"{kind} {key} ({var.name}): shape {tuple(entry['value'].shape)} in the checkpoint, "
                           f"{tuple(want)} in this model")
        var.assign(_put_rows(var.numpy(), ranges, entry["value"]))
        for name, slot in optimizer_slots(optimizer, var).items():
            if f"slot:{name}" not in entry:
                raise KeyError(f"{kind} {key}: the checkpoint has no optimizer slot {name!r}")
            slot.assign(_put_rows(slot.numpy(), ranges, entry[f"slot:{name}"]))
    return missing


def _load_seen(layer, saved: list[dict], keep, keys: np.ndarray, optimizer) -> None:
    """A RowPolicy's counts of ``layer``'s keys (des_ops.row_policy): as saved, those this process
    holds (``keep``); from a checkpoint saved without a policy, the rows loaded (``keys``) count as
    admitted and read at the optimizer's current step."""
    policy = state_of(layer)
    if policy is None:
        return
    state, member = policy
    if all("seen:keys" in e for e in saved):
        seen = np.concatenate([e["seen:keys"] for e in saved])
        vals = np.concatenate([e["seen:value"] for e in saved]).reshape(-1, 2)
        mask = keep(seen) if keep is not None else slice(None)
        state.load_member_seen(member, seen[mask], vals[mask])
        return
    step = int(optimizer.iterations.numpy()) if optimizer is not None else 0
    vals = np.tile(np.array([[state.policy.threshold, step]], np.int64), (len(keys), 1))
    state.load_member_seen(member, keys, vals)

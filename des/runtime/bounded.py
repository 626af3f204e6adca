"""Tables bounded while a model trains: a des.RowPolicy on every TFRA table of a model, and its
eviction run between training steps (the tables' state and its exactness: des_ops.row_policy).

    >>> import des, models
    >>> from des.data import FeatureSpec, Field
    >>> spec = FeatureSpec((Field("user", dim=4), Field("item", dim=4)))
    >>> model = models.deepfm(spec, hidden=(8,))
    >>> states = bound_rows(model, des.RowPolicy(admit_min_count=2, evict_idle_steps=1, every=1))
    >>> model.compile(models.make_optimizer("adam"), "binary_crossentropy")
    >>> batch = {"user": tf.constant([1, 1, 2]), "item": tf.constant([5, 6, 6])}
    >>> _ = model.train_on_batch(batch, tf.constant([0., 1., 1.]))
    >>> table_rows(model)["held"]          # user 1, item 6 (twice each), in the embedding and linear tables
    4
    >>> _ = model.train_on_batch({"user": tf.constant([3]), "item": tf.constant([7])}, tf.constant([0.]))
    >>> table_rows(model)["held"], table_rows(model)["evicted"]     # idle a step: evicted after step 2
    (0, 4)

des.transform(model, des.Options(row_policy=...)) and des.train (--admit-min-count ...) call
``bound_rows``; so does a user on an untouched model, to compare with DES under the same policy.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from des.compiler.options import RowPolicy
from des.graph.sources import source_of
from des.runtime.state import optimizer_slots
from des_ops.row_policy import RowState, attach, policy_tables
from models.spec import ID_BITS


def bound_rows(model: tf.keras.Model, policy: RowPolicy) -> list[RowState]:
    """Apply ``policy`` to every table of ``model`` (des_ops.row_policy.policy_tables) and run
    eviction between its training steps (``install``); returns the states. A policy that bounds
    nothing (``RowPolicy()``) leaves the model as it is. A TFRA table it cannot bound (one kept in
    its own layer: des.Options(tables="per-field"), or an untouched model's TFRA Embedding) stops
    it with a ValueError naming the table; a Keras Embedding's fixed matrix needs no bound."""
    if not policy.active:
        return []
    states = [attach(t, policy) for t in policy_tables(model)]
    left = [layer.name for layer, src in _not_bounded(model, states) if src.dynamic]
    if left:
        for s in states:
            del s.table.des_row_state
        raise ValueError(f"des.RowPolicy: cannot bound the TFRA table(s) {', '.join(left)} (each read by its own "
                         f"layer's lookup): pass the model through des.transform with tables='fused' or 'joined' "
                         f"(on one process for a reference: des.transform(model, options) without mpirun)")
    install(model, states)
    return states


def _not_bounded(model: tf.keras.Model, states: list[RowState]) -> list:
    """(layer, table source) of the tables of ``model`` no state bounds."""
    bounded = {id(s.table) for s in states}
    out = []
    for layer in model._flatten_layers(include_self=False, recursive=True):
        fused = getattr(layer, "des_fused", None)
        src = source_of(layer)
        if src is not None and id(layer) not in bounded and not (fused and id(fused[0]) in bounded):
            out.append((layer, src))
    return out


def describe(model: tf.keras.Model, policy: RowPolicy, states: list[RowState]) -> list[str]:
    """Report lines: which tables of this process the policy bounds, and which need no bound."""
    lines = [f"row policy ({policy}):"]
    for s in states:
        held = ", ".join(s.table.slot_names) if s.fused else s.table.name
        lines.append(f"  {s.table.name}: {held}")
    for layer, src in _not_bounded(model, states):
        lines.append(f"  not bounded: {layer.name} ({src.name}): its rows are a fixed matrix")
    return lines


def install(model: tf.keras.Model, states: list[RowState]) -> None:
    """Copy the optimizer's step into every state before each training step, and evict after the
    steps whose number done is a multiple of the policy's ``every``."""
    model.des_row_states = states
    make = model.make_train_function

    def make_train_function(force: bool = False):
        fn = make(force)
        if getattr(fn, "des_row_policy", False):
            return fn

        def step(iterator):
            iterations = model.optimizer.iterations
            before = int(iterations.numpy())
            for s in states:
                s.step.assign(before)
            logs = fn(iterator)
            done = int(iterations.numpy())
            policy = states[0].policy if states else None
            evicts = policy is not None and (policy.evict_idle_steps or policy.max_rows)
            if evicts and done // policy.every != before // policy.every:
                for s in states:
                    s.step.assign(done)
                    s.evict([slot.params for slot in optimizer_slots(model.optimizer, s.table.shadow).values()])
            return logs

        step.des_row_policy = True
        model.train_function = step
        return step

    model.make_train_function = make_train_function


def table_rows(model: tf.keras.Model) -> dict:
    """This process's table rows: ``held`` (rows in its TFRA tables now), and with a policy the keys
    ``admitted`` and rows ``evicted`` in this run and the keys ``counting`` (seen, no row yet);
    summed over tables, a fused table's members counted one by one (a joined row is two tables'
    rows, as in the unfused model), and per table under ``tables``."""
    per_table = {}
    for table in policy_tables(model):
        fused = hasattr(table, "slot_names")
        names = table.slot_names if fused else [table.name]
        members = np.bincount(np.asarray(table._slot), minlength=len(names)) if fused else np.ones(1, np.int64)
        slot_of = (lambda k: k >> ID_BITS) if fused else (lambda k: np.zeros(len(k), np.int64))  # noqa: E731
        held = np.bincount(slot_of(table.params.export()[0].numpy()), minlength=len(names))
        state = table.des_row_state
        if state is not None:
            keys, vals = (x.numpy() for x in state.seen.export())
            counting = np.bincount(slot_of(keys[vals[:, 0] < state.policy.threshold]), minlength=len(names))
        for slot, name in enumerate(names):
            entry = {"held": int(held[slot] * members[slot])}
            if state is not None:
                entry.update(admitted=int(state.admitted.numpy()[slot] * members[slot]),
                             evicted=int(state.evicted[slot] * members[slot]), counting=int(counting[slot]))
            per_table[name] = entry
    total = {k: sum(t.get(k, 0) for t in per_table.values()) for k in ("held", "admitted", "evicted", "counting")}
    return dict(total, tables=per_table)

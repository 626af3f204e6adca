"""Rank-independent state: what a model (plain, or DES on any process) has learned, keyed so
that the same model code built anywhere lines up, plus the rank-0 broadcast of weights.

    >>> snap = snapshot(model)        # {"tables": {key: {id: row}}, "owned": {key: array}, "weights": {key: array}}

Keys come from the original graph (des.ir.Graph.layer_key: position of a layer's first call
and its class), so two builds of the same model code give the same keys. ``tables`` and
``owned`` (kernel rows of a substituted Dense per field, weights of a field's own chain) live
on exactly one process under DES; ``weights`` (the replicated tail, replicated kernel rows)
on every process.
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from des.ir import Graph


def _layer_keys(graph: Graph) -> dict[int, str]:
    keys = {}
    for n in graph.nodes:
        keys.setdefault(id(n.layer), f"{n.index}:{type(n.layer).__name__}")
    return keys


def _weight_keys(graph: Graph, skip: set[int]) -> dict[int, str]:
    """id(variable) -> "layer key/i" for every weight of every layer of the graph, but ``skip``."""
    out, keys = {}, _layer_keys(graph)
    for n in graph.nodes:
        if n.kind in ("input", "table") or id(n.layer) in skip:
            continue
        for i, w in enumerate(n.layer.weights):
            out.setdefault(id(w), f"{keys[id(n.layer)]}/{i}")
    return out


class StateKeys:
    """Where each variable of one model sits in the rank-independent state."""

    def __init__(self):
        self.tables: dict[str, tuple] = {}        # key -> (layer, source)
        self.owned: dict[int, tuple] = {}          # id(var) -> (var, [(key, start, stop)]) rows split by key
        self.weights: dict[int, tuple] = {}        # id(var) -> (var, key) replicated
        self.kernel_parts: dict[int, tuple] = {}   # id(var) -> [(key, start, stop)]: split rows (plain model)

    @staticmethod
    def of_model(model: tf.keras.Model) -> "StateKeys":
        """For a model that was not transformed."""
        from des.compiler import find_substitutions
        graph = Graph(model)
        keys = _layer_keys(graph)
        sk = StateKeys()
        for n in graph.nodes:
            if n.kind == "table":
                sk.tables[keys[id(n.layer)]] = (n.layer, n.attrs["source"])
        matches, _ = find_substitutions(graph)
        split = {}
        for m in matches:
            if m.rule == "embed_concat_dense":
                kernel, start, parts, reps = m.data["kernel"], 0, [], []
                dense_key = keys[id(m.root.layer)]
                for p in m.data["parts"]:
                    if p.vector is not None:
                        parts.append((f"{dense_key}/rows:{keys[id(p.vector.table.layer)]}", start, start + p.width))
                    else:
                        reps.append((start, start + p.width))
                    start += p.width
                split[id(kernel)] = (kernel, parts, reps, f"{dense_key}/others")
        for wid, key in _weight_keys(graph, set()).items():
            var = _find_var(graph, wid)
            if wid in split:
                kernel, parts, reps, other_key = split[wid]
                sk.owned[wid] = (kernel, parts)
                if reps:
                    sk.kernel_parts[wid] = (other_key, reps)
            else:
                sk.weights[wid] = (var, key)
        return sk

    @staticmethod
    def of_transform(graph: Graph, matches, des_layer) -> "StateKeys":
        """For the DES model des.transform builds from ``graph`` (called by transform)."""
        keys = _layer_keys(graph)
        sk = StateKeys()
        chain_layers = {id(l) for l in des_layer.owned}
        for n in graph.nodes:
            if n.kind == "table" and id(n.layer) in chain_layers:
                sk.tables[keys[id(n.layer)]] = (n.layer, n.attrs["source"])
        for l in des_layer.owned:                       # other weights of owned chains
            if not any(n.layer is l and n.kind == "table" for n in graph.nodes):
                for i, w in enumerate(l.weights):
                    sk.owned[id(w)] = (w, [(f"{keys[id(l)]}/{i}", 0, None)])
        for m, op in zip(matches, des_layer.ops):
            if m.rule == "embed_concat_dense" and op.kernel_block is not None:
                dense_key, start, parts = keys[id(m.root.layer)], 0, []
                mine = set(op.fields)
                for p in m.data["parts"]:
                    if p.vector is not None and p.vector.field in mine:
                        parts.append((f"{dense_key}/rows:{keys[id(p.vector.table.layer)]}", start, start + p.width))
                        start += p.width
                sk.owned[id(op.kernel_block)] = (op.kernel_block, parts)
        sk._origin = _weight_keys(graph, chain_layers)
        sk._dense_keys = {id(m.root.layer): keys[id(m.root.layer)] for m in matches}
        return sk

    def bind_tail(self, model: tf.keras.Model) -> None:
        """Key the replicated weights of the DES model (after it is built)."""
        des_layer = model.des_layer
        for layer in model.layers:
            if layer is des_layer:
                continue
            for w in layer.weights:
                key = self._origin.get(id(w)) or getattr(w, "des_key", None)
                if key is None:
                    raise KeyError(f"no state key for weight {w.name} of {layer.name}")
                self.weights[id(w)] = (w, key)


def _find_var(graph: Graph, wid: int):
    for n in graph.nodes:
        for w in n.layer.weights:
            if id(w) == wid:
                return w
    raise KeyError(wid)


def state_keys(model: tf.keras.Model) -> StateKeys:
    sk = getattr(model, "des_state", None)
    if sk is None:
        return StateKeys.of_model(model)
    if not sk.weights:
        sk.bind_tail(model)
    return sk


def snapshot(model: tf.keras.Model) -> dict:
    """{"tables": {key: {id: row}}, "owned": {key: array}, "weights": {key: array}}."""
    sk = state_keys(model)
    tables = {}
    for key, (layer, source) in sk.tables.items():
        ids, values = source.export(layer)
        tables[key] = dict(zip(np.asarray(ids).tolist(), values))
    owned = {}
    for var, parts in sk.owned.values():
        value = var.numpy()
        for key, a, b in parts:
            owned[key] = value[a:b] if b is not None else value
    weights = {key: var.numpy() for var, key in sk.weights.values()}
    for wid, (key, reps) in sk.kernel_parts.items():
        value = sk.owned[wid][0].numpy()
        weights[key] = np.concatenate([value[a:b] for a, b in reps])
    return {"tables": tables, "owned": owned, "weights": weights}


def sync_from_root(graph: Graph, comm, root: int = 0) -> None:
    """Every process takes rank ``root``'s weights and table rows (before partitioning), so a
    model built with random initialisers starts the same everywhere."""
    done = set()
    for n in graph.nodes:
        layer = n.layer
        if n.kind == "input" or id(layer) in done:
            continue
        done.add(id(layer))
        if n.kind == "table" and n.attrs["source"].dynamic:
            src = n.attrs["source"]
            keys, values = src.export(layer)
            count = int(comm.broadcast(np.array([len(keys)], np.int64), root)[0])
            keys = comm.broadcast(np.asarray(keys, np.int64) if comm.rank == root else np.zeros(count, np.int64), root)
            values = comm.broadcast(np.asarray(values, np.float32) if comm.rank == root else
                                    np.zeros((count, n.attrs["dim"]), np.float32), root)
            if comm.rank != root:
                src.load(layer, keys, values)
            continue
        for w in layer.weights:
            value = comm.broadcast(w.numpy(), root)
            if comm.rank != root:
                w.assign(value)

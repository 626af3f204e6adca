"""Rank-independent state keys of a model (plain, or DES on any process), the rank-0 broadcast
of weights at transform time, key-deterministic new rows and optimizer slots created ahead.

Keys come from the original graph (des.graph.ir.Graph.layer_key: position of a layer's first
call and its class), so two builds of the same model code give the same keys. ``tables`` and
``owned`` (kernel rows of a substituted Dense per field, weights of a field's own chain) live
on exactly one process under DES; ``weights`` (the replicated tail, replicated kernel rows)
on every process. Reading and writing the state itself is des.runtime.state.
"""
from __future__ import annotations

import weakref

import numpy as np
import tensorflow as tf

from des.compiler.handle import distributed
from des.graph.ir import Graph, trace_used
from des.graph.sources import source_of
from des_ops.fused import FusedTable
from des_ops.keras_internals import create_optimizer_weights, creates_weights_ahead, input_spec_of
from models.optim import apply_without_autograph, is_linear
from rewrite_rules import find_substitutions


def _layer_keys(graph: Graph) -> dict[int, str]:
    keys = {}
    for n in graph.nodes:
        keys.setdefault(id(n.layer), f"{n.index}:{getattr(n.layer, 'des_state_class', type(n.layer).__name__)}")
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


def rows_key(graph: Graph, dense_key: str, keys: dict[int, str], vector) -> str:
    """The key of a Dense kernel's rows that multiply one field vector: named after its table,
    and, for a table read more than once (shared by several fields), after the call too."""
    key = f"{dense_key}/rows:{keys[id(vector.table.layer)]}"
    return key if graph.layer_calls(vector.table.layer) == 1 else f"{key}@{vector.table.index}"


class StateKeys:
    """Where each variable of one model sits in the rank-independent state."""

    def __init__(self):
        self.tables: dict[str, tuple] = {}        # key -> (layer, source)
        self.owned: dict[int, tuple] = {}          # id(var) -> (var, [(key, start, stop)]) rows split by key
        self.weights: dict[int, tuple] = {}        # id(var) -> (var, key) replicated
        self.kernel_parts: dict[int, tuple] = {}   # id(var) -> [(key, start, stop)]: split rows (plain model)
        self.whole: set[int] = set()               # ids of ``owned`` vars every process holds whole (rank 0 writes)

    @staticmethod
    def of_model(model: tf.keras.Model) -> "StateKeys":
        """For a model that was not transformed (a subclassed one: the functional model of its
        call, traced as des.transform traces it, so the keys line up)."""
        if not getattr(model, "_is_graph_network", False):
            spec = input_spec_of(model)
            if spec is None:
                raise ValueError(f"{model.name!r} ({type(model).__name__}): its inputs are unknown; call it on a "
                                 f"batch once before saving or restoring its state")
            model = trace_used(model, spec)
        graph = Graph(model)
        keys = _layer_keys(graph)
        sk = StateKeys()
        for n in graph.nodes:
            if n.kind == "table":
                sk.tables[keys[id(n.layer)]] = (n.layer, n.attrs["source"])
        split = _split_kernels(graph, keys)
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
    def of_transform(graph: Graph, matches, des_layer, fused_layers=()) -> "StateKeys":
        """For the DES model des.transform builds from ``graph`` (called by transform);
        ``fused_layers``: owned tables whose rows now live in a fused table of ``des_layer``."""
        keys = _layer_keys(graph)
        sk = StateKeys()
        chain_layers = {id(l) for l in list(des_layer.owned) + list(fused_layers)}
        ranges = getattr(des_layer, "key_ranges", {})   # a table split by key range: this owner's ranges
        for n in graph.nodes:
            if n.kind == "table" and id(n.layer) in ranges:
                sk.tables[keys[id(n.layer)]] = (ranges[id(n.layer)], source_of(ranges[id(n.layer)]))
            elif n.kind == "table" and id(n.layer) in chain_layers:
                sk.tables[keys[id(n.layer)]] = (n.layer, n.attrs["source"])
        split_tables = {id(l) for l in ranges.values()}
        for l in des_layer.owned:                       # other weights of owned chains
            if id(l) in split_tables:
                continue
            if not isinstance(l, FusedTable) and not any(n.layer is l and n.kind == "table" for n in graph.nodes):
                for i, w in enumerate(l.weights):
                    sk.owned[id(w)] = (w, [(f"{keys[id(l)]}/{i}", 0, None)])
        for m, op in zip(matches, des_layer.ops):
            if "parts" not in m.data:
                continue
            dense_key, mine = keys[id(m.root.layer)], set(op.fields)
            striped = {v.tensor for v in m.vectors if v.key_stripe is not None}
            for var, held in ((getattr(op, "kernel_block", None), lambda v: v.field in mine and v.tensor not in striped),
                              (getattr(op, "shared_block", None), lambda v: v.tensor in striped)):
                if var is None:
                    continue
                start, parts = 0, []
                for p in m.data["parts"]:
                    if p.vector is not None and held(p.vector):
                        parts.append((rows_key(graph, dense_key, keys, p.vector), start, start + p.width))
                        start += p.width
                sk.owned[id(var)] = (var, parts)
                if var is getattr(op, "shared_block", None):     # every process holds it whole: rank 0 writes
                    sk.whole.add(id(var))
        sk._origin = _weight_keys(graph, chain_layers)
        # kernels split by field (their rows live in the DES layer and the tail): not the model's any more
        sk._replaced = {id(m.data["kernel"]) for m in matches if "parts" in m.data}
        sk._dense_keys = {id(m.root.layer): keys[id(m.root.layer)] for m in matches}
        # a kernel the untouched model splits by field rows but this one keeps whole in its tail (the
        # first layer by rows): keyed by the same field rows, so that its checkpoints and saves mean
        # what the untouched model's do (written by rank 0 only: every process holds the same kernel)
        sk._whole_split = {wid: v for wid, v in _split_kernels(graph, keys).items() if wid not in sk._replaced}
        return sk

    def bind_tail(self, model: tf.keras.Model) -> None:
        """Key the replicated weights of the DES model (after it is built)."""
        skip = {id(w) for w in distributed(model).layer.weights} | getattr(self, "_replaced", set())
        for w in model.weights:          # a subclassed model still holds the split kernel: skipped
            if id(w) in skip:
                continue
            if id(w) in getattr(self, "_whole_split", {}):
                _, parts, reps, other_key = self._whole_split[id(w)]
                self.owned[id(w)] = (w, parts)
                self.whole.add(id(w))
                if reps:
                    self.kernel_parts[id(w)] = (other_key, reps)
                continue
            key = self._origin.get(id(w)) or getattr(w, "des_key", None)
            if key is None:
                raise KeyError(f"no state key for weight {w.name}")
            self.weights[id(w)] = (w, key)


def _split_kernels(graph: Graph, keys: dict[int, str]) -> dict[int, tuple]:
    """id(kernel) -> (kernel, parts, reps, others key) of each Dense kernel the untouched model
    splits by field rows (embed_concat_dense): ``parts`` [(rows key, start, stop)] per field vector,
    ``reps`` [(start, stop)] of its other rows, keyed together under ``others key``."""
    matches, _ = find_substitutions(graph)
    split = {}
    for m in matches:
        if "parts" in m.data:
            kernel, start, parts, reps = m.data["kernel"], 0, [], []
            dense_key = keys[id(m.root.layer)]
            for p in m.data["parts"]:
                if p.vector is not None:
                    parts.append((rows_key(graph, dense_key, keys, p.vector), start, start + p.width))
                else:
                    reps.append((start, start + p.width))
                start += p.width
            split[id(kernel)] = (kernel, parts, reps, f"{dense_key}/others")
    return split


def _find_var(graph: Graph, wid: int):
    for n in graph.nodes:
        for w in n.layer.weights:
            if id(w) == wid:
                return w
    raise KeyError(wid)


_KEYS: "weakref.WeakKeyDictionary[tf.keras.Model, StateKeys]" = weakref.WeakKeyDictionary()


def keep_state_keys(model: tf.keras.Model, keys: StateKeys) -> None:
    """Key ``model``'s state as ``keys`` say (a rewritten model keyed as the model it came from:
    des_ops.fused). A DES model's keys are its handle's (des.compiler.handle)."""
    _KEYS[model] = keys


def model_keys(model: tf.keras.Model) -> StateKeys:
    """``StateKeys.of_model(model)``, made once per model and kept (des.runtime.saving keys the untouched
    model at every save; its graph and substitutions do not change)."""
    sk = _KEYS.get(model)
    if sk is None:
        sk = _KEYS[model] = StateKeys.of_model(model)
    return sk


def state_keys(model: tf.keras.Model) -> StateKeys:
    handle = distributed(model)
    sk = handle.state if handle is not None else _KEYS.get(model)
    if sk is None:
        return StateKeys.of_model(model)
    if not sk.weights and handle is not None:      # a DES model's tail, bound at first use (none: an FM and LR only)
        sk.bind_tail(model)
    return sk


def sync_from_root(graph: Graph, comm, root: int = 0, skip: set[int] = frozenset()) -> None:
    """Every process takes rank ``root``'s weights and table rows (before partitioning), so a
    model built with random initialisers starts the same everywhere. A few broadcasts in all,
    whatever the model's size (one per collective was ~245 for a 39-field DeepFM, ~0.6 s of
    its start): the tables' row counts, all their keys, all their values, and the other weights
    flattened into one array per dtype. Layers whose ids are in ``skip`` are left out (the caller
    sends them otherwise)."""
    tables, weights, done = [], [], set()
    for n in graph.nodes:
        layer = n.layer
        if n.kind == "input" or id(layer) in done or id(layer) in skip:
            continue
        done.add(id(layer))
        if n.kind == "table" and n.attrs["source"].dynamic:
            tables.append((n.attrs["source"], layer, n.attrs["dim"]))
        else:
            weights.extend(layer.weights)
    is_root = comm.rank == root
    if tables:
        rows = [src.export(layer) for src, layer, _ in tables] if is_root else []
        counts = comm.broadcast(np.array([len(k) for k, _ in rows] if is_root else [0] * len(tables), np.int64), root)
        dims = np.array([dim for _, _, dim in tables], np.int64)
        keys = comm.broadcast(np.concatenate([np.asarray(k, np.int64).reshape(-1) for k, _ in rows]) if is_root
                              else np.zeros(int(counts.sum()), np.int64), root)
        values = comm.broadcast(np.concatenate([np.asarray(v, np.float32).reshape(-1) for _, v in rows]) if is_root
                                else np.zeros(int((counts * dims).sum()), np.float32), root)
        if not is_root:
            k_at = np.cumsum(np.concatenate([[0], counts]))
            v_at = np.cumsum(np.concatenate([[0], counts * dims]))
            for t, (src, layer, dim) in enumerate(tables):
                src.load(layer, keys[k_at[t]:k_at[t + 1]], values[v_at[t]:v_at[t + 1]].reshape(-1, dim))
    by_dtype: dict[str, list] = {}
    for w in weights:
        by_dtype.setdefault(w.dtype.name, []).append(w)
    for dtype in sorted(by_dtype):        # the same order on every rank
        ws = by_dtype[dtype]
        sizes = [int(np.prod(w.shape)) for w in ws]
        flat = comm.broadcast(np.concatenate([np.asarray(w.numpy()).reshape(-1) for w in ws]) if is_root
                              else np.zeros(sum(sizes), ws[0].dtype.as_numpy_dtype), root)
        if not is_root:
            at = np.cumsum([0] + sizes)
            for w, a, b in zip(ws, at[:-1], at[1:]):
                w.assign(flat[a:b].reshape(w.shape))


def optimizer_parts(optimizer) -> list:
    """The Keras optimizers that own slots: ``[optimizer]``, or the linear and rest parts of a
    models.optim.LinearAndRestOptimizer."""
    if optimizer is None:
        return []
    return [optimizer.linear, optimizer.rest] if hasattr(optimizer, "rest") else [optimizer]


def _part_of(optimizer, var):
    """The part of ``optimizer`` that updates ``var`` (as LinearAndRestOptimizer splits them)."""
    if optimizer is None:
        return None
    if hasattr(optimizer, "rest"):
        return optimizer.linear if is_linear(var) else optimizer.rest
    return optimizer


def create_slots(model: tf.keras.Model, optimizer) -> None:
    """Create the optimizer's slots (and step counters) for ``model``'s trainable weights now;
    Keras would create them at the first step, after a restore had nowhere to write them."""
    optimizer.iterations  # noqa: B018 - creates the step counter
    for part in optimizer_parts(optimizer):
        mine = [v for v in model.trainable_variables if _part_of(optimizer, v) is part]
        if creates_weights_ahead(part):
            create_optimizer_weights(part, mine)
        else:                               # Keras 2.11+ optimizers: their public build
            part.build(mine)


def trace_once(model: tf.keras.Model) -> tf.keras.Model:
    """Make Keras trace ``model``'s training step once, not twice: the optimizer's slots are
    created just before the step is first traced (a tf.function that creates variables on its
    first call is traced a second time without them; for a DES model that doubles the first
    step). Optimizers without legacy Keras slot creation are left to Keras. Returns ``model``.

    >>> import models
    >>> from models.spec import FeatureSpec, Field
    >>> spec = FeatureSpec((Field("user", "categorical", 2, 10), Field("ad", "categorical", 2, 10)))
    >>> m = trace_once(models.build("fm", spec))
    >>> m.compile(models.make_optimizer("adagrad"), "binary_crossentropy")
    >>> _ = m.train_on_batch({"user": tf.constant([1, 2]), "ad": tf.constant([3, 4])}, tf.constant([0., 1.]))
    >>> m.train_function.experimental_get_tracing_count()
    1
    """
    make = model.make_train_function

    def make_train_function(force: bool = False):
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None:
            apply_without_autograph(optimizer)
        if (model.train_function is None or force) and optimizer is not None and all(
                creates_weights_ahead(part) for part in optimizer_parts(optimizer)):
            create_slots(model, optimizer)
        return make(force)

    model.make_train_function = make_train_function
    return model


def make_keyed(model: tf.keras.Model, seed: int = 0) -> None:
    """Give every TFRA ``de.keras.layers.Embedding`` / ``SquashedEmbedding`` of ``model``
    key-deterministic new rows, as ``des.transform(model, seed=seed)`` does: the single-process
    model to compare a DES run with must start from the same rows.

        >>> import des
        >>> from tensorflow_recommenders_addons import dynamic_embedding as de
        >>> def build(init_seed):
        ...     ids = tf.keras.Input([], dtype=tf.int64, name="C1")
        ...     init = tf.keras.initializers.RandomUniform(-0.05, 0.05, seed=init_seed)
        ...     return tf.keras.Model(ids, de.keras.layers.Embedding(4, initializer=init)(ids))
        >>> reference_model, other = build(1), build(2)
        >>> des.make_keyed(reference_model, seed=0); des.make_keyed(other, seed=0)
        >>> a = reference_model(tf.constant([7, 8], tf.int64)).numpy()
        >>> b = other(tf.constant([8, 7], tf.int64)).numpy()
        >>> bool((a[0] == b[1]).all())     # key 7's row: whatever the initializer's seed and the order
        True

    In training a missing key is inserted, before the lookup, with a row that depends only on
    (the table's place in the graph, key, seed), uniform in [-scale, scale) where ``scale`` is
    the spread of the layer's initializer (its maxval, or 2 x stddev; zeros stay zeros). In
    inference a missing key reads that row without being inserted.
    """
    graph = Graph(model)
    for n in graph.nodes:
        if n.kind == "table":
            n.attrs["source"].keyed(n.layer, seed, graph.layer_key(n.layer))

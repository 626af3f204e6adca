"""A small IR of a Keras functional graph. The ONLY module that reads Keras private attributes.

    >>> import models
    >>> from des.data import FeatureSpec, Field
    >>> model = models.deepfm(FeatureSpec((Field("C1", dim=4), Field("C2", dim=4))), hidden=(8,))
    >>> g = Graph(model)
    >>> [n.kind for n in g.nodes][:3]
    ['input', 'input', 'table']
    >>> [(n.kind, type(n.layer).__name__, n.attrs.get("dim")) for n in g.nodes[2:5]]
    [('table', 'FieldEmbedding', 4), ('table', 'FieldEmbedding', 4), ('concat', 'Concatenate', None)]

Every call of a layer is a Node with a canonical ``kind``, its tensor ``operands`` and
constant ``attrs``, so that the rules see one graph whatever the user's spelling:

- tables: a layer a table source recognises (des.graph.sources: this project's FieldEmbedding,
  TFRA's and Keras's Embedding) -> ``table`` with attrs ``dim`` and ``source``;
- third-party CTR layers (des.graph.adapters: DeepCTR's Linear, FM, BiInteractionPooling, DNN) and
  a user's own layer declaring ``des_substitute`` -> the canonical kind they compute;
- Keras layers and the TFOpLambda layers of tf ops map to the same kinds: ``add``
  (Add, +, tf.add, tf.add_n), ``sub``, ``mul`` (``x * x`` becomes ``square``, ``x / c``
  becomes ``mul`` by 1/c), ``square`` (also ``pow(x, 2)``), ``reduce_sum`` / ``reduce_mean``
  (``axis`` as a sorted tuple of non-negative axes, ``keepdims``), ``stack`` / ``concat``
  (non-negative ``axis``), ``reshape`` / ``flatten`` / ``squeeze`` / ``expand_dims``, ``dense``
  (attrs ``kernel``, ``bias``, ``activation``), ``input``; else ``layer:<Class>`` or ``tf:<symbol>``;
- a nested ``Sequential`` is inlined: its layers become nodes of this graph.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import tensorflow as tf

from des.graph import adapters
from des.graph import sources

KerasTensor = Any

_TF_KINDS = {  # TFOpLambda symbol -> (kind, operand parameter(s), attrs with defaults)
    "math.reduce_sum": ("reduce_sum", "input_tensor", {"axis": None, "keepdims": False}),
    "math.reduce_mean": ("reduce_mean", "input_tensor", {"axis": None, "keepdims": False}),
    "math.square": ("square", "x", {}),
    "math.pow": ("pow", ("x", "y"), {}),
    "math.subtract": ("sub", ("x", "y"), {}),
    "math.multiply": ("mul", ("x", "y"), {}),
    "math.truediv": ("div", ("x", "y"), {}),
    "math.add": ("add", ("x", "y"), {}),
    "__operators__.add": ("add", ("x", "y"), {}),
    "math.add_n": ("add", "inputs", {}),
    "stack": ("stack", "values", {"axis": 0}),
    "concat": ("concat", "values", {"axis": None}),
    "reshape": ("reshape", "tensor", {"shape": None}),
    "compat.v1.squeeze": ("squeeze", "input", {"axis": None}),
    "squeeze": ("squeeze", "input", {"axis": None}),
    "expand_dims": ("expand_dims", "input", {"axis": None}),
}
_LAYER_KINDS = {"Add": "add", "Subtract": "sub", "Multiply": "mul", "Concatenate": "concat",
                "Dense": "dense", "Flatten": "flatten", "Reshape": "reshape", "InputLayer": "input"}


@dataclasses.dataclass(eq=False)
class Node:
    """One call of one layer. ``operands`` are tensor ids or Python constants."""
    index: int
    layer: tf.keras.layers.Layer
    kind: str
    operands: list
    attrs: dict
    outputs: list[int]
    call_args: tuple
    call_kwargs: dict

    @property
    def output(self) -> int:
        return self.outputs[0]

    def tensor_operands(self) -> list[int]:
        return [o for o in self.operands if isinstance(o, TensorId)]

    def __repr__(self) -> str:
        return f"Node({self.index}, {self.kind}, {self.layer.name})"


class TensorId(int):
    """The id of a KerasTensor in a Graph (an int, marked so constants are not mistaken for it)."""


def is_keras_tensor(x) -> bool:
    return hasattr(x, "_keras_history")


def _flat_operands(x, tid) -> list:
    return [TensorId(tid(t)) if is_keras_tensor(t) else t for t in tf.nest.flatten(x)]


def _rank(x) -> int | None:
    return x.shape.rank if is_keras_tensor(x) else None


def _axes(axis, rank: int | None):
    """``axis`` (int, list or None) as a sorted tuple of non-negative axes; None stays None."""
    if axis is None or rank is None:
        return axis
    if hasattr(axis, "numpy"):
        axis = axis.numpy().tolist()
    axes = axis if isinstance(axis, (list, tuple)) else [axis]
    return tuple(sorted(int(a) % rank for a in axes))


def _const(x):
    try:
        return float(x)
    except (TypeError, ValueError):
        return None


def _classify_tf_op(layer, args, kwargs, tid) -> tuple[str, list, dict]:
    spec = _TF_KINDS.get(layer.symbol)
    fallback = (f"tf:{layer.symbol}", _flat_operands((args, kwargs), tid), {})
    if spec is None:
        return fallback
    kind, operand_names, defaults = spec
    try:
        bound = inspect.signature(layer.function).bind(*args, **kwargs)
    except TypeError:
        return fallback
    params = {**defaults, **bound.arguments}
    if kind == "squeeze" and params.get("axis") is None:
        params["axis"] = params.get("squeeze_dims")
    names = (operand_names,) if isinstance(operand_names, str) else operand_names
    values = [params.get(n) for n in names]
    attrs = {k: params.get(k, v) for k, v in defaults.items()}
    first = tf.nest.flatten(values[0])[0] if values else None
    if kind in ("reduce_sum", "reduce_mean"):
        attrs["axis"] = _axes(attrs["axis"], _rank(first))
        attrs["keepdims"] = bool(attrs["keepdims"])
    elif kind == "concat":
        attrs["axis"] = _axes(attrs["axis"], _rank(first))[0]
    elif kind == "stack":
        attrs["axis"] = _axes(attrs["axis"], (_rank(first) or 0) + 1)[0]
    elif kind == "expand_dims":
        attrs["axis"] = _axes(attrs["axis"], (_rank(first) or 0) + 1)[0]
    elif kind == "squeeze":
        attrs["axis"] = _axes(attrs["axis"], _rank(first))
    elif kind == "reshape":
        attrs["shape"] = tuple(int(s) for s in tf.nest.flatten(attrs["shape"])) if \
            all(_const(s) is not None for s in tf.nest.flatten(attrs["shape"])) else None
    operands = []
    for v in values:
        operands += _flat_operands(v, tid)
    # x * x is square(x); pow(x, 2) too; x / c is x * (1/c)
    if kind == "mul" and len(operands) == 2 and isinstance(operands[0], TensorId) and operands[0] == operands[1]:
        return "square", operands[:1], {}
    if kind == "pow":
        if len(operands) == 2 and isinstance(operands[0], TensorId) and _const(operands[1]) == 2.0:
            return "square", operands[:1], {}
        return fallback
    if kind == "div":
        c = _const(operands[1]) if len(operands) == 2 else None
        if isinstance(operands[0], TensorId) and c:
            return "mul", [operands[0], 1.0 / c], {}
        return fallback
    return kind, operands, attrs


def classify(layer, args, kwargs, tid) -> tuple[str, list, dict]:
    """The canonical (kind, operands, attrs) of one call of ``layer``."""
    first = args[0] if args else next(iter(kwargs.values()), None)
    src = sources.source_of(layer)
    if src is not None:
        return "table", _flat_operands(first, tid), {"dim": src.dim(layer), "source": src,
                                                     "field": src.field(layer)}
    adapted = adapters.adapt(layer, args, kwargs)
    if adapted is not None:
        kind, operands, attrs = adapted
        return kind, _flat_operands(operands, tid), attrs
    cls = type(layer).__name__
    if cls == "TFOpLambda":
        return _classify_tf_op(layer, args, kwargs, tid)
    kind = _LAYER_KINDS.get(cls, f"layer:{cls}")
    attrs = {}
    rank = _rank(tf.nest.flatten(first)[0]) if first is not None else None
    if kind == "concat":
        attrs["axis"] = _axes(layer.axis, rank)[0]
    elif kind == "dense":
        attrs = {"units": layer.units, "kernel": layer.kernel, "bias": layer.bias if layer.use_bias else None,
                 "activation": layer.activation, "rest": None, "kernel_regularizer": layer.kernel_regularizer,
                 "bias_regularizer": layer.bias_regularizer if layer.use_bias else None,
                 "kernel_constraint": layer.kernel_constraint, "trainable": layer.trainable}
    elif kind == "reshape":
        attrs["shape"] = tuple(layer.target_shape)
    return kind, _flat_operands(first, tid), attrs


class Graph:
    """Nodes in topological order plus who produces and who consumes each tensor."""

    def __init__(self, model: tf.keras.Model):
        if not getattr(model, "_is_graph_network", False):
            raise TypeError(f"des.graph.ir.Graph needs a functional tf.keras model (or a Sequential with an input "
                            f"shape), got a subclassed {type(model).__name__}: trace it first (des.compiler.trace_call)")
        self.model = model
        self.tensors: dict[int, KerasTensor] = {}
        self.untraced: dict[str, str] = {}      # subclassed models inside whose call() did not trace: why
        self.nodes: list[Node] = []
        for depth in sorted(model._nodes_by_depth, reverse=True):
            for kn in model._nodes_by_depth[depth]:
                self._add(kn.layer, tuple(kn.call_args), dict(kn.call_kwargs), kn.outputs, kn.is_input)
        self.producer = {t: n for n in self.nodes for t in n.outputs}
        self.consumers: dict[int, list[Node]] = {t: [] for t in self.tensors}
        for n in self.nodes:
            for t in set(n.tensor_operands()) | {id(x) for x in all_keras_tensors((n.call_args, n.call_kwargs))}:
                self.consumers.setdefault(t, []).append(n)
        self.input_ids = [TensorId(id(t)) for t in tf.nest.flatten(model.input)]
        self.output_ids = [TensorId(id(t)) for t in tf.nest.flatten(model.output)]

    def _tid(self, t) -> int:
        self.tensors[id(t)] = t
        return id(t)

    def _add(self, layer, args, kwargs, outputs, is_input=False) -> None:
        if is_input:
            outs = [TensorId(self._tid(t)) for t in tf.nest.flatten(outputs)]
            self.nodes.append(Node(len(self.nodes), layer, "input", [], {}, outs, (), {}))
            return
        if isinstance(layer, tf.keras.Sequential) and not kwargs and len(args) == 1 and layer.layers:
            self._inline_sequential(layer, args[0], outputs)
            return
        if isinstance(layer, tf.keras.Model) and getattr(layer, "_is_graph_network", False) and len(args) == 1:
            self._inline_functional(layer, args[0], outputs)
            return
        if isinstance(layer, tf.keras.Model) and len(args) == 1 and set(kwargs) <= {"training"}:
            try:                          # a subclassed model inside: read its call() through if it traces
                inner = trace(layer, args[0])
            except Exception as e:  # noqa: BLE001 - left opaque; the report names it with this cause
                inner = None
                self.untraced[layer.name] = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
            if inner is not None:
                self._inline_functional(inner, args[0], outputs)
                return
        kind, operands, attrs = classify(layer, args, kwargs, self._tid)
        outs = [TensorId(self._tid(t)) for t in tf.nest.flatten(outputs)]
        self.nodes.append(Node(len(self.nodes), layer, kind, operands, attrs, outs, args, kwargs))

    def _inline_sequential(self, seq, x, outputs) -> None:
        """One node per layer of ``seq``: symbolic calls give the intermediate tensors; the last
        node produces the Sequential's own output tensor."""
        h = x
        for i, layer in enumerate(seq.layers):
            out = outputs if i == len(seq.layers) - 1 else layer(h)
            self._add(layer, (h,), {}, out)
            h = out

    def _inline_functional(self, inner: tf.keras.Model, x, outputs) -> None:
        """A functional model called as a layer (a tower): its nodes, called symbolically on the
        outer tensors, become nodes of this graph, so its Embeddings and first Dense layers are
        candidates like the outer model's; an identity node per output produces the call's own
        output tensors."""
        env = {id(i): o for i, o in zip(tf.nest.flatten(inner.input), tf.nest.flatten(x))}

        def look(t):
            return env[id(t)] if is_keras_tensor(t) else t
        for depth in sorted(inner._nodes_by_depth, reverse=True):
            for kn in inner._nodes_by_depth[depth]:
                if kn.is_input:
                    continue
                args = tf.nest.map_structure(look, tuple(kn.call_args))
                kwargs = tf.nest.map_structure(look, dict(kn.call_kwargs))
                out = kn.layer(*args, **kwargs)
                for old, new in zip(tf.nest.flatten(kn.outputs), tf.nest.flatten(out)):
                    env[id(old)] = new
                self._add(kn.layer, args, kwargs, out)
        for got, t in zip(tf.nest.flatten(inner.output), tf.nest.flatten(outputs)):
            same = tf.keras.layers.Identity(name=f"{inner.name}_output_{len(self.nodes)}")
            src = env[id(got)]
            self.nodes.append(Node(len(self.nodes), same, "identity", [TensorId(self._tid(src))], {},
                                   [TensorId(self._tid(t))], (src,), {}))

    def shape(self, t: int) -> tf.TensorShape:
        return self.tensors[t].shape

    def dtype(self, t: int) -> tf.DType:
        return self.tensors[t].dtype

    def layer_calls(self, layer) -> int:
        """How many times ``layer`` is called in this graph (shared layers are called more than once)."""
        return sum(1 for n in self.nodes if n.layer is layer)

    def input_name(self, t: int) -> str | None:
        n = self.producer.get(t)
        return n.layer.name if n is not None and n.kind == "input" else None

    def layer_key(self, layer) -> str:
        """A name for ``layer`` that is the same in every build of the same model code:
        the position of its first call in topological order and its class."""
        for n in self.nodes:
            if n.layer is layer:
                return f"{n.index}:{type(layer).__name__}"
        raise KeyError(layer.name)


def trace(model: tf.keras.Model, like, prefix: str = "input") -> tf.keras.Model:
    """A functional model of ``model.call`` on fresh symbolic inputs shaped like ``like`` (nested
    tf.TensorSpec or tensors; a dict keeps its keys as input names, other inputs are named
    ``prefix`` or ``prefix_<i>``, never by Keras's process-wide counter). It shares ``model``'s
    layers. Raises what ``call`` raises on symbolic inputs (Python control flow on tensor values...)."""
    def fresh(s, name=None):
        return tf.keras.Input(shape=s.shape[1:], dtype=s.dtype, name=name)
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), like)
    if isinstance(specs, dict):
        inputs = {k: fresh(s, str(k)) for k, s in specs.items()}
    else:
        flat = tf.nest.flatten(specs)
        names = [prefix] if len(flat) == 1 else [f"{prefix}_{i}" for i in range(len(flat))]
        inputs = tf.nest.pack_sequence_as(specs, [fresh(s, n) for s, n in zip(flat, names)])
    return tf.keras.Model(inputs, model.call(inputs), name=f"{model.name}_traced")


def trace_used(model: tf.keras.Model, like, prefix: str = "input") -> tf.keras.Model:
    """``trace``, keeping only the inputs ``call`` reads when they are a dict (a label in the batch
    is not): the functional model des.transform rewrites for a subclassed model, and so the one
    whose graph keys its state (des.runtime.state)."""
    traced = trace(model, like, prefix)
    if isinstance(traced.input, dict):
        graph = Graph(traced)
        used = {graph.input_name(t) for t in graph.input_ids if graph.consumers.get(t)}
        if used != set(traced.input):
            traced = tf.keras.Model({k: v for k, v in traced.input.items() if k in used}, traced.output,
                                    name=f"{model.name}_traced")
    return traced


def all_keras_tensors(structure) -> list:
    return [x for x in tf.nest.flatten(structure) if is_keras_tensor(x)]


def call_node(node: Node, look: Callable[[Any], Any]):
    """Call ``node``'s layer again with its arguments mapped through ``look``."""
    args = tf.nest.map_structure(look, node.call_args)
    kwargs = tf.nest.map_structure(look, node.call_kwargs)
    return node.layer(*args, **kwargs)


def replay(graph: Graph, skip: set[int], given: dict[int, Callable], cls=tf.keras.Model,
           suffix: str = "des", input_map: Callable | None = None,
           output_map: Callable | None = None) -> tf.keras.Model:
    """Rebuild graph.model as a new functional model (of class ``cls``), calling the same layers again.

    Nodes in ``skip`` are not called. ``given`` maps a tensor id to a function of ``look``
    (tensor of the old graph -> tensor of the new one) that makes its replacement; it is
    called when the replay reaches the node producing that tensor. ``input_map(input)``: what
    the replayed nodes read instead of a model input (made on first use); ``output_map(tensor,
    index)``: what the model outputs instead of its index-th output.
    """
    env: dict[int, KerasTensor] = {} if input_map else {t: graph.tensors[t] for t in graph.input_ids}
    inputs = set(graph.input_ids)

    def look(x):
        if not is_keras_tensor(x):
            return x
        if id(x) not in env and id(x) in inputs:
            env[id(x)] = input_map(graph.tensors[id(x)])
        return env[id(x)]

    for node in graph.nodes:
        if node.kind == "input":
            continue
        for t in node.outputs:
            if t in given and t not in env:
                env[t] = given[t](look)
        if node.index in skip or all(t in env for t in node.outputs):
            continue
        out = call_node(node, look)
        for t, new in zip(node.outputs, tf.nest.flatten(out)):
            env[t] = new
    flat = [look(t) for t in tf.nest.flatten(graph.model.output)]
    if output_map:
        flat = [output_map(t, i) for i, t in enumerate(flat)]
    outputs = tf.nest.pack_sequence_as(graph.model.output, flat)
    return cls(graph.model.input, outputs, name=f"{graph.model.name}_{suffix}")

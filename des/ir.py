"""A small IR of a Keras functional graph. The ONLY module that reads Keras private attributes.

    >>> g = Graph.from_model(model)
    >>> [n.kind for n in g.nodes][:3]
    ['input', 'input', 'embed']

Every call of a layer is a Node with a canonical ``kind`` (``add``, ``sub``, ``mul``,
``square``, ``reduce_sum``, ``stack``, ``concat``, ``dense``, ``flatten``, ``reshape``,
``embed``, ``input``, a declared ``des_substitute`` name, else ``layer:<Class>`` or
``tf:<symbol>``), its tensor ``operands`` and constant ``attrs``. Keras layers and the
TFOpLambda layers that ``tf.reduce_sum(kt)`` and friends create map to the same kinds.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import tensorflow as tf

KerasTensor = Any

_TF_KINDS = {  # TFOpLambda symbol -> (kind, operand parameter, attrs with defaults)
    "math.reduce_sum": ("reduce_sum", "input_tensor", {"axis": None, "keepdims": False}),
    "math.square": ("square", "x", {}),
    "math.subtract": ("sub", ("x", "y"), {}),
    "math.multiply": ("mul", ("x", "y"), {}),
    "math.add": ("add", ("x", "y"), {}),
    "__operators__.add": ("add", ("x", "y"), {}),
    "math.add_n": ("add", "inputs", {}),
    "stack": ("stack", "values", {"axis": 0}),
    "concat": ("concat", "values", {"axis": None}),
    "reshape": ("reshape", "tensor", {"shape": None}),
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


def _is_kt(x) -> bool:
    return hasattr(x, "_keras_history")


def _classify(layer, args, kwargs, tid) -> tuple[str, list, dict]:
    cls = type(layer).__name__
    if getattr(layer, "des_substitute", None):
        return layer.des_substitute, _flat_operands(args[0] if args else kwargs, tid), {}
    if getattr(layer, "des_embedding", False):
        return "embed", _flat_operands(args[0], tid), {"dim": layer.dim, "field": layer.field}
    if cls == "TFOpLambda":
        spec = _TF_KINDS.get(layer.symbol)
        if spec is None:
            return f"tf:{layer.symbol}", _flat_operands((args, kwargs), tid), {}
        kind, operand_names, defaults = spec
        try:
            bound = inspect.signature(layer.function).bind(*args, **kwargs)
        except TypeError:
            return f"tf:{layer.symbol}", _flat_operands((args, kwargs), tid), {}
        params = {**defaults, **bound.arguments}
        names = (operand_names,) if isinstance(operand_names, str) else operand_names
        operands = []
        for n in names:
            operands += _flat_operands(params.get(n), tid)
        return kind, operands, {k: params.get(k, v) for k, v in defaults.items()}
    kind = _LAYER_KINDS.get(cls, f"layer:{cls}")
    attrs = {}
    if kind == "concat":
        attrs["axis"] = layer.axis
    elif kind == "dense":
        attrs = {"units": layer.units, "use_bias": layer.use_bias}
    elif kind == "reshape":
        attrs["shape"] = tuple(layer.target_shape)
    first = args[0] if args else next(iter(kwargs.values()), None)
    return kind, _flat_operands(first, tid), attrs


def _flat_operands(x, tid) -> list:
    return [TensorId(tid(t)) if _is_kt(t) else t for t in tf.nest.flatten(x)]


class Graph:
    """Nodes in topological order plus who produces and who consumes each tensor."""

    def __init__(self, model: tf.keras.Model):
        if not getattr(model, "_is_graph_network", False):
            raise TypeError(f"des.transform needs a functional tf.keras model, got {type(model).__name__}")
        self.model = model
        self.tensors: dict[int, KerasTensor] = {}
        self.nodes: list[Node] = []

        def tid(t) -> int:
            self.tensors[id(t)] = t
            return id(t)

        for depth in sorted(model._nodes_by_depth, reverse=True):
            for kn in model._nodes_by_depth[depth]:
                layer = kn.layer
                if kn.is_input:
                    outs = [TensorId(tid(t)) for t in tf.nest.flatten(kn.outputs)]
                    self.nodes.append(Node(len(self.nodes), layer, "input", [], {}, outs, (), {}))
                    continue
                args, kwargs = tuple(kn.call_args), dict(kn.call_kwargs)
                kind, operands, attrs = _classify(layer, args, kwargs, tid)
                outs = [TensorId(tid(t)) for t in tf.nest.flatten(kn.outputs)]
                self.nodes.append(Node(len(self.nodes), layer, kind, operands, attrs, outs, args, kwargs))
        self.producer = {t: n for n in self.nodes for t in n.outputs}
        self.consumers: dict[int, list[Node]] = {t: [] for t in self.tensors}
        for n in self.nodes:
            for t in set(n.tensor_operands()) | {id(x) for x in _all_kts((n.call_args, n.call_kwargs))}:
                self.consumers.setdefault(t, []).append(n)
        self.input_ids = [id(t) for t in tf.nest.flatten(model.input)]
        self.output_ids = [id(t) for t in tf.nest.flatten(model.output)]

    @classmethod
    def from_model(cls, model) -> "Graph":
        return cls(model)

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


def _all_kts(structure) -> list:
    return [x for x in tf.nest.flatten(structure) if _is_kt(x)]


def replay(graph: Graph, skip: set[int], given: dict[int, KerasTensor], cls=tf.keras.Model,
           suffix: str = "des") -> tf.keras.Model:
    """Rebuild graph.model as a new functional model (of class ``cls``), calling the same layers again.

    Nodes in ``skip`` are not called; ``given`` maps tensor ids to replacement tensors.
    """
    env: dict[int, KerasTensor] = {t: graph.tensors[t] for t in graph.input_ids}
    env.update(given)

    def look(x):
        return env[id(x)] if _is_kt(x) else x

    for node in graph.nodes:
        if node.kind == "input" or node.index in skip or all(t in env for t in node.outputs):
            continue
        args = tf.nest.map_structure(look, node.call_args)
        kwargs = tf.nest.map_structure(look, node.call_kwargs)
        out = node.layer(*args, **kwargs)
        for t, new in zip(node.outputs, tf.nest.flatten(out)):
            env[t] = new
    outputs = tf.nest.map_structure(lambda t: env[id(t)], graph.model.output)
    return cls(graph.model.input, outputs, name=f"{graph.model.name}_{suffix}")

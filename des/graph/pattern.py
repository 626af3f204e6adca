"""Dataflow patterns over des.graph.ir graphs that read like the math.

    >>> import tensorflow as tf
    >>> from models.layers import FieldEmbedding
    >>> ids = {f: tf.keras.Input([], dtype=tf.int64, name=f) for f in ("C1", "C2")}
    >>> emb = tf.stack([FieldEmbedding(field=f, dim=4)(x) for f, x in ids.items()], axis=1)     # [B, 2, 4]
    >>> out = 0.5 * tf.reduce_sum(tf.square(tf.reduce_sum(emb, 1)) - tf.reduce_sum(tf.square(emb), 1), -1)
    >>> graph = Graph(tf.keras.Model(ids, out))
    >>> E = V("E")
    >>> fm = Op("mul", 0.5, Op("reduce_sum", Op("sub", Op("square", Op("reduce_sum", E, axis=axes(1))),
    ...                                            Op("reduce_sum", Op("square", E), axis=axes(1))),
    ...                         axis=last_axis))
    >>> state = fm.match(graph, graph.nodes[-1].output)      # None, or bindings {"E": id} + matched nodes
    >>> graph.producer[state.bindings["E"]].kind, sorted(graph.nodes[i].kind for i in state.nodes)
    ('stack', ['mul', 'reduce_sum', 'reduce_sum', 'reduce_sum', 'square', 'square', 'sub'])
    >>> Op("reduce_sum", E, axis=1).match(graph, graph.nodes[-1].output) is None   # axes are tuples
    True

A ``V`` binds a tensor; the same name must bind the same tensor everywhere. An ``Op``
matches the node producing a tensor by kind, operands (patterns or constants) and attrs
(a value, a tuple of allowed values, or a predicate ``f(value, node, graph) -> bool``;
an attr not named is not checked). ``add`` and ``mul`` are commutative.
"""
from __future__ import annotations

import dataclasses

from des.graph.ir import Graph, TensorId

COMMUTATIVE = {"add", "mul"}


@dataclasses.dataclass
class State:
    bindings: dict[str, int] = dataclasses.field(default_factory=dict)
    nodes: set[int] = dataclasses.field(default_factory=set)

    def copy(self) -> "State":
        return State(dict(self.bindings), set(self.nodes))


class Pattern:
    def match(self, graph: Graph, t, state: State | None = None) -> State | None:
        return self._match(graph, t, state or State())

    def _match(self, graph, t, state):  # pragma: no cover - interface
        raise NotImplementedError


@dataclasses.dataclass
class V(Pattern):
    """A named tensor variable."""
    name: str

    def _match(self, graph, t, state):
        if not isinstance(t, TensorId):
            return None
        if self.name in state.bindings:
            return state if state.bindings[self.name] == t else None
        s = state.copy()
        s.bindings[self.name] = t
        return s


class Op(Pattern):
    """The node producing the tensor has ``kind``, these operands and these attrs."""

    def __init__(self, kind: str, *operands, **attrs):
        self.kind, self.operands, self.attrs = kind, operands, attrs

    def _match(self, graph, t, state):
        node = graph.producer.get(t) if isinstance(t, TensorId) else None
        if node is None or node.kind != self.kind or len(node.operands) != len(self.operands):
            return None
        for k, want in self.attrs.items():
            got = node.attrs.get(k)
            if callable(want):
                if not want(got, node, graph):
                    return None
                continue
            if isinstance(want, tuple) and got not in want:
                return None
            if not isinstance(want, tuple) and got != want:
                return None
        orders = [node.operands]
        if self.kind in COMMUTATIVE and len(node.operands) == 2:
            orders.append(node.operands[::-1])
        for ops in orders:
            s = state.copy()
            for pat, operand in zip(self.operands, ops):
                s = _match_operand(pat, graph, operand, s)
                if s is None:
                    break
            if s is not None:
                s.nodes.add(node.index)
                return s
        return None


class Alt(Pattern):
    """The first of several patterns that matches."""

    def __init__(self, *alternatives: Pattern):
        self.alternatives = alternatives

    def _match(self, graph, t, state):
        for p in self.alternatives:
            s = p._match(graph, t, state)
            if s is not None:
                return s
        return None


def axes(*want: int):
    """Predicate: a reduction over exactly these (non-negative) axes."""
    return lambda got, node, graph: got == tuple(want)


def last_axis(axes, node, graph) -> bool:
    """Predicate: a reduction over the last axis of its input only."""
    ops = node.tensor_operands()
    return bool(ops) and axes == (graph.shape(ops[0]).rank - 1,)


def _match_operand(pat, graph, operand, state):
    if isinstance(pat, Pattern):
        return pat._match(graph, operand, state)
    if isinstance(operand, TensorId) or isinstance(operand, bool):
        return None
    try:
        return state if abs(float(operand) - float(pat)) < 1e-12 else None
    except (TypeError, ValueError):
        return None

"""The rule interface, the registry and the helpers the rules share.

A rule is one unit: a pattern over the canonical graph (des.graph.ir, des.graph.fields), the sub-operator
it substitutes (des_ops.suboperators) and the replicated ``finish`` that turns the combined
sum into the original operator's output. A new rule is one file:

    >>> @register(priority=50)
    ... class MyRule(Rule):
    ...     name = "my_rule"
    ...     def match(self, graph, fields, node): ...              # Match | Rejection | None
    ...     def sub_operator(self, match, owned, name): ...       # a des_ops SubOperator
    >>> [(r.name, r.priority) for r in RULES]
    [('my_rule', 50), ('embed_concat_dense', 40), ('fm_interaction', 30), ('bi_interaction', 20), ('lr_sum', 10), ('field_rows', 0)]
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import tensorflow as tf

from des.graph.fields import FieldAnalysis, FieldVector, Layout
from des.graph.ir import Graph, Node

RULES: list["Rule"] = []


@dataclasses.dataclass(eq=False)
class Match:
    """A safe substitution: ``root`` (its output is replaced), the field ``vectors`` it reads in
    the operator's order, the ``internal`` nodes it absorbs, and rule-specific ``data``."""
    rule: str
    root: Node
    vectors: list[FieldVector]
    internal: set[int]
    others: list[int] = dataclasses.field(default_factory=list)   # replicated tensors the finish reads
    data: dict = dataclasses.field(default_factory=dict)
    out_shape: tuple = ()                                         # the root's per-sample shape
    dense_parameters: int = 0     # weights DES splits by field that a PS would allreduce whole (cost model)

    @property
    def fields(self) -> list[str]:
        return [v.field for v in self.vectors]

    @property
    def nodes(self) -> set[int]:
        """Every node the substitution replaces: its own and its field vectors' chains."""
        return set(self.internal).union(*(v.chain for v in self.vectors))


@dataclasses.dataclass
class Rejection:
    rule: str
    root: Node
    reason: str

    def __str__(self) -> str:
        return f"{self.rule} at {self.root.layer.name!r}: {self.reason}"


class Rule:
    name: str = ""
    priority: int = 0
    fallback = False          # True: not tried node by node (rewrite_rules.field_rows runs after the others)
    # True: exact when a field vector it reads is split into key stripes (one id a sample: the sum over
    # processes of the stripes' vectors is the vector, and exactly one of them is non-zero; des.compiler.big_tables)
    stripes_exact = False
    # True: linear in each field vector it reads (a sum, a matrix product) and built for it, so also exact
    # for a field looked up with several ids a sample, whose stripes' vectors sum to the vector but may
    # all be non-zero (field rows, linear too, keys its exchange by one id a sample: False)
    stripes_linear = False
    # True: squares a field vector only after the sum over processes for the fields ``sub_operator`` is told
    # to sum first (``match.data["summed"]``: FM, NFM's bi-interaction), so also exact for the stripes of a
    # field of several ids a sample, whose squares do not add up to the square of their sum
    sums_stripes_first = False

    def stripes_refusal(self, match: Match) -> str | None:
        """Why a field vector ``match`` reads cannot be split into key stripes, or None."""
        return None if self.stripes_exact else \
            f"{self.name} at {match.root.layer.name!r} reads it (not built for key stripes)"

    def match(self, graph: Graph, fields: FieldAnalysis, node: Node) -> Match | Rejection | None:  # pragma: no cover
        raise NotImplementedError

    def sub_operator(self, match: Match, owned: list[FieldVector], name: str):  # pragma: no cover
        """The des_ops SubOperator of this process: partial of ``owned`` vectors, combine of the sum."""
        raise NotImplementedError

    def finish(self, match: Match, combined, look: Callable):
        """The root's output from the combined sub-operator output (replicated on every process).
        ``look`` maps a tensor id of the old graph to the new tensor. Default: reshape to the root's shape."""
        return Reshaped(match.out_shape, name=f"des_{self.name}_{match.root.layer.name}_out")(combined)


def register(cls=None, *, priority: int = 0):
    """Class decorator: add one instance of the rule to the registry; higher priority is tried first."""
    def add(c):
        c.priority = priority
        RULES.append(c())
        RULES.sort(key=lambda r: -r.priority)
        return c
    return add(cls) if cls is not None else add


class Reshaped(tf.keras.layers.Layer):
    """x reshaped to [B, *shape] (the original operator's output shape)."""

    def __init__(self, shape: tuple, **kwargs):
        super().__init__(**kwargs)
        self.shape = tuple(shape)

    @tf.autograph.experimental.do_not_convert   # plain TF ops: autograph would only slow tracing
    def call(self, x, training=None):   # ``training``: Keras passes it through the decorator
        return tf.reshape(x, tf.concat([tf.shape(x)[:1], tf.constant(self.shape, tf.int32)], 0)) \
            if tuple(x.shape[1:]) != self.shape else x


def check_vectors(graph: Graph, vectors: list[FieldVector]) -> str | None:
    """Why these field vectors cannot be partitioned by field, or None."""
    seen = set()
    for v in vectors:
        if v.table.index in seen:
            return f"table {v.table.layer.name!r} appears twice in the operator"
        seen.add(v.table.index)
        if graph.dtype(v.tensor) != tf.float32:
            return f"field vector of {v.table.layer.name!r} has dtype {graph.dtype(v.tensor).name}, only float32 is supported"
    return None


def stack_of_fields(fields: FieldAnalysis, t, rule: str, root: Node) -> Layout | Rejection:
    """The [B, F, K] stack of field vectors at t, or a Rejection naming why not."""
    lay = fields.layout(t) if t is not None else None
    if lay is None or lay.form != "stack":
        why = fields.why_not(t) if lay is None else f"its input is a {lay.form} of field vectors, not a [B, F, K] stack"
        return Rejection(rule, root, f"the interaction input is not a stack of field vectors: {why}")
    if lay.others:
        names = [fields.graph.producer[p.tensor].layer.name for p in lay.others]
        return Rejection(rule, root, f"the stack mixes field vectors with other tensors ({', '.join(names)})")
    widths = sorted({v.width for v in lay.vectors})
    if len(widths) != 1:
        return Rejection(rule, root, f"field vectors of different widths {widths} in one interaction")
    return lay


__all__ = ["Match", "Rejection", "Rule", "register", "RULES", "check_vectors", "stack_of_fields", "Reshaped"]

"""The rule interface, the registry and the helpers the rules share."""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from des.ir import Graph, Node, TensorId
from des.pattern import Op, V

RULES: list["Rule"] = []


@dataclasses.dataclass
class Match:
    """A safe substitution: ``root`` (its output is replaced) plus the ``internal`` nodes it absorbs."""
    rule: str
    root: Node
    embeds: list[Node]
    internal: set[int]

    @property
    def fields(self) -> list[str]:
        return [e.attrs["field"] for e in self.embeds]


@dataclasses.dataclass
class Rejection:
    rule: str
    root: Node
    reason: str

    def __str__(self) -> str:
        return f"{self.rule} at {self.root.layer.name!r}: {self.reason}"


class Rule:
    name: str = ""

    def match(self, graph: Graph, node: Node) -> Match | Rejection | None:  # pragma: no cover
        raise NotImplementedError


def register(cls):
    """Class decorator: add one instance of the rule to the registry (in priority order)."""
    RULES.append(cls())
    return cls


def embed_node(graph: Graph, t) -> Node | None:
    """The FieldEmbedding call producing tensor t, if any."""
    n = graph.producer.get(t) if isinstance(t, TensorId) else None
    return n if n is not None and n.kind == "embed" else None


def stacked_embeddings(graph: Graph, t) -> tuple[list[Node], set[int]] | None:
    """[B, F, k] built from field embeddings: tf.stack(embs, axis=1), or
    Concatenate(axis=1) of Reshape((1, k)) of embeddings. Returns (embed nodes, glue nodes)."""
    n = graph.producer.get(t) if isinstance(t, TensorId) else None
    if n is None:
        return None
    if n.kind == "stack" and n.attrs.get("axis") == 1:
        embs = [embed_node(graph, o) for o in n.operands]
        return (embs, {n.index}) if embs and all(embs) else None
    if n.kind == "concat" and n.attrs.get("axis") == 1:
        embs, glue = [], {n.index}
        for o in n.operands:
            r = graph.producer.get(o) if isinstance(o, TensorId) else None
            if r is None or r.kind != "reshape" or len(r.operands) != 1:
                return None
            e = embed_node(graph, r.operands[0])
            if e is None or tuple(r.attrs.get("shape") or ()) != (1, e.attrs["dim"]):
                return None
            embs.append(e)
            glue.add(r.index)
        return embs, glue
    return None


def concatenated_embeddings(graph: Graph, t) -> tuple[list[Node], set[int], list] | None:
    """[B, sum k] = concat(embs, axis=-1) or Flatten(stack(embs, axis=1)).
    Returns (embed nodes, glue nodes, operands that are not embeddings)."""
    n = graph.producer.get(t) if isinstance(t, TensorId) else None
    if n is None:
        return None
    if n.kind == "concat" and n.attrs.get("axis") in (1, -1) and len(graph.shape(t)) == 2:
        embs = [embed_node(graph, o) for o in n.operands]
        others = [o for o, e in zip(n.operands, embs) if e is None]
        return [e for e in embs if e], {n.index}, others
    if n.kind == "flatten" and len(n.operands) == 1:
        inner = stacked_embeddings(graph, n.operands[0])
        if inner:
            return inner[0], inner[1] | {n.index}, []
    return None


def check_embeddings(graph: Graph, embeds: list[Node]) -> str | None:
    """Why these embeddings cannot be field-partitioned, or None."""
    seen = set()
    for e in embeds:
        if e.layer.name in seen:
            return f"table {e.layer.name!r} appears twice in the match"
        seen.add(e.layer.name)
        if graph.dtype(e.output) != tf.float32:
            return f"embedding {e.layer.name!r} has dtype {graph.dtype(e.output).name}, only float32 is supported"
        if graph.layer_calls(e.layer) != 1:
            return f"table {e.layer.name!r} is shared by several inputs"
        ops = e.tensor_operands()
        if len(ops) not in (1, 2) or any(graph.input_name(t) is None for t in ops):
            return f"embedding {e.layer.name!r} does not read model inputs (ids, or ids and weights) directly"
    return None


__all__ = ["Match", "Rejection", "Rule", "register", "RULES", "Op", "V", "embed_node",
           "stacked_embeddings", "concatenated_embeddings", "check_embeddings"]

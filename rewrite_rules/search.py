"""Run the registered rules over a model's graph: ``find_substitutions`` (outputs first, each node
claimed by at most one match, then unsafe matches dropped with a reason).

    >>> import models
    >>> from des.data import FeatureSpec, Field
    >>> model = models.wdl(FeatureSpec((Field("C1", dim=4), Field("C2", dim=4))), hidden=(8,))
    >>> matches, rejections = find_substitutions(Graph(model))
    >>> [(m.rule, m.root.layer.name, m.fields) for m in matches], rejections
    ([('lr_sum', 'add', ['C1', 'C2']), ('embed_concat_dense', 'dnn_0', ['C1', 'C2'])], [])
"""
from __future__ import annotations

from des.graph.fields import GLUE, FieldAnalysis
from des.graph.ir import Graph
from rewrite_rules.base import RULES, Match, Rejection, Rule
from rewrite_rules.field_rows import gather_left


def find_substitutions(graph: Graph, fields: FieldAnalysis | None = None, operators: bool = True,
                       stripes: int = 1) -> tuple[list[Match], list[Rejection]]:
    """Run every rule at every node (outputs first), then drop unsafe matches. ``operators=False``:
    no operator is split; every table goes by field rows (des.Options(first_layer="rows")).
    ``stripes``: the processes a table of several fields in one key space is split over by key."""
    fields = fields or FieldAnalysis(graph)
    matches, rejections, claimed = [], [], set()
    for node in reversed(graph.nodes) if operators else []:
        if node.index in claimed or node.kind in ("input", "table"):
            continue
        for rule in RULES:
            if rule.fallback:
                continue
            found = rule.match(graph, fields, node)
            if isinstance(found, Match):
                found.out_shape = tuple(graph.shape(node.output)[1:])
                matches.append(found)
                claimed |= found.internal | set().union(*(v.chain for v in found.vectors))
                break
            if isinstance(found, Rejection):
                rejections.append(found)
                break
    matches, rejections = drop_unsafe(graph, matches, rejections, fields)
    rows, why_not = gather_left(graph, fields, matches, stripes)       # every table left whole: by field rows
    return drop_unsafe(graph, matches + rows, rejections + why_not, fields)


def drop_unsafe(graph: Graph, matches: list[Match], rejections: list[Rejection], fields: FieldAnalysis):
    """Drop (and reject, with the reason) every match whose intermediate results or tables are
    also read outside the substituted subgraphs, until none is left."""
    while True:
        inside = set().union(*(m.nodes for m in matches))
        bad = None
        for m in matches:
            for idx in m.internal - {m.root.index}:
                # a layout node (stack/concat/reshape of field vectors) may feed several matches;
                # a math node only its own
                allowed = inside if graph.nodes[idx].kind in GLUE else m.internal
                for t in graph.nodes[idx].outputs:
                    users = [u for u in graph.consumers.get(t, []) if u.index not in allowed]
                    if users or t in graph.output_ids:
                        who = users[0].layer.name if users else "the model output"
                        bad = (m, f"intermediate {graph.nodes[idx].layer.name!r} is also used by {who!r}")
            readers = {}
            for v in m.vectors:
                for idx in v.chain:
                    for t in graph.nodes[idx].outputs:
                        if t == m.root.output:       # a field_rows match: its readers get the vector
                            continue
                        users = [u for u in graph.consumers.get(t, []) if u.index not in inside]
                        if users or t in graph.output_ids:
                            readers.setdefault(v.table.layer.name, (v.field, _blocker(graph, users)))
            for v in m.vectors:          # a shared table: every call of it must be substituted too
                for n in graph.nodes:
                    if n.layer is v.table.layer and n.kind == "table" and n.index not in inside:
                        users = [u for t in n.outputs for u in graph.consumers.get(t, [])]
                        readers.setdefault(v.table.layer.name, (fields.field_of(n), _blocker(graph, users)))
            if readers and bad is None:
                bad = (m, f"tables are also read by layers that are not substituted: {_listed(readers)}")
            if bad:
                break
        if bad is None:
            return matches, rejections
        m, reason = bad
        matches = [x for x in matches if x is not m]
        rejections.append(Rejection(m.rule, m.root, reason))


def _blocker(graph: Graph, users: list) -> str:
    """The layer that blocks: the first reader, followed through layout glue (a concat feeding
    xDeepFM's CIN names the CIN), with its class when it is not a plain Keras op."""
    if not users:
        return "the model output"
    node, seen = users[0], set()
    while node.kind in GLUE and node.index not in seen:
        seen.add(node.index)
        nxt = [u for t in node.outputs for u in graph.consumers.get(t, [])]
        if not nxt:
            break
        node = nxt[0]
    kind = node.kind.removeprefix("layer:")
    return f"{node.layer.name!r}" + (f" ({kind})" if node.kind.startswith("layer:") else "")


def _listed(readers: dict) -> str:
    """'t' (field 'f') by 'who', one reader at a time; many tables of one reader in one phrase."""
    by: dict = {}
    for table, (field, who) in readers.items():
        by.setdefault(who, []).append((table, field))
    parts = []
    for who, tables in by.items():
        if len(tables) <= 3:
            parts += [f"{t!r} (field {f!r}) by {who}" for t, f in tables]
        else:
            names = [t for t, _ in tables]
            parts.append(f"{len(tables)} tables ({names[0]!r}, {names[1]!r}, ..., {names[-1]!r}) by {who}")
    return ", ".join(parts)


def rule_named(name: str) -> Rule:
    for r in RULES:
        if r.name == name:
            return r
    raise KeyError(name)

"""des.transform: find the weights-rich first layers of a Keras model and substitute them.

    >>> model, report = des.transform(deepfm(spec))          # world from Horovod under mpirun
    >>> print(report)

Steps: IR of the functional graph -> every registered rule tried at every node -> safety
checks (no intermediate used outside its match; every table of a substituted field used
only by substituted operators) -> field plan -> one DESFirstLayer with this process's
tables and sub-operators -> the rest of the graph replayed on top of it, with the same
layer objects (so trained weights of the replicated tail are kept).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from des.ir import Graph, replay
from des.plan import FieldCost, FieldPlan, make_plan
from des_ops.comm import Communicator, default_communicator
from des_ops.suboperators import DenseBlock, DESFirstLayer, FMInteraction, LinearSum
from rewrite_rules import RULES, Match, Rejection


@dataclasses.dataclass
class Report:
    substitutions: list[Match]
    rejections: list[Rejection]
    plan: FieldPlan | None
    rank: int
    world_size: int
    floats_per_sample: int = 0
    widths: dict[str, int] = dataclasses.field(default_factory=dict)
    costs: list = dataclasses.field(default_factory=list)   # des.cost.estimate(...), when known

    def estimate_costs(self, batch_size: int, unique_per_slice: dict[str, float]) -> list:
        """DES vs PS bytes per operator (des.cost); kept for printing with the report."""
        from des.cost import estimate
        self.costs = estimate(self, batch_size, unique_per_slice)
        return self.costs

    @property
    def changed(self) -> bool:
        return bool(self.substitutions)

    def payload_bytes(self, batch_size: int) -> int:
        """Bytes handed to the fused allreduce per step (float32 partials)."""
        return 4 * batch_size * self.floats_per_sample

    def ring_bytes(self, batch_size: int) -> float:
        """Analytic bytes sent per process per step by a ring allreduce: 2(N-1)/N * payload."""
        n = self.world_size
        return 2.0 * (n - 1) / n * self.payload_bytes(batch_size)

    def __str__(self) -> str:
        if not self.substitutions:
            lines = ["des.transform: nothing to substitute; the model is returned unchanged."]
        else:
            lines = [f"des.transform: {len(self.substitutions)} substitution(s), rank {self.rank} "
                     f"of {self.world_size}:"]
            for m in self.substitutions:
                lines.append(f"  {m.rule:<20} at {m.root.layer.name!r}: {len(m.embeds)} fields, "
                             f"partial width {self.widths.get(m.root.layer.name, '?')}")
            lines.append(f"  one fused allreduce of {self.floats_per_sample} floats per sample "
                         f"= {self.payload_bytes(1)} bytes/sample; at B=4096: "
                         f"{self.payload_bytes(4096):,} bytes handed over, "
                         f"{self.ring_bytes(4096):,.0f} sent per process (ring)")
        lines += [str(c) for c in self.costs]
        for r in self.rejections:
            lines.append(f"  not substituted: {r}")
        if self.plan is not None:
            lines.append(str(self.plan))
        return "\n".join(lines)


def find_substitutions(graph: Graph) -> tuple[list[Match], list[Rejection]]:
    """Run every rule at every node (outputs first), then drop unsafe matches."""
    matches, rejections, claimed = [], [], set()
    for node in reversed(graph.nodes):
        if node.index in claimed or node.kind == "input":
            continue
        for rule in RULES:
            found = rule.match(graph, node)
            if isinstance(found, Match):
                matches.append(found)
                claimed |= found.internal
                break
            if isinstance(found, Rejection):
                rejections.append(found)
                break
    return _drop_unsafe(graph, matches, rejections)


def _drop_unsafe(graph, matches, rejections):
    while True:
        inside = set().union(*(m.internal for m in matches)) if matches else set()
        bad = None
        for m in matches:
            for idx in m.internal - {m.root.index}:
                for t in graph.nodes[idx].outputs:
                    users = [u for u in graph.consumers.get(t, []) if u.index not in m.internal]
                    if users or t in graph.output_ids:
                        who = users[0].layer.name if users else "the model output"
                        bad = (m, f"intermediate {graph.nodes[idx].layer.name!r} is also used by {who!r}")
            for e in m.embeds:
                users = [u for u in graph.consumers.get(e.output, []) if u.index not in inside]
                if users or e.output in graph.output_ids:
                    who = users[0].layer.name if users else "the model output"
                    bad = (m, f"embedding of field {e.attrs['field']!r} is also used by {who!r}, "
                              f"which is not substituted")
            if bad:
                break
        if bad is None:
            return matches, rejections
        m, reason = bad
        matches = [x for x in matches if x is not m]
        rejections.append(Rejection(m.rule, m.root, reason))


def _field_costs(graph: Graph, matches: list[Match], spec=None) -> list[FieldCost]:
    width: dict[str, int] = {}
    size: dict[str, float] = {}
    lookups: dict[str, float] = {}
    seen = set()
    for m in matches:
        for e in m.embeds:
            f = e.attrs["field"]
            if e.layer.name in seen:
                continue
            seen.add(e.layer.name)
            width[f] = width.get(f, 0) + e.attrs["dim"]
            size[f] = max(size.get(f, 0.0), float(e.layer.params.size().numpy()))
            shape = graph.shape(e.tensor_operands()[0])
            lookups[f] = float(shape[1]) if shape.rank == 2 and shape[1] else 1.0
    out = []
    for f in width:
        rows = None
        if spec is not None:
            try:
                rows = spec[f].cardinality
            except KeyError:
                rows = None
        out.append(FieldCost(f, float(rows or size[f] or 1.0), width[f], lookups[f]))
    return out


def transform(model: tf.keras.Model, comm: Communicator | None = None, plan: str | FieldPlan = "balanced",
              spec=None, release_unowned: bool = True) -> tuple[tf.keras.Model, Report]:
    """Return (DES model for this process, report). ``plan``: 'balanced', 'mod' or a FieldPlan.

    ``spec`` (a FeatureSpec) gives expected cardinalities to the balanced plan.
    Rows of tables this process does not own are released when ``release_unowned``.
    """
    comm = comm or default_communicator()
    graph = Graph(model)
    matches, rejections = find_substitutions(graph)
    if not matches:
        return model, Report([], rejections, None, comm.rank, comm.world_size)
    costs = _field_costs(graph, matches, spec)
    if isinstance(plan, FieldPlan):
        missing = {c.name for c in costs} - set(plan.owner)
        if plan.world_size != comm.world_size or missing:
            raise ValueError(f"the given plan is for {plan.world_size} processes and lacks fields "
                             f"{sorted(missing)}; this world has {comm.world_size}")
        field_plan = plan
    else:
        field_plan = make_plan(costs, comm.world_size, plan)
    mine = set(field_plan.fields_of(comm.rank))

    tables, table_inputs, ops, widths = {}, {}, [], {}
    for m in matches:
        owned = [e for e in m.embeds if e.attrs["field"] in mine]
        for e in owned:
            tables[e.layer.name] = e.layer
            table_inputs[e.layer.name] = [graph.input_name(t) for t in e.tensor_operands()]
        ops.append(_sub_operator(graph, m, owned))
        widths[m.root.layer.name] = ops[-1].width
    if release_unowned:
        for m in matches:
            for e in m.embeds:
                if e.attrs["field"] not in mine and int(e.layer.params.size()) > 0:
                    e.layer.params.clear()

    first = DESFirstLayer(tables, table_inputs, ops, comm, name="des_first_layer")
    names_in = sorted({graph.input_name(t) for m in matches for e in m.embeds for t in e.tensor_operands()})
    outs = first({n: graph.tensors[_input_id(graph, n)] for n in names_in})
    skip = set().union(*(m.internal for m in matches)) | {e.index for m in matches for e in m.embeds}
    new_model = replay(graph, skip, {m.root.output: o for m, o in zip(matches, outs)})
    new_model.des_layer = first
    new_model.des_plan = field_plan
    report = Report(matches, rejections, field_plan, comm.rank, comm.world_size,
                    first.floats_per_sample(), widths)
    return new_model, report


def _input_id(graph: Graph, name: str) -> int:
    for t in graph.input_ids:
        if graph.input_name(t) == name:
            return t
    raise KeyError(name)


def _sub_operator(graph: Graph, m: Match, owned):
    names = [e.layer.name for e in owned]
    fields = [e.attrs["field"] for e in owned]
    out_shape = tuple(graph.shape(m.root.output)[1:])
    tag = f"des_{m.rule}_{m.root.layer.name}"
    if m.rule == "lr_sum":
        return LinearSum(names, out_shape, fields, source=m.root.layer.name, name=tag)
    if m.rule == "fm_interaction":
        return FMInteraction(names, out_shape, fields, k=m.embeds[0].attrs["dim"],
                             source=m.root.layer.name, name=tag)
    if m.rule == "embed_concat_dense":
        dense = m.root.layer
        kernel = dense.kernel.numpy()
        offsets = np.cumsum([0] + [e.attrs["dim"] for e in m.embeds])
        rows = [np.arange(offsets[i], offsets[i + 1]) for i, e in enumerate(m.embeds) if e in owned]
        block = kernel[np.concatenate(rows)] if rows else np.zeros((0, kernel.shape[1]), np.float32)
        bias = dense.bias.numpy() if dense.use_bias else None
        return DenseBlock(names, out_shape, block, bias, dense.activation, fields=fields,
                          source=dense.name, name=tag)
    raise ValueError(f"no sub-operator for rule {m.rule!r}")

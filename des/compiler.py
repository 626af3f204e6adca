"""des.transform: find the weights-rich first layers of a Keras model and substitute them.

    >>> import des
    >>> from models import deepfm
    >>> from des.data import FeatureSpec, Field
    >>> spec = FeatureSpec((Field("C1", dim=4), Field("C2", dim=4)))
    >>> model, report = des.transform(deepfm(spec, hidden=(8,)))          # world from Horovod under mpirun
    >>> print(report)
    des.transform: 3 substitution(s), rank 0 of 1:
    ...
    >>> des.distributed(model).layer.floats_per_sample()          # the partials' width: 1 (LR) + 4+1 (FM) + 8 (Dense)
    14

Steps: IR of the functional graph (des.ir: one canonical graph whatever the spelling) ->
field vectors and layouts (des.fields) -> every registered rule tried at every node ->
safety checks (no intermediate used outside its match; every table of a substituted field
used only by substituted operators) -> every process takes rank 0's weights -> field plan
-> one DESFirstLayer with this process's tables, their chains and the sub-operators -> the
rest of the graph replayed on top of it, with the same layer objects (so trained weights of
the replicated tail are kept).
"""
from __future__ import annotations

import dataclasses
import os

import tensorflow as tf

from des import saving, state
from des.cost import AutoTail, choose_first_dense, choose_tail, estimate
from des.fields import GLUE, FieldAnalysis, FieldVector
from des.handle import Distributed, attach, distributed
from des.ir import Graph, Node, call_node, is_keras_tensor, replay, trace_used
from des.plan import FieldCost, FieldPlan, check_agreement, make_plan
from des.sources import source_of
from des_ops.comm import WIRE_DTYPES, Communicator, agree, default_communicator
from des_ops.fused import fuse_nodes
from des_ops.keras_internals import (autograph_as_keras_decides, compile_args, has_weight_penalties, input_spec_of,
                                     take_weight_penalties)
from des_ops.suboperators import DESFirstLayer
from des_ops.rows import bytes_per_step as rows_bytes_per_step
from des_ops.tail import GatherRows, ShardRows, count_tail_penalties_once, sum_tail_gradients, tail_obstacles
from des_ops.wire import ring_share
from rewrite_rules import RULES, Match, Rejection, find_substitutions, rule_named

TAILS = ("replicated", "data_parallel", "auto")
FIRST_DENSE = ("partials", "rows", "auto")


class TransformError(ValueError):
    """des.transform(..., strict=True) could not substitute every table; the message is the report."""

    def __init__(self, report: "Report"):
        super().__init__(f"des.transform(strict=True): not everything could be substituted\n{report}")


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
    tables: list[str] = dataclasses.field(default_factory=list)      # one line per table
    unsubstituted: list[str] = dataclasses.field(default_factory=list)   # names of tables left as they were
    penalty_column: bool = False
    compiled: str = ""                # what became of the model's compile (a report line), if it was compiled
    opaque: list[str] = dataclasses.field(default_factory=list)   # subclassed models inside: why they were not read
    tail: str = "replicated"          # how the layers after the first one run (des_ops.tail)
    tail_reason: str = ""             # tail="auto": what des.cost.choose_tail weighed
    collectives: int = 1              # fused allreduces per step (one per tower when towers were transformed)
    micro_batches: int = 1            # slices of the batch, each with its own allreduce (DESFirstLayer)
    wire_dtype: str = "float32"       # the partials' type on the wire ("float16": half the bytes, not exact)
    by_rows: dict = dataclasses.field(default_factory=dict)   # first Dense layers by moving rows: name -> (widths, units)
    first_dense_reason: str = ""      # first_dense="auto": what des.cost.choose_first_dense weighed

    @property
    def bytes_per_float(self) -> int:
        """Bytes of one partial on the wire: 4 (float32), 2 (float16)."""
        return tf.as_dtype(self.wire_dtype).size

    def estimate_costs(self, batch_size: int, unique_per_slice: dict[str, float]) -> list:
        """DES vs PS bytes per operator (des.cost); kept for printing with the report."""
        self.costs = estimate(self, batch_size, unique_per_slice)
        return self.costs

    @property
    def changed(self) -> bool:
        return bool(self.substitutions)

    def payload_bytes(self, batch_size: int) -> int:
        """Bytes handed to the fused allreduce(s) per step (float32 partials, or 16-bit ones), and
        to the forward collectives of a first Dense by rows (des_ops.rows)."""
        return self.bytes_per_float * batch_size * self.floats_per_sample + sum(
            rows_bytes_per_step(batch_size, widths, units, self.rank)[0] for widths, units in self.by_rows.values())

    def ring_bytes(self, batch_size: int) -> float:
        """Analytic bytes sent per process per step by a ring allreduce: 2(N-1)/N * payload."""
        n = self.world_size
        return ring_share(n) * self.payload_bytes(batch_size)

    def __str__(self) -> str:
        if not self.substitutions:
            lines = ["des.transform: nothing to substitute; the model is returned unchanged."]
        else:
            lines = [f"des.transform: {len(self.substitutions)} substitution(s), rank {self.rank} "
                     f"of {self.world_size}:"]
            for m in self.substitutions:
                lines.append(f"  {m.rule:<20} at {m.root.layer.name!r}: {len(m.vectors)} field vectors, "
                             f"partial width {self.widths.get(m.root.layer.name, '?')}"
                             + (f", {len(m.others)} replicated input(s)" if m.others else ""))
            if self.penalty_column:
                lines.append("  + 1 float per sample for the weight penalties (regularizers) of owned tables "
                             "and kernel rows, so every process reports the whole loss")
            lines.append((f"  {self.collectives} allreduces (one per tower) of {self.floats_per_sample} floats per "
                          f"sample in all " if self.collectives > 1 else
                          f"  one fused allreduce of {self.floats_per_sample} floats per sample ")
                         + f"= {self.payload_bytes(1)} bytes/sample; at B=4096: "
                         f"{self.payload_bytes(4096):,} bytes handed over, "
                         f"{self.ring_bytes(4096):,.0f} sent per process (ring)")
            if self.micro_batches > 1:
                lines.append(f"  in {self.micro_batches} slices of the batch, one allreduce each (a slice's sum "
                             f"travels while the next slice's partials are computed; the same results)")
            if self.wire_dtype != "float32":
                lines.append(f"  partials on the wire in {self.wire_dtype} and summed in {self.wire_dtype} by the "
                             f"collective: half the bytes, NOT exact (float32 is)")
            if self.tail == "data_parallel":
                lines.append("  data-parallel tail: the partials are reduce-scattered, each process runs the layers "
                             "after the first one on its B/N rows, the outputs are all-gathered and the tail's "
                             "gradients summed (one allreduce per step)")
            if self.tail_reason:
                lines.append(f"  tail chosen by the cost model (tail='auto'): {self.tail_reason}")
            for name, (widths, units) in self.by_rows.items():
                lines.append(f"  first Dense {name!r} by moving rows: each process sends the rows of its fields "
                             f"(widths {widths} by rank) to the processes of their samples and multiplies its "
                             f"samples' rows by the all-gathered kernel ({units} units); no partials for it")
            if self.first_dense_reason:
                lines.append(f"  first Dense chosen by the cost model (first_dense='auto'): {self.first_dense_reason}")
        if self.compiled:
            lines.append(f"  {self.compiled}")
        lines += [str(c) for c in self.costs]
        for r in self.rejections:
            lines.append(f"  not substituted: {r}")
        lines += [f"  not read: {o}" for o in self.opaque]
        if self.tables:
            lines.append("tables:")
            lines += [f"  {t}" for t in self.tables]
        if self.plan is not None:
            lines.append(str(self.plan))
        return "\n".join(lines)


def explain_tables(graph: Graph, fields: FieldAnalysis, matches: list[Match],
                   rejections: list[Rejection]) -> tuple[list[str], list[str]]:
    """One line per table: where it was substituted, or why not. Returns (lines, unsubstituted names)."""
    used: dict[int, list[str]] = {}
    for m in matches:
        for v in m.vectors:
            used.setdefault(v.table.index, []).append(f"{m.rule} at {m.root.layer.name!r}")
    lines, left, groups = [], [], {}
    for n in graph.nodes:
        if n.kind != "table":
            continue
        src = n.attrs["source"]
        head = f"{n.layer.name} ({src.name}, width {n.attrs['dim']}, field {fields.ids_input(n)!r})"
        if n.index in used:
            groups.setdefault((src.name, n.attrs["dim"], "substituted in " + ", ".join(used[n.index])), []).append(head)
            continue
        if n.layer.name not in left:
            left.append(n.layer.name)
            groups.setdefault((src.name, n.attrs["dim"], "NOT substituted: " + _why_table(graph, fields, n, rejections)),
                              []).append(head)
    lines = []
    for (src, dim, what), heads in groups.items():     # alike: one line per group
        if len(heads) <= 3:
            lines += [f"{h}: {what}" for h in heads]
        else:
            names = [h.split(" (")[0] for h in heads]
            lines.append(f"{len(heads)} tables ({src}, width {dim}: {', '.join(names[:2])}, ..., {names[-1]}): "
                         f"{what}")
    return lines, left


def _why_table(graph: Graph, fields: FieldAnalysis, table: Node, rejections: list[Rejection]) -> str:
    """Follow the table's output through its own chain and layout glue to the first node
    that is neither; say what it is and why no rule took it."""
    per_field = fields.offset_fields(table)
    if per_field:
        return (f"it holds {per_field} fields as key ranges (its ids are ids + per-field offsets, as in DLRM "
                f"ports): DES partitions by table, so this table would live on one process and partition "
                f"nothing; give each field its own Embedding (one input and one table per field)")
    seen, frontier = set(), [table.output]
    while frontier:
        t = frontier.pop(0)
        for u in graph.consumers.get(t, []):
            if u.index in seen:
                continue
            seen.add(u.index)
            single = all(len(fields.tables(o)) == 1 for o in u.outputs)
            if single or (u.kind in GLUE and fields.layout(u.output) is not None):
                frontier += u.outputs
                continue
            for r in rejections:
                if r.root.index == u.index:
                    return f"reaches {u.layer.name!r}: {r.reason}"
            for r in rejections:
                if u.index in fields.cone(r.root.output):
                    return f"reaches {u.layer.name!r} on the way to {r.root.layer.name!r}: {r.reason}"
            return (f"its field vector reaches {u.layer.name!r} ({u.kind.removeprefix('layer:')}), which mixes "
                    f"{len(fields.tables(u.output))} tables in a way no rule "
                    f"({', '.join(r.name for r in RULES)}) understands")
        if t in graph.output_ids:
            return "its output is a model output"
    return "its output is not used by a substitutable operator"


def _field_costs(graph: Graph, matches: list[Match], spec=None) -> list[FieldCost]:
    width: dict[str, int] = {}
    size: dict[str, float] = {}
    lookups: dict[str, float] = {}
    seen = set()
    for m in matches:
        for v in m.vectors:
            f = v.field
            if id(v.table.layer) in seen:          # a table shared by several fields counts once
                continue
            seen.add(id(v.table.layer))
            width[f] = width.get(f, 0) + v.width
            size[f] = max(size.get(f, 0.0), v.table.attrs["source"].rows(v.table.layer))
            ops = v.table.tensor_operands()
            shape = graph.shape(ops[0]) if ops else tf.TensorShape([None])
            n = 1.0
            for d in shape[1:]:
                n *= float(d or 1)
            lookups[f] = n
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


class FieldChains:
    """Computes the owned field vectors from the model inputs by calling, once each and in
    topological order, the layers of their chains (preprocessing, lookup, pooling, reshapes).
    The table nodes of a fused group (``fused``: [(FusedTable, its table nodes in call order)])
    are computed together, by one call of their fused table, when the first of them is reached."""

    def __init__(self, graph: Graph, nodes: list[Node], wanted: list[int], fused: list[tuple] = ()):
        self.nodes = sorted(nodes, key=lambda n: n.index)
        self.wanted = list(wanted)
        self.inputs = {t: graph.input_name(t) for t in graph.input_ids}
        self.fused = list(fused)
        self.group_of = {n.index: k for k, (_, members) in enumerate(self.fused) for n in members}
        self.producer = {t: n for n in self.nodes for t in n.outputs}

    def __call__(self, inputs: dict) -> dict:
        env = {t: inputs[name] for t, name in self.inputs.items() if name in inputs}

        def look(x):
            if not is_keras_tensor(x):
                return x
            if id(x) not in env:                     # a fused group reads ahead of the topological order
                run(self.producer[id(x)])
            return env[id(x)]

        def run(node: Node) -> None:
            if node.index in self.group_of:
                table, members = self.fused[self.group_of[node.index]]
                outs = table([tf.nest.map_structure(look, m.call_args[0]) for m in members])
                env.update({m.output: o for m, o in zip(members, outs)})
                return
            with autograph_as_keras_decides():       # the DES layer's call is not converted; users' layers are
                out = call_node(node, look)
            for t, new in zip(node.outputs, tf.nest.flatten(out)):
                env[t] = new

        for node in self.nodes:
            if not all(t in env for t in node.outputs):
                run(node)
        return {t: env[t] for t in self.wanted}


def transform(model: tf.keras.Model, comm: Communicator | None = None, plan: str | FieldPlan = "balanced",
              spec=None, release_unowned: bool = True, strict: bool = False, sync_weights: bool = True,
              seed: int = 0, sample=None, fuse_tables: bool = False, join_linear: bool = False,
              tail: str | AutoTail = "replicated", scope: str = "", micro_batches: int = 1,
              wire_dtype: str = "float32", first_dense: str = "partials",
              costs: AutoTail | None = None) -> tuple[tf.keras.Model, Report]:
    """Return (DES model for this process, report). ``plan``: 'balanced', 'mod' or a FieldPlan.

    ``spec`` (a FeatureSpec) gives expected cardinalities to the balanced plan. Every process
    first takes rank 0's weights and table rows (``sync_weights``); TFRA tables get new rows
    that depend on (table, key, ``seed``) only. Rows of tables this process does not own are
    released when ``release_unowned``. ``strict``: raise TransformError instead of returning a
    model where some table or candidate operator was not substituted. ``fuse_tables``: this
    process keeps the rows of all its tables of one width (and optimizer part) in one TFRA table
    (des_ops.fused): one lookup and one update per width and step instead of one per table; the
    results, the checkpoints and the state keys stay those of the tables the model declares.
    ``join_linear`` (with ``fuse_tables``): a field's linear weight sits in its embedding's row, one
    lookup for both; exact when one optimizer trains both parts (LinearAndRestOptimizer refuses it).
    ``tail``: ``"replicated"`` (every process runs the layers after the first one on the whole
    batch) or ``"data_parallel"`` (each process runs them on its own rows of the batch: the
    partials are reduce-scattered, the outputs all-gathered and the tail's gradients summed by
    the optimizer the model is compiled with; des_ops.tail). Both compute what one process does.
    ``"auto"`` (or a ``des.AutoTail`` giving the batch size, the FLOP rate and the bandwidth):
    the cost model picks one (des.cost.choose_tail) and the report says why. ``micro_batches``
    K > 1: the partials of K slices of the batch are allreduced one by one, each while the next
    is computed (exact); ``wire_dtype="float16"``: the partials travel (and are summed) in 16 bits,
    half the bytes, not exact (des_ops.suboperators.DESFirstLayer). ``first_dense`` (with the
    data-parallel tail): ``"partials"`` (each process multiplies its fields' rows by its kernel rows
    and the [B, units] sums are reduce-scattered) or ``"rows"`` (each process sends its fields' rows
    to the processes of their samples, which multiply them by the all-gathered kernel: fewer bytes
    when the layer is wide; exact; des_ops.rows); ``"auto"``: the cost model picks per layer
    (des.cost.choose_first_dense), and ``tail="auto"`` then weighs the data-parallel tail with it.
    ``costs``: the batch size, FLOP rate, bandwidth and per-collective cost the auto choices
    assume (default: ``tail`` when it is a ``des.AutoTail``, else ``des.AutoTail()``).

    The returned model's ``save`` and ``save_weights`` (and so ModelCheckpoint), called on every
    process, write the model given here with every process's trained weights (des.saving);
    ``des.checkpoint.save(folder, model, model.optimizer)`` keeps its optimizer state too, and
    ``des.export(model, out)`` writes it for serving.

    A subclassed model (a ``tf.keras.Model`` or ``tfrs.models.Model`` with its own ``call``) is
    traced: its ``call`` runs on symbolic inputs shaped like ``sample`` (a batch of its inputs;
    not needed once the model has been called), the functional graph this gives is rewritten,
    and the SAME model object is returned with its forward pass replaced by the rewritten graph,
    so its own ``compute_loss``, ``train_step``, tasks and metrics stay as they are. A model
    without a ``call`` of its own whose ``compute_loss`` calls towers (a TFRS retrieval model:
    ``self.query_model(...)``, ``self.candidate_model(...)``) has each tower that holds tables
    transformed on its own (``scope``: the tower's attribute, in its collective's name) and put
    back in its place.
    """
    comm = comm or default_communicator()
    if not getattr(model, "_is_graph_network", False):
        return _transform_subclassed(model, sample, comm=comm, plan=plan, spec=spec, release_unowned=release_unowned,
                                     strict=strict, sync_weights=sync_weights, seed=seed, fuse_tables=fuse_tables,
                                     join_linear=join_linear, tail=tail, scope=scope, micro_batches=micro_batches,
                                     wire_dtype=wire_dtype, first_dense=first_dense, costs=costs)
    if not isinstance(tail, AutoTail) and tail not in TAILS:
        raise ValueError(f"des.transform: tail={tail!r}; choose from {', '.join(TAILS)}")
    if not isinstance(micro_batches, int) or isinstance(micro_batches, bool) or micro_batches < 1:
        raise ValueError(f"des.transform: micro_batches={micro_batches!r}; a whole number >= 1")
    if first_dense not in FIRST_DENSE:
        raise ValueError(f"des.transform: first_dense={first_dense!r}; choose from {', '.join(FIRST_DENSE)}")
    if first_dense == "rows" and tail != "data_parallel":
        raise ValueError(f"des.transform(first_dense='rows'): needs the data-parallel tail (tail='data_parallel', "
                         f"not {tail!r})")
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"des.transform: wire_dtype={wire_dtype!r}; choose from {', '.join(WIRE_DTYPES)}")
    if wire_dtype not in comm.wire_dtypes:
        raise ValueError(f"des.transform: wire_dtype={wire_dtype!r}: the {comm.name} communicator sums "
                         f"{', '.join(comm.wire_dtypes)} only (use Horovod)")
    graph = Graph(model)
    fields = FieldAnalysis(graph)
    matches, rejections = find_substitutions(graph, fields)
    table_lines, left = explain_tables(graph, fields, matches, rejections)
    report = Report(matches, rejections, None, comm.rank, comm.world_size, tables=table_lines, unsubstituted=left,
                    opaque=_opaque_models(graph))
    if strict and (rejections or left or not matches):
        report.widths = {m.root.layer.name: rule_named(m.rule).sub_operator(m, m.vectors, name=f"probe_{m.rule}").width
                         for m in matches}                  # what would be sent
        report.floats_per_sample = sum(report.widths.values())
        raise TransformError(report)
    if not matches:
        return model, report
    return _substitute(model, graph, fields, matches, report, comm, plan=plan, spec=spec, seed=seed,
                       release_unowned=release_unowned, sync_weights=sync_weights, fuse_tables=fuse_tables,
                       join_linear=join_linear, tail=tail, scope=scope, micro_batches=micro_batches,
                       wire_dtype=wire_dtype, first_dense=first_dense, costs=costs)


def _substitute(model: tf.keras.Model, graph: Graph, fields: FieldAnalysis, matches: list[Match], report: Report,
                comm: Communicator, *, plan, spec, seed: int, release_unowned: bool, sync_weights: bool,
                fuse_tables: bool, join_linear: bool, tail, scope: str, micro_batches: int,
                wire_dtype: str, first_dense: str = "partials",
                costs: AutoTail | None = None) -> tuple[tf.keras.Model, Report]:
    """transform's second half: the same rows everywhere, the field plan, this process's DES
    layer in place of the matches, the model replayed around it (see transform)."""
    for n in graph.nodes:
        if n.kind == "table":
            n.attrs["source"].keyed(n.layer, seed, graph.layer_key(n.layer))
    if sync_weights and comm.world_size > 1:
        state.sync_from_root(graph, comm)
    forced = _forced_disagreement(comm)
    field_plan = _field_plan(graph, matches, spec, plan, comm, forced)
    mine = set(field_plan.fields_of(comm.rank))
    own = _OwnedPart.of(graph, matches, mine)
    released = release_unowned and _release_unowned(matches, mine)

    # the vectors in graph order, never in tensor-id (memory address) order: the order in which the
    # lookups are built decides the order in which TensorFlow adds their gradients, so an address
    # order made the same job give other bits run after run
    position = {t: k for k, t in enumerate(graph.tensors)}
    fused, fused_lines = (fuse_nodes(graph, list(own.nodes.values()), f"rank{comm.rank}", join_linear)
                          if fuse_tables else ([], []))
    chains = FieldChains(graph, list(own.nodes.values()),
                         sorted({t for ids in own.op_inputs for t in ids}, key=position.__getitem__), fused)
    skip = set()
    for m in matches:
        skip |= m.internal
        for v in m.vectors:
            skip |= v.chain
    costs = costs or (tail if isinstance(tail, AutoTail) else AutoTail())
    dense_shapes = [(sum(v.width for v in m.vectors), int(m.data["kernel"].shape[1])) for m in matches
                    if "parts" in m.data] if first_dense == "auto" else []
    tail, tail_reason = _tail_choice(graph, model, skip, costs if tail == "auto" or isinstance(tail, AutoTail) else tail,
                                     comm, dense_shapes)
    if tail == "data_parallel" and (micro_batches > 1 or wire_dtype != "float32"):
        raise ValueError("des.transform: micro_batches and a 16-bit wire_dtype are for the replicated tail; the "
                         "data-parallel tail reduce-scatters the whole batch in float32")
    report.by_rows, report.first_dense_reason = _by_rows(matches, own, field_plan, comm, tail, first_dense, costs)
    first = _first_layer(chains, fused, own, comm, tail, scope, forced, micro_batches, wire_dtype)
    names_in = sorted({graph.nodes[i].layer.name for m in matches for v in m.vectors for i in v.chain | fields.cone(v.tensor)
                       if graph.nodes[i].kind == "input"})
    outs = first({n: graph.tensors[_input_id(graph, n)] for n in names_in})
    given = {m.root.output: _finisher(graph, m, o) for m, o in zip(matches, outs)}
    new_model, tail_variables = _replay(graph, skip, given, model, comm, first, tail == "data_parallel")
    attach(new_model, Distributed(first, field_plan, state.StateKeys.of_transform(
        graph, matches, first, [m.layer for _, members in fused for m in members]), tail, tail_variables,
        source=model))
    saving.install(new_model)
    report.tables += fused_lines
    report.plan, report.floats_per_sample, report.widths = field_plan, first.floats_per_sample(), own.widths
    report.penalty_column = own.penalty_column
    report.tail, report.tail_reason = tail, tail_reason
    report.micro_batches, report.wire_dtype = micro_batches, wire_dtype
    state.trace_once(new_model)
    report.compiled = _compile_like(model, new_model)
    if released:
        _mark_consumed(model)
    return new_model, report


def _field_plan(graph: Graph, matches: list[Match], spec, plan: str | FieldPlan, comm: Communicator,
                forced: str | None) -> FieldPlan:
    """The field plan (given, or made from the fields' costs), checked to be the same on every process."""
    costs = _field_costs(graph, matches, spec)
    if isinstance(plan, FieldPlan):
        missing = {c.name for c in costs} - set(plan.owner)
        if plan.world_size != comm.world_size or missing:
            raise ValueError(f"the given plan is for {plan.world_size} processes and lacks fields "
                             f"{sorted(missing)}; this world has {comm.world_size}")
        field_plan = plan
    else:
        field_plan = make_plan(costs, comm.world_size, plan)
    if forced == "plan":
        moved = next(iter(field_plan.owner))
        field_plan = dataclasses.replace(field_plan, owner={**field_plan.owner,
                                                           moved: (field_plan.owner[moved] + 1) % comm.world_size})
    if comm.world_size > 1:
        check_agreement(field_plan, comm)
    return field_plan


@dataclasses.dataclass
class _OwnedPart:
    """This process's share of the substitutions: a sub-operator per match over its own field
    vectors, the nodes of their chains, and its share of the weight penalties."""
    ops: list
    op_inputs: list
    widths: dict
    nodes: dict
    penalty_column: bool
    penalties: list

    @classmethod
    def of(cls, graph: Graph, matches: list[Match], mine: set[str]) -> "_OwnedPart":
        nodes: dict[int, Node] = {}
        ops, op_inputs, widths = [], [], {}
        for m in matches:
            owned = [v for v in m.vectors if v.field in mine]
            for v in owned:
                nodes.update({i: graph.nodes[i] for i in v.chain})
            ops.append(rule_named(m.rule).sub_operator(m, owned, name=f"des_{m.rule}_{m.root.layer.name}"))
            op_inputs.append([v.tensor for v in owned])
            widths[m.root.layer.name] = ops[-1].width
        chain_layers = {id(graph.nodes[i].layer): graph.nodes[i].layer for m in matches for v in m.vectors
                        for i in v.chain}
        penalty_column = any(has_weight_penalties(l) for l in chain_layers.values()) or \
            any(m.data.get("kernel_regularizer") is not None for m in matches)
        penalties = []
        for i in sorted(nodes):
            penalties += take_weight_penalties(nodes[i].layer)
        return cls(ops, op_inputs, widths, nodes, penalty_column, penalties)


def _release_unowned(matches: list[Match], mine: set[str]) -> bool:
    """Drop the rows of the tables this process does not own; True if any was dropped."""
    released = False
    for m in matches:
        for v in m.vectors:
            if v.field not in mine:
                v.table.attrs["source"].release(v.table.layer)
                released = True
    return released


def _tail_choice(graph: Graph, model: tf.keras.Model, skip: set[int], tail: str | AutoTail,
                 comm: Communicator, dense_shapes: list[tuple[int, int]] = ()) -> tuple[str, str]:
    """("replicated" or "data_parallel", why): the asked tail, or the cost model's choice for an
    AutoTail (``dense_shapes``: first Dense layers that may go by rows, des.cost.choose_tail)."""
    if tail == "replicated":
        return tail, ""
    tail_nodes = [n for n in graph.nodes if n.index not in skip and n.kind != "input"]
    tail_layers = list(dict.fromkeys(n.layer for n in tail_nodes))
    obstacles = tail_obstacles(tail_layers, sorted({n.layer.name for n in tail_nodes if n.kind == "table"}), comm)
    if tail != "data_parallel":
        return choose_tail(
            sum(int(l.kernel.shape.num_elements()) for l in tail_layers if isinstance(l, tf.keras.layers.Dense)),
            sum(int(w.shape.num_elements()) for l in tail_layers for w in l.trainable_weights),
            sum(int(t.shape[-1] or 1) for t in model.outputs), comm.world_size,
            tail if isinstance(tail, AutoTail) else AutoTail(), obstacles, dense_shapes)
    if obstacles:
        raise ValueError("des.transform(tail='data_parallel'): the tail cannot run data-parallel: "
                         + "; ".join(obstacles))
    return tail, ""


def _by_rows(matches: list[Match], own: _OwnedPart, field_plan: FieldPlan, comm: Communicator, tail: str,
             first_dense: str, costs: AutoTail) -> tuple[dict, str]:
    """Which first Dense layers go by moving rows ({layer name: (widths by rank, units)}), and
    why when the cost model chose; marks their sub-operators (des_ops.rows). ``first_dense="rows"``
    comes with the data-parallel tail (transform checks it); "auto" with the replicated tail keeps
    partials, as every process needs the whole batch's output."""
    dense = [(m, op) for m, op in zip(matches, own.ops) if "parts" in m.data]
    if first_dense == "partials" or not dense or tail != "data_parallel":
        return {}, ""
    out, reasons = {}, []
    for m, op in dense:
        widths = [sum(v.width for v in m.vectors if field_plan.owner[v.field] == r) for r in range(comm.world_size)]
        units = int(m.data["kernel"].shape[1])
        if first_dense == "auto":
            choice, why = choose_first_dense(costs.batch_size, sum(widths), units, comm.world_size, costs)
            reasons.append(f"{m.root.layer.name!r}: {why}")
            if choice != "rows":
                continue
        op.exchange, op.rank_widths = "rows", widths
        out[m.root.layer.name] = (widths, units)
    return out, "; ".join(reasons)


def _first_layer(chains, fused: list, own: _OwnedPart, comm: Communicator, tail: str, scope: str,
                 forced: str | None, micro_batches: int = 1, wire_dtype: str = "float32") -> DESFirstLayer:
    """The DES layer of this process, its collective's schedule agreed with every process."""
    in_fused = {id(m.layer) for _, members in fused for m in members}
    layers = [l for l in dict.fromkeys(n.layer for n in chains.nodes) if id(l) not in in_fused]
    layers += [table for table, _ in fused]
    first = DESFirstLayer(layers, chains, own.ops, own.op_inputs, comm, own.penalties, own.penalty_column,
                          shard_rows=tail == "data_parallel", scope=scope, micro_batches=micro_batches,
                          wire_dtype=wire_dtype, name="des_first_layer")
    if forced == "collective":
        first.collective += "_forced_by_DES_TEST_DISAGREE"        # and no check: Horovod's stall shutdown must end it
    elif comm.world_size > 1:
        agree(comm, "collective schedule (one fused allreduce: its name and floats per sample)",
              f"{first.collective}: {first.floats_per_sample()}, {tail} tail"
              + (f", {micro_batches} micro-batches" if micro_batches > 1 else ""))
    return first


def _replay(graph: Graph, skip: set[int], given: dict, model: tf.keras.Model, comm: Communicator,
            first: DESFirstLayer, data_parallel: bool) -> tuple[tf.keras.Model, list]:
    """The DES model: the graph replayed with the substituted outputs ``given``; with the
    data-parallel tail, each process's rows in and the outputs gathered (and the variables whose
    gradients the tail sums)."""
    if not data_parallel:
        return replay(graph, skip, given, cls=_model_class(model)), []
    new_model = replay(graph, skip, given, cls=_model_class(model),
                       input_map=lambda t: ShardRows(comm, name=f"des_rows_{t.name.split(':')[0]}")(t),
                       output_map=lambda t, i: GatherRows(comm, f"des_tail_output{i}",
                                                          name=f"des_gather_output{i}")(t))
    count_tail_penalties_once([l for l in new_model.submodules
                               if isinstance(l, tf.keras.layers.Layer) and l is not first], comm.rank)
    owned = {v.ref() for v in first.trainable_weights}
    tail_variables = [v for v in new_model.trainable_variables if v.ref() not in owned]
    if comm.world_size > 1:
        agree(comm, "the data-parallel tail's gradients (variables: floats)",
              f"{len(tail_variables)}: {sum(int(v.shape.num_elements()) for v in tail_variables)}")
    sum_tail_gradients(new_model, comm, tail_variables)
    return new_model, tail_variables


def _compile_like(model: tf.keras.Model, new_model: tf.keras.Model) -> str:
    """Compile ``new_model`` as ``model`` was (loss, metrics, a fresh optimizer of the same
    configuration: the old one's slots belong to the old variables). Returns a report line."""
    args = compile_args(model)
    if args is None:
        return ""
    opt = args["optimizer"]
    try:
        args["optimizer"] = type(opt).from_config(opt.get_config())
    except Exception as e:  # noqa: BLE001 - an optimizer class of the user's without from_config
        return (f"the model was compiled, the returned one is NOT ({type(opt).__name__} could not be copied: {e}); "
                f"compile it before fit")
    new_model.compile(**args)
    return (f"compiled as the model was: loss, metrics and a new {type(opt).__name__} with the same configuration "
            f"(its slots start empty)")


def _mark_consumed(model: tf.keras.Model) -> None:
    """The transformed model shares its layers with the returned one, and this process released
    the tables it does not own: calling it again says so instead of failing deep inside a layer.
    (On one process nothing is released and the model still computes what it did.)"""
    def consumed(*args, **kwargs):
        raise RuntimeError(f"model {model.name!r} was consumed by des.transform (its layers now belong to the "
                           f"returned model, and this process dropped the tables it does not own): use the model "
                           f"des.transform returned")
    model.call = consumed


def _transform_subclassed(model: tf.keras.Model, sample, comm: Communicator, strict: bool, input_prefix: str = "input",
                          **kwargs):
    """des.transform of a subclassed model (or of a tower, traced like one): see transform's
    docstring. ``input_prefix`` names the traced inputs that are not keys of a dict."""
    traced, why = trace_call(model, sample, input_prefix)
    if traced is None and type(model).call is tf.keras.Model.call:
        towers = _towers(model)
        if towers:
            return _transform_towers(model, towers, sample, comm=comm, strict=strict, **kwargs)
    if traced is None:
        report = Report([], [], None, comm.rank, comm.world_size, opaque=[why])
        if strict:
            raise TransformError(report)
        return model, report
    rewritten, report = transform(traced, comm=comm, strict=strict, **kwargs)
    if not report.changed:
        return model, report
    model.des_forward = rewritten                   # tracked: its DES layer's weights are the model's
    for m in report.substitutions:                  # the user's object still holds the substituted Dense:
        if type(m.root.layer) is tf.keras.layers.Dense:    # its kernel is split into the owners' blocks, its
            m.root.layer.trainable = False          # bias lives on in the DES tail: nothing to train there

    def call(inputs, training=None, **_):
        return rewritten(inputs, training=training)
    model.call = call
    handle = distributed(rewritten)
    attach(model, handle)                           # the same handle: plan, DES layer, state keys, tail
    frozen = [m.root.layer for m in report.substitutions if type(m.root.layer) is tf.keras.layers.Dense]
    handle.written = lambda: saving.as_written(model, frozen)       # a save writes the user's own class
    saving.install(model)
    if handle.tail == "data_parallel":
        sum_tail_gradients(model, comm, handle.tail_variables)     # the user compiles this model
    return model, report


def _towers(model: tf.keras.Model) -> dict[str, tf.keras.Model]:
    """The model's direct attributes that are Keras models holding tables, in tracking order
    (the same on every process)."""
    out = {}
    for attr, value in vars(model).items():
        if attr.startswith("_") or not isinstance(value, tf.keras.Model):
            continue
        if any(isinstance(m, tf.keras.layers.Layer) and source_of(m) for m in value.submodules):
            out[attr] = value
    return dict(sorted(out.items()))


def _transform_towers(model: tf.keras.Model, towers: dict, sample, comm: Communicator, strict: bool,
                      tail="replicated", scope: str = "", **kwargs):
    """des.transform of a model whose compute_loss calls towers (TFRS retrieval): each tower on
    its own, its DES layer's collective named by the tower's attribute; one report."""
    if tail == "data_parallel":          # "auto" picks replicated here
        raise ValueError(f"des.transform: {model.name!r} calls its towers in compute_loss; only tail='replicated' "
                         f"is supported there (each tower's outputs are already the whole batch's)")
    unbuilt = [a for a, t in towers.items() if input_spec_of(t) is None]
    if unbuilt and sample is not None and hasattr(model, "compute_loss"):
        model.compute_loss(dict(sample) if isinstance(sample, dict) else sample, training=False)  # builds the towers
        for m in model.metrics:
            m.reset_state()
        unbuilt = [a for a, t in towers.items() if input_spec_of(t) is None]
    if unbuilt:
        report = Report([], [], None, comm.rank, comm.world_size, opaque=[
            f"{model.name!r} ({type(model).__name__}): its towers {unbuilt} have not been called yet, so their input "
            f"shapes are unknown: pass sample=<a batch of the features compute_loss reads> to des.transform"])
        if strict:
            raise TransformError(report)
        return model, report
    reports = {}
    for attr, tower in towers.items():      # traced: inputs named by the attribute, the same on every process
        kwargs.update(comm=comm, strict=strict, scope=f"{scope}{attr}")
        if getattr(tower, "_is_graph_network", False):      # Sequential / functional: put the DES model in its place
            traced, why = trace_call(tower, None, attr)
            new, reports[attr] = transform(traced, **kwargs) if traced is not None else \
                (tower, Report([], [], None, comm.rank, comm.world_size, opaque=[why]))
            if reports[attr].changed:
                setattr(model, attr, new)
        else:                                               # subclassed: the same object, its call replaced
            _, reports[attr] = _transform_subclassed(tower, None, input_prefix=attr, **kwargs)
    changed = [r for r in reports.values() if r.changed]
    report = Report([m for r in changed for m in r.substitutions], [x for r in reports.values() for x in r.rejections],
                    None, comm.rank, comm.world_size,
                    tables=[f"{attr}: {line}" for attr, r in reports.items() for line in r.tables],
                    unsubstituted=[t for r in reports.values() for t in r.unsubstituted],
                    opaque=[o for r in reports.values() for o in r.opaque])
    if changed:
        saving.refuse(model, f"{model.name!r}: des.transform rewrote its towers one by one "
                             f"({', '.join(a for a, r in reports.items() if r.changed)}): the whole model does not save yet; "
                             f"save each tower (model.<tower>.save(path), on every process)")
        report.floats_per_sample = sum(r.floats_per_sample for r in changed)
        report.collectives = len(changed)
        report.widths = {k: w for r in changed for k, w in r.widths.items()}
        report.compiled = f"towers transformed one by one: {', '.join(a for a, r in reports.items() if r.changed)}"
    return model, report


def trace_call(model: tf.keras.Model, sample=None, input_prefix: str = "input") -> tuple[tf.keras.Model | None, str]:
    """A functional model of ``model.call`` on symbolic inputs (those ``call`` reads), sharing
    ``model``'s layers, or (None, why not). Inputs that are not keys of a dict are named
    ``input_prefix`` (one) or ``input_prefix_<i>``: the same on every process."""
    name = f"{model.name!r} ({type(model).__name__}, subclassed)"
    spec = input_spec_of(model, sample)
    if spec is None:
        return None, (f"{name}: its input shapes are unknown: pass sample=<a batch of its inputs> to des.transform, "
                      f"or call the model once on a batch first")
    try:
        traced = trace_used(model, spec, input_prefix)
    except Exception as e:  # noqa: BLE001 - any failure of the user's call is a reason, not a traceback
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return None, (f"{name}: its call() could not be traced on symbolic inputs ({type(e).__name__}: {first}); "
                      f"write it with TensorFlow ops (tf.cond, tf.where) instead of Python control flow on "
                      f"tensor values, and keep its state in layers")
    return traced, ""


def _opaque_models(graph: Graph) -> list[str]:
    """Subclassed models called as layers that hold tables and whose call() did not trace."""
    out = []
    for n in graph.nodes:
        layer = n.layer
        if isinstance(layer, tf.keras.Model) and not getattr(layer, "_is_graph_network", False):
            tables = [m.name for m in layer.submodules if isinstance(m, tf.keras.layers.Layer) and source_of(m)]
            if tables:
                out.append(f"{layer.name!r} is a subclassed {type(layer).__name__} whose call() DES cannot trace, "
                           f"so its tables ({', '.join(tables[:4])}{', ...' if len(tables) > 4 else ''}) stay "
                           f"inside it; write its call() with TensorFlow ops (tf.cond, tf.where) instead of Python "
                           f"control flow on tensor values, or build it functionally")
    return out


def _forced_disagreement(comm: Communicator) -> str | None:
    """Test hook: with DES_TEST_DISAGREE=plan:R (or collective:R), rank R makes its field plan
    (or its allreduce's name) differ from the other ranks', to show that the job ends."""
    kind, _, rank = os.environ.get("DES_TEST_DISAGREE", "").partition(":")
    return kind if rank.isdigit() and int(rank) == comm.rank and kind in ("plan", "collective") else None


def _model_class(model: tf.keras.Model) -> type:
    """The user's functional Model subclass (its own train_step, test_step...) if it is one."""
    cls = type(model)
    if cls.__name__ in ("Functional", "Sequential") or cls is tf.keras.Model:
        return tf.keras.Model
    return cls


def _finisher(graph: Graph, m: Match, combined):
    rule = rule_named(m.rule)
    return lambda look: rule.finish(m, combined, lambda t: look(graph.tensors[t]))


def _input_id(graph: Graph, name: str) -> int:
    for t in graph.input_ids:
        if graph.input_name(t) == name:
            return t
    raise KeyError(name)


__all__ = ["transform", "find_substitutions", "Report", "TransformError", "FieldVector"]

"""des.transform of a functional model: the substitutions found by the rules, every process
given rank 0's weights, the field plan, this process's DES layer (des_ops.suboperators) in
place of the matches, and the rest of the graph replayed on top of it with the same layer
objects; the tail (replicated or data-parallel) and the first Dense (partials or rows) as
des.Options asks or the cost model picks."""
from __future__ import annotations

import dataclasses
import os

import numpy as np
import tensorflow as tf

from des.compiler.big_tables import masks_its_ids, split_big_fields, striped_tables
from des.compiler.keys import StateKeys, sync_from_root, trace_once
from des.compiler.choices import (by_rows, by_samples, costs_for, dense_shapes, exchanged_keys, first_layer_choice,
                                  tail_choice)
from des.compiler.cost import AutoTail
from des.graph.fields import FieldAnalysis
from des.compiler.handle import Distributed, attach
from des.graph.ir import Graph, Node, call_node, is_keras_tensor, replay
from des.compiler.exchange import FieldTraffic, exchange_lines
from des.compiler.plan import FieldCost, FieldPlan, check_agreement, make_plan
from des.graph.sources import source_of
from des_ops.comm import Communicator, agree
from des_ops.fused import fuse_nodes, fusion_groups, linear_part, linear_partners, width_of
from des_ops.ranges import RangeEmbedding, rows_of
from des_ops.stripes import Deferred, MaskedStripe, StripeEmbedding, StripeLookup, StripeMember, keep_own_rows
from des_ops.keras_internals import (autograph_as_keras_decides, compile_args, copy_optimizer, has_weight_penalties,
                                     take_weight_penalties)
from des_ops.suboperators import DESFirstLayer
from des_ops.tail import GatherRows, ShardRows, count_tail_penalties_once, sum_tail_gradients
from models.spec import PAD_ID
from rewrite_rules import Match, find_substitutions, rule_named

from des.compiler.options import Options
from des.compiler.report import Report, TransformError, explain_tables






def _field_costs(graph: Graph, matches: list[Match], spec=None,
                 distinct: dict | None = None) -> tuple[list[FieldCost], list[str]]:
    """Each field's cost for the balanced plan: its rows (the spec's cardinality, else its tables'
    rows, or a TFRA table's ``init_capacity`` if more; a TFRA table starts empty, so without one its
    distinct ids in the ``distinct`` sample batch when given: the rows it trains each step and sends
    by rows, a proxy for the rows it will hold),
    width and ids per sample. Also the fields none of these sized (each then counts as 1 row)."""
    distinct = distinct or {}
    width: dict[str, int] = {}
    size: dict[str, float] = {}
    lookups: dict[str, float] = {}
    stripes: dict[str, tuple] = {}      # a key stripe: (its field, N): its share of the field's rows
    seen = set()
    for m in matches:
        for v in m.vectors:
            f = v.field
            if (id(v.table.layer), f) in seen:     # a table shared by several fields counts once
                continue
            seen.add((id(v.table.layer), f))
            width[f] = width.get(f, 0) + v.width
            if v.key_range is not None:            # one position of a table split by key range
                size[f] = max(size.get(f, 0.0), float(v.key_range[1] - v.key_range[0]))
                lookups[f] = 1.0
                continue
            if v.key_stripe is not None:           # a stripe: its share of the table's rows
                size[f] = _table_rows(v.table) / v.key_stripe[1]
                lookups[f] = float(v.width // int(v.table.attrs["dim"]))
                stripes[f] = (v.unstriped_field, v.key_stripe[1])
                continue
            size[f] = max(size.get(f, 0.0), _table_rows(v.table))
            ops = v.table.tensor_operands()
            shape = graph.shape(ops[0]) if ops else tf.TensorShape([None])
            n = 1.0
            for d in shape[1:]:
                n *= float(d or 1)
            lookups[f] = n
    out, unsized = [], []
    for f in width:
        rows = None
        if spec is not None:
            try:
                rows = spec[stripes[f][0]].cardinality / stripes[f][1] if f in stripes else spec[f].cardinality
            except KeyError:
                rows = None
        rows = rows or size[f] or distinct.get(f, 0.0)
        unsized += [] if rows else [f]
        out.append(FieldCost(f, float(rows or 1.0), width[f], lookups[f]))
    return out, unsized


def _table_rows(table) -> float:
    """The rows a table node's layer holds now, or was declared to hold (a TFRA table's
    ``init_capacity``) if more."""
    source = table.attrs["source"]
    return max(source.rows(table.layer), source.declared_rows(table.layer))


def _distinct_ids(fields: FieldAnalysis, matches: list[Match], sample) -> dict[str, float]:
    """Field -> distinct ids of its key input (des.graph.fields.row_key) in the ``sample`` batch."""
    out: dict[str, float] = {}
    if not isinstance(sample, dict):
        return out
    for m in matches:
        for v in m.vectors:
            key = fields.row_key(v)
            if key is not None and key in sample and v.key_range is None:
                out[v.field] = float(len(np.unique(np.asarray(sample[key]).reshape(-1))))
    return out


class FieldChains:
    """Computes the owned field vectors from the model inputs by calling, once each and in
    topological order, the layers of their chains (preprocessing, lookup, pooling, reshapes).
    The table nodes of a fused group (``fused``: [(FusedTable, its table nodes in call order)])
    are computed together, by one call of their fused table, when the first of them is reached."""
    defers = True       # __call__(inputs, defer): a striped lookup can wait for the rows exchange

    def __init__(self, graph: Graph, nodes: list[Node], wanted: list[int], fused: list[tuple] = (),
                 ranged: dict | None = None):
        self.nodes = sorted(nodes, key=lambda n: n.index)
        self.ranged = dict(ranged or {})     # table node index -> (the layer holding its keys here, ids -> lookup)
        self.wanted = list(wanted)
        self.inputs = {t: graph.input_name(t) for t in graph.input_ids}
        self.fused = list(fused)
        self.group_of = {n.index: k for k, (_, members) in enumerate(self.fused) for n in members}
        self.producer = {t: n for n in self.nodes for t in n.outputs}

    def __call__(self, inputs: dict, defer=frozenset()) -> dict:
        """{wanted tensor id: its tensor}; a wanted tensor in ``defer`` that a table split by key
        stripe gives (a StripeMember) comes as a des_ops.stripes.Deferred, its lookup not made."""
        env = {t: inputs[name] for t, name in self.inputs.items() if name in inputs}
        # per fused table of this call: (its one-hot inputs' rows side by side [B, S * dim], the
        # outputs those columns are, in order), for a reader of all of them in that order
        self.fused_rows: list[tuple] = []

        def look(x):
            if not is_keras_tensor(x):
                return x
            if id(x) not in env:                     # a fused group reads ahead of the topological order
                run(self.producer[id(x)])
            if isinstance(env[id(x)], Deferred):      # a layer of the chain reads it: made after all
                env[id(x)] = env[id(x)].dense()
            return env[id(x)]

        def run(node: Node) -> None:
            if node.index in self.group_of:
                table, members = self.fused[self.group_of[node.index]]
                args = [tf.nest.map_structure(look, m.call_args[0]) for m in members]
                outs, rows = table(args, with_rows=True)
                env.update({m.output: o for m, o in zip(members, outs)})
                layout = table.row_layout(args)
                if rows is not None and layout is not None:
                    self.fused_rows.append((rows, [outs[k] for k in layout]))
                return
            if node.index in self.ranged:            # a table split by key range or stripe: its own keys
                lookup = self.ranged[node.index][1]
                ids = tf.nest.map_structure(look, node.call_args[0])       # ids, or [ids, weights]
                later = node.output in defer and isinstance(lookup, StripeMember)
                env[node.output] = lookup.deferred(ids) if later else lookup(ids)
                return
            with autograph_as_keras_decides():       # the DES layer's call is not converted; users' layers are
                out = call_node(node, look)
            for t, new in zip(node.outputs, tf.nest.flatten(out)):
                env[t] = new

        for node in self.nodes:
            if not all(t in env for t in node.outputs):
                run(node)
        return {t: env[t] for t in self.wanted}


def _settle(comm: Communicator, tail: str, wire_dtype: str, first_layer: str) -> str:
    """Settle the default communicator (des_ops.mpi.SettlingCommunicator) for this step; the report's line."""
    settle = getattr(comm, "settle", None)
    if settle is None:                          # a communicator the user chose, or none under no launcher
        return ""
    by = settle(tail, wire_dtype, first_layer)
    why = ("the replicated tail" if tail == "replicated" else "the first layer by rows: no partials")
    return f"collectives by {by}: " + (f"each wait sleeping, no Horovod ({why})" if by == "mpi4py" else
                                       "the data-parallel tail's partials or a 16-bit wire, whose collectives Horovod "
                                       "runs faster")


def transform_functional(model: tf.keras.Model, options: Options, comm: Communicator,
                         spec=None, sample=None) -> tuple[tf.keras.Model, Report]:
    """des.transform of a functional (or Sequential) model: (DES model for this process, report).
    See des.compiler.api.transform."""
    if options.wire_dtype not in comm.wire_dtypes:
        raise ValueError(f"des.transform: wire_dtype={options.wire_dtype!r}: the {comm.name} communicator sums "
                         f"{', '.join(comm.wire_dtypes)} only (use Horovod)")
    graph = Graph(model)
    fields = FieldAnalysis(graph)
    matches, rejections, big = _found(graph, fields, options, comm, options.first_layer != "rows", spec, sample)
    report = _report(graph, fields, matches, rejections, comm, options, big)
    if options.strict and (rejections or report.unsubstituted or not matches):
        report.widths = {m.root.layer.name: rule_named(m.rule).sub_operator(m, m.vectors, name=f"probe_{m.rule}").width
                         for m in matches}                  # what would be sent
        report.floats_per_sample = sum(report.widths.values())
        raise TransformError(report)
    if not matches:
        return model, report
    costs, link, rows, why = _first_layer_plan(graph, fields, matches, model, options, comm, sample)
    if options.first_layer == "auto" and comm.world_size > 1:
        if rows:
            matches, rejections, big = _found(graph, fields, options, comm, False, spec, sample)
            report = _report(graph, fields, matches, rejections, comm, options, big)
    report.link, report.first_layer, report.first_layer_reason = link, "rows" if rows else "operators", why
    if rows:      # every vector by samples under the data-parallel tail
        options = dataclasses.replace(options, tail="data_parallel", field_rows="samples")
    return _substitute(model, graph, fields, matches, report, comm, options, spec, costs,
                       _distinct_ids(fields, matches, sample), sample)


def _found(graph: Graph, fields: FieldAnalysis, options: Options, comm: Communicator, operators: bool, spec,
           sample) -> tuple[list[Match], list, list[str]]:
    """The substitutions (rewrite_rules.find_substitutions) with every field too big for one owner
    split by key stripe (des.compiler.big_tables), the rejections, and the report's lines on those fields."""
    matches, rejections = find_substitutions(graph, fields, operators=operators, stripes=comm.world_size)
    if options.stripe_min_rows is None or comm.world_size < 2 or not matches:
        return matches, rejections, []
    costs, _ = _field_costs(graph, matches, spec, _distinct_ids(fields, matches, sample))
    matches, lines = split_big_fields(graph, fields, matches, comm.world_size, options.stripe_min_rows,
                                      {c.name: c.rows for c in costs})
    return matches, rejections, lines


def first_layer_plan(model: tf.keras.Model, options: Options, comm: Communicator,
                     sample=None) -> tuple[AutoTail, str, bool, str] | None:
    """What des.transform(model, options) would assume and choose for its first layer, before
    anything is built: (costs, the link's report line, by rows or not, why), or None when it
    would substitute nothing. Every process calls it (the link may be measured: a collective)."""
    graph = Graph(model)
    fields = FieldAnalysis(graph)
    matches, _ = find_substitutions(graph, fields, operators=options.first_layer != "rows",
                                          stripes=comm.world_size)
    if not matches:
        return None
    return _first_layer_plan(graph, fields, matches, model, options, comm, sample)


def _first_layer_plan(graph: Graph, fields: FieldAnalysis, matches: list[Match], model: tf.keras.Model,
                      options: Options, comm: Communicator, sample) -> tuple[AutoTail, str, bool, str]:
    costs, link = costs_for(options, comm, fields, matches, sample)
    rows, why = options.first_layer == "rows", ""
    if options.first_layer == "auto" and comm.world_size > 1:
        rows, why = first_layer_choice(graph, model, matches, options, costs, comm)
    return costs, link, rows, why


def _report(graph: Graph, fields: FieldAnalysis, matches: list[Match], rejections: list, comm: Communicator,
            options: Options, big: list[str] = ()) -> Report:
    table_lines, left = explain_tables(graph, fields, matches, rejections)
    return Report(matches, rejections, None, comm.rank, comm.world_size, tables=table_lines, unsubstituted=left,
                  opaque=_opaque_models(graph), options=options, big_fields=list(big))


def _substitute(model: tf.keras.Model, graph: Graph, fields: FieldAnalysis, matches: list[Match], report: Report,
                comm: Communicator, options: Options, spec, costs: AutoTail,
                distinct: dict[str, float] | None = None, sample=None) -> tuple[tf.keras.Model, Report]:
    """transform's second half: the same rows everywhere, the field plan, this process's DES
    layer in place of the matches, the model replayed around it (see transform). ``distinct``:
    each field's distinct ids in the sample batch (the plan's cost of a TFRA table)."""
    for n in graph.nodes:
        if n.kind == "table":
            n.attrs["source"].keyed(n.layer, options.seed, graph.layer_key(n.layer))
    if options.sync_weights and comm.world_size > 1:
        # a table split by key range is not broadcast whole: each owner gets its ranges (_key_range_tables)
        sync_from_root(graph, comm, skip={id(m.root.layer) for m in matches if "ranges" in m.data} |
                       {id(t.layer) for t in striped_tables(matches).values() if not t.attrs["source"].dynamic})
    forced = _forced_disagreement(comm)
    field_plan, unsized = _field_plan(graph, matches, spec, options.plan, comm, forced, distinct)
    report.plan_note = _unsized_note(unsized) if options.plan == "balanced" and comm.world_size > 1 else ""
    mine = set(field_plan.fields_of(comm.rank))
    own = _OwnedPart.of(graph, matches, mine)
    ranged = {**_key_range_tables(matches, field_plan, comm, options.sync_weights),
              **_stripe_tables(graph, matches, comm, options.sync_weights)}
    for index in striped_tables(matches):      # a Keras stripe's share of its table's penalty
        if isinstance(ranged[index][0], StripeEmbedding):
            own.penalties += take_weight_penalties(ranged[index][0])
    released = options.release_unowned and _release_unowned(matches, mine)

    # the vectors in graph order, never in tensor-id (memory address) order: the order in which the
    # lookups are built decides the order in which TensorFlow adds their gradients, so an address
    # order made the same job give other bits run after run
    position = {t: k for k, t in enumerate(graph.tensors)}
    tables = report.table_layout = options.tables_for(model)
    if tables == "joined":
        _mark_linear_tables(matches)
    fused, fused_lines = (fuse_nodes(graph, [n for n in own.nodes.values() if n.index not in ranged],
                                     f"rank{comm.rank}", tables == "joined")
                          if tables != "per-field" else ([], []))
    striped_fused, striped_lines = _join_striped(graph, matches, ranged, comm) if tables == "joined" else ([], [])
    chains = FieldChains(graph, list(own.nodes.values()),
                         sorted({t for ids in own.op_inputs for t in ids}, key=position.__getitem__), fused, ranged)
    skip = set().union(*(m.nodes for m in matches))
    dense = dense_shapes(matches) if options.first_dense == "auto" else []
    rows_width = (sum(sum(v.width for v in m.vectors) if "ranges" in m.data else m.vectors[0].width
                      for m in matches if m.rule == "field_rows") if options.field_rows == "auto" else 0)
    asked = ("first_layer='rows', whose first layers run in the data-parallel tail" if report.first_layer == "rows"
             else "tail='data_parallel'")
    tail, tail_reason = tail_choice(graph, model, skip, options.tail, costs, comm, dense, rows_width, asked)
    report.communicator = _settle(comm, tail, options.wire_dtype, report.first_layer)
    if tail == "data_parallel" and (options.micro_batches > 1 or options.wire_dtype != "float32"):
        raise ValueError("des.transform: micro_batches and a 16-bit wire_dtype are for the replicated tail; the "
                         "data-parallel tail reduce-scatters the whole batch in float32")
    key = fields.row_key if options.distinct_rows else (lambda v: None)
    report.by_rows, report.first_dense_reason = by_rows(matches, own, field_plan, comm, tail, options.first_dense, costs,
                                                         key)
    report.by_samples, report.field_rows_reason = by_samples(matches, own, field_plan, comm, tail, options.field_rows,
                                                              costs, key, options.distinct_rows)
    report.distinct_keys = exchanged_keys(own.ops)
    report.exchanges = exchange_lines(
        _field_traffic(matches, own.ops, field_plan, set(report.by_rows), key), sample if isinstance(sample, dict) else None,
        comm.world_size, [report.first_layer_reason, report.field_rows_reason, report.first_dense_reason])
    first = _first_layer(chains, fused + striped_fused, own, comm, tail, options.scope, forced,
                         options.micro_batches, options.wire_dtype)
    names_in = sorted({graph.nodes[i].layer.name for m in matches for v in m.vectors for i in v.chain | fields.cone(v.tensor)
                       if graph.nodes[i].kind == "input"})
    outs = first({n: graph.tensors[_input_id(graph, n)] for n in names_in})
    given = {m.root.output: _finisher(graph, m, o) for m, o in zip(matches, outs)}
    new_model, tail_variables = _replay(graph, skip, given, model, comm, first, tail == "data_parallel")
    attach(new_model, Distributed(first, field_plan, StateKeys.of_transform(
        graph, matches, first, [m.layer for _, members in fused + striped_fused for m in members]), tail, tail_variables,
        source=model))
    report.tables += fused_lines + striped_lines
    report.plan, report.floats_per_sample, report.widths = field_plan, first.floats_per_sample(), own.widths
    report.penalty_column = own.penalty_column
    report.tail, report.tail_reason = tail, tail_reason
    report.micro_batches, report.wire_dtype = options.micro_batches, options.wire_dtype
    trace_once(new_model)
    report.compiled = _compile_like(model, new_model)
    if released:
        _mark_consumed(model)
    return new_model, report


def _field_traffic(matches: list[Match], ops: list, plan: FieldPlan, by_rows: set[str], key) -> list[FieldTraffic]:
    """Per field, how the chosen exchanges carry its tables (des.compiler.exchange): rows for a
    first Dense by rows and for field rows by samples (``ops``, aligned with ``matches``, carry the
    choice), partials for every other operator."""
    out: dict[str, FieldTraffic] = {}
    keys: dict[str, set] = {}
    for m, op in zip(matches, ops):
        rows = getattr(op, "exchange", "partials") in ("rows", "samples") or m.root.layer.name in by_rows
        for v in m.vectors:
            t = out.setdefault(v.field, FieldTraffic(v.field, plan.owner[v.field], []))
            if v.table.layer.name not in t.tables:
                t.tables.append(v.table.layer.name)
            if rows and getattr(op, "stripe_keys", None) and v.key_stripe is not None:
                t.rows_width += v.width            # a key stripe's: each position's own keys, once per distinct id
                t.position_keys = [f"{k}@{v.key_stripe[0]}/{v.key_stripe[1]}" for k in op.stripe_keys]
            elif rows:
                t.rows_width += v.width
                keys.setdefault(v.field, set()).add(key(v))
            elif f"{m.rule} at {m.root.layer.name!r}" not in t.partials:
                t.partials.append(f"{m.rule} at {m.root.layer.name!r}")
    for f, ks in keys.items():
        out[f].key = next(iter(ks)) if len(ks) == 1 else None     # mixed: counted once per sample (at most)
    return list(out.values())


def _unsized_note(unsized: list[str]) -> str:
    """A report line when the balanced plan could not size the fields ``unsized``: no spec
    cardinality, an empty table (TFRA's start so) and no ``sample=`` batch with their ids; else ""."""
    if not unsized:
        return ""
    shown = ", ".join(unsized[:6]) + (", ..." if len(unsized) > 6 else "")
    return (f"  the plan could not size {len(unsized)} field(s) ({shown}): their tables are empty and no sample= "
            f"batch gave their ids, so each counts as 1 row; des.transform(model, sample=<a global batch>) "
            f"balances them by their distinct ids")


def _field_plan(graph: Graph, matches: list[Match], spec, plan: str | FieldPlan, comm: Communicator,
                forced: str | None, distinct: dict[str, float] | None = None) -> tuple[FieldPlan, list[str]]:
    """The field plan (given, or made from the fields' costs), checked to be the same on every
    process, and the fields the costs could not size (_field_costs)."""
    costs, unsized = _field_costs(graph, matches, spec, distinct)
    # a table split by key stripe: stripe r is rank r's, whatever the plan
    stripes = {v.field: v.key_stripe[0] for m in matches for v in m.vectors if v.key_stripe is not None}
    unsized = [f for f in unsized if f not in stripes]
    stripe_costs = [c for c in costs if c.name in stripes]
    costs = [c for c in costs if c.name not in stripes]
    if isinstance(plan, FieldPlan):
        missing = {c.name for c in costs} - set(plan.owner)
        if plan.world_size != comm.world_size or missing:
            raise ValueError(f"the given plan is for {plan.world_size} processes and lacks fields "
                             f"{sorted(missing)}; this world has {comm.world_size}")
        field_plan = plan
    else:
        field_plan = make_plan(costs, comm.world_size, plan)
    if stripes:
        striped = make_plan(costs + stripe_costs, comm.world_size, "mod")      # the costs of all, for the loads
        field_plan = dataclasses.replace(field_plan, owner={**field_plan.owner, **stripes}, costs=striped.costs)
    if forced == "plan":
        moved = next(iter(field_plan.owner))
        field_plan = dataclasses.replace(field_plan, owner={**field_plan.owner,
                                                           moved: (field_plan.owner[moved] + 1) % comm.world_size})
    if comm.world_size > 1:
        check_agreement(field_plan, comm)
    return field_plan, unsized


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
        # a Keras table split by key stripe: its stripe's layer holds its share of the penalty (_stripe_tables)
        striped = {v.table.index for m in matches for v in m.vectors
                   if v.key_stripe is not None and not v.table.attrs["source"].dynamic}
        for i in sorted(nodes):
            taken = take_weight_penalties(nodes[i].layer)
            penalties += [] if i in striped else taken
        return cls(ops, op_inputs, widths, nodes, penalty_column, penalties)


def mark_linear_tables(model: tf.keras.Model) -> None:
    """Mark the 1-wide tables of ``model``'s sparse linear sum as its linear part, as des.transform
    does before joining tables (the parameter server's joined tables: des.baselines.ps.user)."""
    graph = Graph(model)
    _mark_linear_tables(find_substitutions(graph, FieldAnalysis(graph))[0])


def _mark_linear_tables(matches: list[Match]) -> None:
    """The 1-wide tables of a user's sparse linear sum (those lr_sum matched or, with the first layer
    by rows, field_rows carries; read by nothing else) are its linear part, as the zoo's
    ``FieldEmbedding(linear=True)`` is: joined tables then keep a field's weight in its embedding's
    row, one lookup and one update for both (des_ops.fused.linear_partners)."""
    used: dict[int, set] = {}
    for m in matches:
        for v in m.vectors:
            used.setdefault(id(v.table.layer), set()).add(m.rule)
    for m in matches:
        for v in m.vectors if m.rule in ("lr_sum", "field_rows") else []:
            if m.rule == "field_rows" and int(v.table.attrs.get("dim", v.width)) != 1:   # its rows', not [B, P, 1]'s
                continue
            shadow = getattr(v.table.layer, "shadow", None)
            if used[id(v.table.layer)] <= {"lr_sum", "field_rows"} and shadow is not None:
                shadow.des_linear_part = True


def _key_range_tables(matches: list[Match], plan: FieldPlan, comm: Communicator, from_root: bool) -> dict:
    """For each table split by key range (field_rows over ids + offsets) of which this process owns
    positions: {table node index: (a RangeEmbedding holding those positions' rows, the positions)}.
    With ``from_root`` (and several processes) the rows are rank 0's: it sends each owner the rows
    of its ranges, one all-to-all per table (every process takes part), never the whole table to
    every process; else this process's own. Called before the whole table is released."""
    out = {}
    for m in matches:
        if "ranges" not in m.data:
            continue
        ranges, table = m.data["ranges"], m.root.layer
        owned = [[f for f, v in enumerate(m.vectors) if plan.owner[v.field] == r] for r in range(comm.world_size)]
        positions = owned[comm.rank]
        if from_root and comm.world_size > 1:        # every process takes part, owner or not
            rows = _rows_from_root(table, [[ranges[f] for f in fs] for fs in owned], comm,
                                   f"des_key_ranges_{m.root.index}")       # the graph position: the same everywhere
        elif positions:
            rows = rows_of(table.embeddings.numpy(), [ranges[f] for f in positions])
        if positions:
            held = RangeEmbedding([ranges[f] for f in positions], rows, table=table.name,
                                  name=f"des_ranges_{table.name}_rank{comm.rank}")
            out[m.root.index] = (held, lambda ids, held=held, positions=positions: held(tf.gather(ids, positions,
                                                                                                  axis=1)))
    return out


def _stripe_tables(graph: Graph, matches: list[Match], comm: Communicator, from_root: bool) -> dict:
    """For each table split by key stripe: {table node index: (the layer holding this process's
    stripe, ids -> lookup)}. A Keras table's stripe moves into a StripeEmbedding (rank 0's rows
    with ``from_root``: one scatter, never the whole table to every process); a TFRA table stays
    the holder, keeps only its stripe's keys and looks up only those (des_ops.stripes)."""
    out = {}
    r, n = comm.rank, comm.world_size
    for index, node in sorted(striped_tables(matches).items()):     # graph order: the scatters in one order everywhere
        table, dim = node.layer, int(node.attrs["dim"])
        if node.attrs["source"].dynamic:
            table.des_key_stripe = (r, n)
            keep_own_rows(node.attrs["source"], table)
            out[index] = (table, _stripe_lookup(graph, node, lambda x, table=table: [table(x)], r, n, [dim]).member(0))
            continue
        if from_root and n > 1:
            full = table.embeddings.numpy() if r == 0 else None
            rows = comm.scatter([full[q::n] for q in range(n)] if r == 0 else None, (dim,), 0,
                                f"des_key_stripes_{index}")
        else:
            rows = table.embeddings.numpy()[r::n]
        held = StripeEmbedding(r, n, rows, int(table.input_dim), table=table.name,
                               regularizer=table.embeddings_regularizer, name=f"des_stripe_{table.name}_rank{r}")
        out[index] = (held, held.lookup().member(0))
    return out


def _stripe_lookup(graph: Graph, node: Node, call, stripe: int, count: int, dims: list[int]):
    """Stripe ``stripe`` of ``count`` of the tables ``call`` reads (inputs -> one output each): a
    StripeLookup of its own keys, or, for des.train's tables that pool their [B, L] ids themselves,
    a MaskedStripe (the others' ids as padding)."""
    if masks_its_ids(graph, node):
        return MaskedStripe(call, stripe, count, PAD_ID)
    return StripeLookup(call, stripe, count, dims)


def _join_striped(graph: Graph, matches: list[Match], ranged: dict, comm: Communicator) -> tuple[list, list[str]]:
    """TFRA tables split by key stripe that joined rows allow (an embedding and its linear weight read
    with the same ids: TFRA's one-table style, a big field's two tables): each pair's stripe in ONE
    FusedTable, looked up once for both behind one stripe mask, not two TFRA lookups and updates a
    step (des_ops.fused). Replaces the pair's entries of ``ranged``; ([(table, its two nodes)],
    report lines)."""
    # a table split by key stripe is called once (stripe_positions, big_tables.why_not_striped)
    nodes = [n for _, n in sorted(striped_tables(matches).items()) if n.attrs["source"].dynamic]
    out, lines = [], []
    for (widths, _, _), members in fusion_groups(nodes, join_linear=True).items():
        if len(widths) != 2:
            continue
        partner = linear_partners(members)
        for n in members:
            if linear_part(n.layer) or id(n.layer) not in partner:
                continue
            pair = sorted([n] + [m for m in members if m.layer is partner[id(n.layer)]], key=lambda m: m.index)
            fused, _ = fuse_nodes(graph, pair, f"stripe{pair[0].index}_rank{comm.rank}", join_linear=True)
            table, readers = fused[0]
            widths = [width_of(node.layer) for node in readers]
            # one lookup of the joined rows behind one stripe mask, each member placed on its own (no
            # slice of a joined tensor, whose gradient is a zero-filled copy); two readers share it
            lookup = _stripe_lookup(graph, readers[0], lambda x, table=table, w=len(widths): table([x] * w),
                                    comm.rank, comm.world_size, widths)
            for j, node in enumerate(readers):
                ranged[node.index] = (node.layer, lookup.member(j))
            out.append((table, readers))
            lines.append(f"fused table {table.name}: this process's key stripe (k mod {comm.world_size} == {comm.rank}) "
                         f"of {' and '.join(f'{n.layer.name} (width {width_of(n.layer)})' for n in readers)}, "
                         f"side by side in one TFRA table: one lookup and one update a step for both")
    return out, lines


def _rows_from_root(table, ranges_by_rank: list[list], comm: Communicator, name: str) -> np.ndarray:
    """Rank 0's rows of each rank's ranges of ``table``, on that rank (Communicator.scatter: under
    Horovod one all-to-all in which only rank 0 sends; the whole table never goes to every process)."""
    full = table.embeddings.numpy() if comm.rank == 0 else None
    return comm.scatter([rows_of(full, rs) for rs in ranges_by_rank] if comm.rank == 0 else None,
                        (int(table.output_dim),), 0, name)


def _release_unowned(matches: list[Match], mine: set[str]) -> bool:
    """Drop the rows of the tables this process does not own (a table split by key range or a Keras
    one by key stripe: all of it, an owner's ranges and a stripe live in their own layers; a TFRA
    table split by key stripe holds its stripe itself); True if any was dropped."""
    released = False
    for m in matches:
        if "ranges" in m.data:
            m.root.attrs["source"].release(m.root.layer)
            released = True
            continue
        for v in m.vectors:
            if v.key_stripe is not None and v.table.attrs["source"].dynamic:
                continue
            if v.field not in mine or v.key_stripe is not None:
                v.table.attrs["source"].release(v.table.layer)
                released = True
    return released


def _first_layer(chains, fused: list, own: _OwnedPart, comm: Communicator, tail: str, scope: str,
                 forced: str | None, micro_batches: int = 1, wire_dtype: str = "float32") -> DESFirstLayer:
    """The DES layer of this process, its collective's schedule agreed with every process."""
    in_fused = {id(m.layer) for _, members in fused for m in members}
    ranged = {n.index: chains.ranged[n.index][0] for n in chains.nodes if n.index in chains.ranged}
    layers = [ranged.get(n.index, n.layer) for n in chains.nodes]
    layers = [l for l in dict.fromkeys(layers) if id(l) not in in_fused]
    layers += [table for table, _ in fused]
    first = DESFirstLayer(layers, chains, own.ops, own.op_inputs, comm, own.penalties, own.penalty_column,
                          shard_rows=tail == "data_parallel", scope=scope, micro_batches=micro_batches,
                          wire_dtype=wire_dtype, name="des_first_layer")
    # the untouched tables split by key range -> this process's RangeEmbedding (des.compiler.keys; untracked)
    object.__setattr__(first, "key_ranges", {id(n.layer): ranged[n.index] for n in chains.nodes if n.index in ranged})
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
    # kernel rows every process holds (a field split by key stripe): their gradients summed, as the tail's
    shared = [op.shared_block for op in first.ops if getattr(op, "shared_block", None) is not None]
    if not data_parallel:
        new_model = replay(graph, skip, given, cls=_model_class(model))
        if shared:
            sum_tail_gradients(new_model, comm, shared)
        return new_model, shared
    new_model = replay(graph, skip, given, cls=_model_class(model),
                       input_map=lambda t: ShardRows(comm, name=f"des_rows_{t.name.split(':')[0]}")(t),
                       output_map=lambda t, i: GatherRows(comm, f"des_tail_output{i}",
                                                          name=f"des_gather_output{i}")(t))
    count_tail_penalties_once([l for l in new_model.submodules
                               if isinstance(l, tf.keras.layers.Layer) and l is not first], comm.rank)
    owned = {v.ref() for v in first.trainable_weights}
    tail_variables = [v for v in new_model.trainable_variables if v.ref() not in owned] + shared
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
        args["optimizer"], note = copy_optimizer(opt)
    except Exception as e:  # noqa: BLE001 - an optimizer class of the user's without from_config
        return (f"the model was compiled, the returned one is NOT ({type(opt).__name__} could not be copied: {e}); "
                f"compile it before fit")
    new_model.compile(**args)
    return (f"compiled as the model was: loss, metrics and a new {type(opt).__name__} with the same configuration "
            f"(its slots start empty){note}")


def _mark_consumed(model: tf.keras.Model) -> None:
    """The transformed model shares its layers with the returned one, and this process released
    the tables it does not own: calling it again says so instead of failing deep inside a layer.
    (On one process nothing is released and the model still computes what it did, unless a table
    was split by key range: its rows moved into the process's RangeEmbedding.)"""
    def consumed(*args, **kwargs):
        raise RuntimeError(f"model {model.name!r} was consumed by des.transform (its layers now belong to the "
                           f"returned model, and this process dropped the tables it does not own): use the model "
                           f"des.transform returned")
    model.call = consumed


def _opaque_models(graph: Graph) -> list[str]:
    """Subclassed models called as layers that hold tables and whose call() did not trace."""
    out = []
    for n in graph.nodes:
        layer = n.layer
        if isinstance(layer, tf.keras.Model) and not getattr(layer, "_is_graph_network", False):
            tables = [m.name for m in layer.submodules if isinstance(m, tf.keras.layers.Layer) and source_of(m)]
            if tables:
                why = graph.untraced.get(layer.name)
                out.append(f"{layer.name!r} is a subclassed {type(layer).__name__} whose call() DES cannot trace"
                           + (f" ({why})" if why else "") + f", so its tables ({', '.join(tables[:4])}{', ...' if len(tables) > 4 else ''}) stay "
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

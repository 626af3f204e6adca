"""The choices des.transform leaves to the cost model (des.compiler.cost), made from the model's graph
and the matches: what the link is (measured at start), the first layer by operators or by rows, the
tail, the first Dense by partials or rows, field rows as partials or by samples. Every process makes
the same choice from the same inputs (the link's measurement is averaged over processes and rounded).

    >>> distinct_share_of({"user": [1, 1, 2, 2]}, ["user", None], 2)   # user: 1 of 2 rows per slice, a keyless vector 1
    0.75
"""
from __future__ import annotations

import dataclasses

import numpy as np
import tensorflow as tf

from des.compiler.cost import (LINK_CLASSES, AutoTail, choose_field_rows, choose_first_dense, choose_first_layer,
                               choose_tail, link_text, measure_link)
from des.compiler.options import Options
from des.compiler.plan import FieldPlan
from des.graph.fields import FieldAnalysis
from des.graph.ir import Graph
from des_ops.comm import Communicator, agree, shard_rows
from des_ops.rows import Block, key_ids, unstriped
from des_ops.tail import tail_obstacles
from rewrite_rules import Match, rule_named


def costs_for(options: Options, comm: Communicator, fields: FieldAnalysis, matches: list[Match],
              sample) -> tuple[AutoTail, str]:
    """What the auto choices assume, and the report's line on it: ``options.costs`` if given with a
    bandwidth; else (``costs=None``, or an AutoTail whose bandwidth is None: des.train's ``--link
    auto``), on several processes under Horovod or mpi4py with a choice left to the cost model,
    those costs (or des.AutoTail's defaults) with the link's bandwidth measured now
    (des.compiler.cost.measure_link, rounded to a class so that the same job makes the same choices
    run after run), or, when every process is on one machine, the fastest class untimed; else the
    defaults. With a ``sample`` batch (and no ``options.costs``), its size and the share of distinct
    rows measured on it."""
    if options.costs is not None and options.costs.bandwidth is not None:
        return options.costs, ""
    costs, line = options.assumed, ""
    auto = "auto" in (options.first_layer, options.tail, options.first_dense, options.field_rows)
    if auto and comm.world_size > 1 and comm.name in ("horovod", "mpi4py"):
        agree(comm, "des.Options (the link is measured next)", str(options))
        if comm.one_machine():
            # shared memory: the fastest class, untimed (timing it on a busy machine measured
            # anything from 1e8 to 1e15 B/s, and a slow figure flipped the choices between runs)
            costs = dataclasses.replace(costs, bandwidth=LINK_CLASSES[-1])
            line = f"link not timed: every process on this machine (shared memory); assumed {link_text(LINK_CLASSES[-1])}"
        else:
            link = measure_link(comm)
            costs, line = dataclasses.replace(costs, bandwidth=link.assumed), str(link)
    if sample is not None and options.costs is None:
        # a field split by key stripe: its ids' distinct share once, as one field's
        keys = [unstriped(fields.row_key(v)) for m in matches for v in m.vectors
                if v.key_stripe is None or v.key_stripe[0] == 0]
        batch = int(np.shape(next(iter(tf.nest.flatten(sample))))[0])
        costs = dataclasses.replace(costs, batch_size=batch, distinct=distinct_share_of(sample, keys, comm.world_size))
    return costs, line


def first_layer_choice(graph: Graph, model: tf.keras.Model, matches: list[Match], options: Options,
                       costs: AutoTail, comm: Communicator) -> tuple[bool, str]:
    """(rows or not, why) for des.Options(first_layer="auto") with the other exchanges left to the
    cost model too: the rows of every field vector to their samples' processes when the tail
    would run data-parallel anyway and, by
    des.compiler.cost.choose_first_layer, that takes less time than the operators' exchanges."""
    if (options.tail, options.first_dense, options.field_rows) != ("auto", "auto", "auto"):
        return False, ""                # a choice the user pinned is for the operators' exchanges
    skip = set().union(*(m.nodes for m in matches))
    dense = dense_shapes(matches)
    tail, _ = tail_choice(graph, model, skip, options.tail, costs, comm, dense)
    if tail != "data_parallel":
        return False, ""
    partials = [rule_named(m.rule).sub_operator(m, m.vectors, name=f"probe_{m.rule}").width for m in matches
                if "parts" not in m.data]
    tables = {(id(v.table.layer), v.tensor): v.width for m in matches for v in m.vectors}
    choice, why = choose_first_layer(sum(tables.values()), partials, dense, comm.world_size, costs)
    return choice == "rows", why


def dense_shapes(matches: list[Match]) -> list[tuple[int, int]]:
    """(input width, units) of every first Dense layer among the matches."""
    return [(sum({v.tensor: v.width for v in m.vectors}.values()), int(m.data["kernel"].shape[1])) for m in matches
            if "parts" in m.data]      # a field split by key stripe: its N stripes are one vector's width


def exchanged_keys(ops: list) -> list[str]:
    """The id inputs whose fields' rows travel once per distinct id, over the sub-operators that move
    rows (the first Dense by rows: ``rank_blocks``; field rows by samples: ``block``)."""
    blocks = [b for op in ops if getattr(op, "exchange", "") == "rows" for bl in op.rank_blocks for b in bl]
    blocks += [op.block for op in ops if getattr(op, "exchange", "") == "samples" and op.block is not None]
    keys = [b.key for b in blocks] + [k for op in ops if getattr(op, "exchange", "") == "samples"
                                      for k in getattr(op, "position_keys", []) or getattr(op, "stripe_keys", None) or []]
    return sorted({k for k in keys if k is not None})


def distinct_share_of(sample: dict, keys: list, world_size: int) -> float:
    """AutoTail.distinct from a batch of the inputs: per field vector, the distinct ids of its key in
    a process's slice over the slice's rows (1 for a vector without a key), averaged."""
    shares = {}
    for key in {k for k in keys if k is not None}:
        ids = np.asarray(key_ids(sample, key)).reshape(-1)
        b = len(ids)
        bounds = [shard_rows(b, r, world_size) for r in range(world_size)]
        shares[key] = float(np.mean([len(np.unique(ids[lo:hi])) / max(1, hi - lo) for lo, hi in bounds]))
    return float(np.mean([shares.get(k, 1.0) for k in keys])) if keys else 1.0


def tail_choice(graph: Graph, model: tf.keras.Model, skip: set[int], tail: str, costs: AutoTail,
                comm: Communicator, dense_shapes: list[tuple[int, int]] = (), field_rows: int = 0,
                asked: str = "tail='data_parallel'") -> tuple[str, str]:
    """("replicated" or "data_parallel", why): the asked tail, or for "auto" the cost model's choice
    under ``costs`` (``dense_shapes``: first Dense layers that may go by rows, des.compiler.cost.choose_tail).
    ``asked``: the option that asked for the data-parallel tail, named when it cannot run."""
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
            costs, obstacles, dense_shapes, field_rows)
    if obstacles:
        raise ValueError(f"des.transform({asked}): the tail cannot run data-parallel: " + "; ".join(obstacles))
    return tail, ""


def by_rows(matches: list[Match], own, field_plan: FieldPlan, comm: Communicator, tail: str,
            first_dense: str, costs: AutoTail, key) -> tuple[dict, str]:
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
        # each process's blocks as its DenseBlockSubOp orders them: its own fields', then its key stripes'
        op.rank_blocks = [[Block(v.width, key(v)) for v in sorted(
            (v for v in m.vectors if field_plan.owner[v.field] == r), key=lambda v: v.key_stripe is not None)]
            for r in range(comm.world_size)]
        out[m.root.layer.name] = (widths, units)
    return out, "; ".join(reasons)


def by_samples(matches: list[Match], own, field_plan: FieldPlan, comm: Communicator, tail: str,
               field_rows: str, costs: AutoTail, key, distinct: bool = True) -> tuple[list[int], str]:
    """Under the data-parallel tail, the widths by rank of the field vectors no rule splits when
    their rows go to their samples' processes (des_ops.rows.rows_to_samples; [] when they stay
    partials, as under the replicated tail, where every process needs every row), and the cost
    model's reason; marks their sub-operators. A table split by key range sends from every owner:
    each its positions' rows; one split by key stripe from every process (its keys' rows, keyed
    per position when ``distinct``)."""
    rows = [(m, op) for m, op in zip(matches, own.ops) if m.rule == "field_rows"]
    if not rows or tail != "data_parallel" or field_rows == "partials":
        return [], ""
    choice, why = "samples", ""
    if field_rows == "auto":
        choice, why = choose_field_rows(costs.batch_size, sum(op.width for _, op in rows), comm.world_size, costs)
    if choice != "samples":
        return [], why
    widths = [0] * comm.world_size
    for m, op in rows:
        op.exchange = "samples"
        if "stripes" in m.data:
            op.stripe_keys = m.data["stripe_keys"] if distinct else None
        elif "ranges" in m.data:
            op.rank_positions = [[f for f, v in enumerate(m.vectors) if field_plan.owner[v.field] == r]
                                 for r in range(comm.world_size)]
            op.position_keys = [key(v) for v in m.vectors]       # each position's ids: once per distinct id
        else:
            op.owner = field_plan.owner[m.vectors[0].field]
            op.block = Block(op.width, key(m.vectors[0]))
        for r, blocks in enumerate(op.samples_blocks(comm.world_size)):
            widths[r] += sum(b.width for b in blocks)
    return widths, why

"""plan="auto": choose DES or the parameter server for a model, from the first batch's ids.

DES moves the partials of every substituted operator in one ring allreduce, 2(N-1)/N * 4*B*w
bytes per process and step, whatever the ids; or, when des.transform's defaults send the field
rows to their samples' processes (first layer by rows, ``des_exchange="rows"``), each table's
distinct rows of a process's slice that another process owns (a table has one owner: (N-1)/N of
them on average) and their gradients back, without the ids a PS sends, plus the same dense ring. A PS moves, per table, the distinct ids of a
process's slice that live elsewhere (8-byte keys, rows back, gradient rows out) plus the ring
allreduce of the dense gradients. Both are computed here on the real first global batch (the
PS figure with des.baselines.ps.rewrite.analytic_bytes, the formula its measured bytes equal), and the mode that
moves fewer bytes per step wins. The choice is per model: every process computes it from the
same batch, so all choose alike without a collective.

    >>> import models
    >>> from des.jobs.verify import random_batches, small_spec
    >>> spec = small_spec(n_fields=3, dim=4)                  # 10, 20 and 30 distinct ids
    >>> first_batch, _ = random_batches(spec, steps=1, batch=64)[0]
    >>> choice = choose(models.deepfm(spec, hidden=(8,)), first_batch, world_size=4)
    >>> choice.mode                                           # few distinct ids: a PS moves less
    'ps'
    >>> print(choice)
    plan auto: PS - on the first global batch of 64 at N=4, DES would send 5,376 B/step per process and a PS 1,422 (DES sends 3.78x more)
      cost lr_sum               at 'add': DES 384 B/step, PS 252 B/step -> a PS would move 1.5x fewer
      cost fm_interaction       at 'fm': DES 1,920 B/step, PS 630 B/step -> a PS would move 3.0x fewer
      cost embed_concat_dense   at 'dnn_0': DES 3,072 B/step, PS 1,254 B/step -> a PS would move 2.4x fewer
"""
from __future__ import annotations

import dataclasses
import types

import numpy as np
import tensorflow as tf

from des.baselines import allocate
from des.baselines.ps import rewrite as ps
from des.compiler.cost import OperatorCost, estimate, unique_ids_per_slice
from des.graph.ir import Graph
from des_ops.fused import tables_after_fusing
from des_ops.wire import ring_share
from rewrite_rules import find_substitutions, rule_named


@dataclasses.dataclass
class Choice:
    mode: str                     # "des" or "ps"
    des_bytes: float              # per process and step, ring allreduce of the partials
    ps_bytes: float               # per process and step, mean over processes: all-to-all + dense ring
    world_size: int
    batch_size: int
    operators: list[OperatorCost]
    des_exchange: str = "partials"    # what DES was weighed by: "partials" or "rows" (its first layer by rows)

    def __str__(self) -> str:
        if self.world_size == 1:
            return "plan auto: one process, nothing to move; DES (a world of one equals the model)"
        win, lose = (self.des_bytes, self.ps_bytes) if self.mode == "des" else (self.ps_bytes, self.des_bytes)
        ratio = lose / win if win > 0 else float("inf")
        by = " (its field rows to their samples' processes)" if self.des_exchange == "rows" else ""
        lines = [f"plan auto: {self.mode.upper()} - on the first global batch of {self.batch_size} at "
                 f"N={self.world_size}, DES{by} would send {self.des_bytes:,.0f} B/step per process and a PS "
                 f"{self.ps_bytes:,.0f} ({'the PS' if self.mode == 'des' else 'DES'} sends {ratio:.2f}x more)"]
        lines += [str(c) for c in self.operators]      # OperatorCost indents itself
        return "\n".join(lines)


def des_widths(model: tf.keras.Model) -> tuple[dict[str, int], list]:
    """The partial's width (floats per sample) of each operator DES would substitute in ``model``,
    by its layer's name (nothing is built), and the matches."""
    matches, _ = find_substitutions(Graph(model))
    return {m.root.layer.name: rule_named(m.rule).sub_operator(m, [], name=f"auto_{m.rule}").width
            for m in matches}, matches


def traffic(model: tf.keras.Model, first_batch: dict, world_size: int, allocator=None,
            join_linear: bool = True) -> dict:
    """Per process and step at N = ``world_size``, by the formulas on a global batch of ids:
    ``des_payload`` (4*B*floats handed to the allreduce), ``des_bytes`` (its ring share),
    ``ps_alltoall`` (ids, rows, gradient rows of remote distinct ids; mean over the N slices),
    ``ps_dense_payload`` (dense gradients), ``ps_bytes`` (all-to-all + dense ring + the loss
    weight), ``des_rows_bytes`` (DES's rows exchange, first layer by rows: other owners' distinct
    rows in and gradient rows out, mean over the slices, + the dense ring), ``tables`` (the model's), ``ps_lookups`` (the TFRA tables the PS looks up, its tables
    fused as ``--mode ps`` fuses them by default: des_ops.fused.tables_after_fusing); and
    ``matches`` and ``widths``, the substitutions DES would make.
    ``allocator`` (des.baselines.allocate): which process's slice holds which rows (default: contiguous).
    ``join_linear``: the PS's linear weights travel in their embeddings' rows (its default with one
    optimizer, des.jobs.config.RunConfig.join_linear)."""
    feats = {k: np.asarray(v) for k, v in first_batch.items()}
    b, n = len(next(iter(feats.values()))), world_size
    ring = ring_share(n)
    widths, matches = des_widths(model)
    floats = sum(widths.values())
    tables, dense = ps.table_inputs(model, join_linear), ps.dense_parameters(model)
    a2a, total, rows = [], [], []
    parts = _parts(feats, b, n, allocator)
    for r in range(n):
        an = ps.analytic_bytes({k: v[parts[r]] for k, v in feats.items()}, tables, r, n, dense)
        a2a.append(an["alltoall_bytes"])
        total.append(an["alltoall_bytes"] + an["dense_ring_bytes"] + (ring * 4 if n > 1 else 0))
        # DES's rows exchange: the slice's distinct rows that another process owns ((N-1)/N of them:
        # one owner per table), a row in and its gradient row out, 4 bytes a float
        rows.append((n - 1) / n * 2 * 4 * an["unique_floats"])
    return {"des_payload": 4.0 * b * floats, "des_bytes": ring * 4.0 * b * floats,
            "ps_alltoall": float(np.mean(a2a)), "ps_dense_payload": 4.0 * dense, "ps_bytes": float(np.mean(total)),
            "des_rows_bytes": float(np.mean(rows)) + ring * 4.0 * dense,   # the tail's gradients too
            "tables": len(ps.table_inputs(model)), "ps_lookups": tables_after_fusing(Graph(model).nodes, join_linear),
            "matches": matches,
            "widths": widths, "batch": b}


def _parts(feats: dict, batch: int, world_size: int, allocator) -> list:
    allocator = allocator or allocate.make("contiguous", world_size)
    return allocator({k: feats[k] for k in allocator.inputs}, batch)


def choose(model: tf.keras.Model, first_batch: dict, world_size: int, allocate_kind: str = "contiguous",
           des_exchange: str = "partials") -> Choice:
    """DES or PS for ``model`` (unchanged, single-process) on N = ``world_size`` processes, the
    PS's slices given by ``allocate_kind`` (des.baselines.allocate); DES weighed by its partials,
    or (``des_exchange="rows"``) by its rows exchange, the first layer by rows."""
    keys = [ids for ids, _, _ in ps.table_inputs(model)]
    new = lambda: allocate.make(allocate_kind, world_size, keys)  # noqa: E731 - a fresh one per use
    t = traffic(model, first_batch, world_size, new())
    if not t["matches"]:
        raise ValueError("plan auto: des.transform finds nothing to substitute in this model")
    if des_exchange == "rows":
        des_bytes = t["des_rows_bytes"]
        mode = "des" if des_bytes <= t["ps_bytes"] else "ps"
        return Choice(mode, des_bytes, t["ps_bytes"], world_size, t["batch"], [], "rows")
    operators = []
    if world_size > 1:     # the cost model's verdict per substituted operator (des.compiler.cost), for the report
        feats = {k: np.asarray(v) for k, v in first_batch.items()}
        uniq = unique_ids_per_slice(feats, [k for k, v in feats.items() if v.dtype.kind in "iu"], world_size,
                                    _parts(feats, t["batch"], world_size, new()))
        report = types.SimpleNamespace(world_size=world_size, substitutions=t["matches"], widths=t["widths"],
                                       bytes_per_float=4)     # float32 partials: what plan auto trains
        operators = estimate(report, t["batch"], uniq)
    mode = "des" if world_size == 1 or t["des_bytes"] <= t["ps_bytes"] else "ps"
    return Choice(mode, t["des_bytes"], t["ps_bytes"], world_size, t["batch"], operators)


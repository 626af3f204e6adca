"""A field too big for one owner: its tables split by key stripe over every process.

The balanced plan gives each field one owner. A field whose rows exceed an even share of all
fields' rows (their sum / N) cannot be balanced so: its owner would hold more than 1/N of the
model, whatever the plan. When it also has at least ``des.Options.stripe_min_rows`` rows, its
tables are split by key stripe (des_ops.stripes): process r holds the keys k mod N == r, looks
up only those for the whole batch (zeros for the others), and that lookup is its field vector
``<field>%r``, owned by r, in the operators' partials or the field rows like any owned vector.

The sum over processes of the N stripes' vectors is the field vector, exactly (x + 0 + ... = x),
and, with one id a sample, exactly one of them is non-zero in a sample, so FM's sum of squares
is exact too. That holds for the rules with ``stripes_exact`` (FM, NFM's bi-interaction, the
linear sum, field rows, the first Dense). A first Dense holds the field's kernel rows on every
process (``DenseBlockSubOp.shared_block``): each multiplies its stripe's vector by them, and
their gradients are summed over processes before the update (des_ops.tail.sum_tail_gradients),
so every copy stays the same; by rows, each process's stripe is a block of its own, times its
copy. A kernel penalty (L1/L2) on that Dense counts the shared rows once, on the process of the
field's stripe 0 (``DenseBlockSubOp.penalized_shared``), in the penalty the step sums over processes.

A field looked up with P > 1 ids a sample (a bag of ids, pooled or not) has several non-zero
stripes in a sample. The rules linear in the field vector (``stripes_linear``: the linear sum, the
first Dense) take them as they are, and its rows go once per sample, not per distinct id (no one id
decides them). FM and NFM's bi-interaction (``sums_stripes_first``) would not be exact on their
squares (|a|^2 + |b|^2 is not |a + b|^2): each process sends its stripe's vector beside its
partials, k floats a sample more (``match.data["summed"]``), and the square is taken after the
sum over processes (des_ops.partials). A field read through anything but reshapes and poolings
after its lookup, or with several ids a sample by field rows, keeps one owner; the report says
why. Tables of Keras, TFRA and this project's FieldEmbedding (des.train's, keyed like TFRA's)
are split. A FieldEmbedding on [B, L] ids (maybe weighted, libsvm / libffm ``idx:val``) pools them
itself: its stripe is the table called with the other stripes' ids as the padding id, whose row
is zero (des_ops.stripes.MaskedStripe). A Keras table's L1/L2 penalty, a sum over rows, goes with its stripes (each
``StripeEmbedding`` holds its share; des.compiler.functional takes it into the penalty column).

    >>> import des
    >>> des.Options(stripe_min_rows=0).stripe_min_rows, des.Options().stripe_min_rows
    (0, 1000000)
"""
from __future__ import annotations

import dataclasses

from des.graph.fields import GLUE, FieldAnalysis, FieldVector, per_sample
from des.graph.ir import Graph
from des_ops.rows import unstriped
from rewrite_rules import Match, rule_named

# what may follow the lookup in a striped field vector's chain: linear in the rows, per sample
AFTER_LOOKUP = GLUE | {"reduce_sum", "reduce_mean"}


def why_not_striped(graph: Graph, fields: FieldAnalysis, match: Match, v: FieldVector) -> str | None:
    """Why field vector ``v`` of ``match`` cannot be split by key stripe, or None."""
    table = v.table
    refusal = rule_named(match.rule).stripes_refusal(match)
    if refusal:
        return refusal
    if graph.layer_calls(table.layer) != 1:
        return f"{table.layer.name!r} is called more than once"
    kind = fields.stripe_kind(table, penalty=True)
    if kind:
        return kind
    ids = ids_a_sample(graph, v)
    if ids is None:
        return f"{table.layer.name!r} does not look up a fixed number of integer ids a sample"
    shape = per_sample(graph, table.tensor_operands()[0])
    if per_sample(graph, table.output) != (*shape, table.attrs["dim"]) and not masks_its_ids(graph, table):
        # a stripe's lookup gives ids.shape + [dim]; des.train's tables pool their own and are masked instead
        return f"{table.layer.name!r} pools its ids itself (rows of per-sample shape {per_sample(graph, table.output)})"
    rule = rule_named(match.rule)
    if ids > 1 and not (rule.stripes_linear or rule.sums_stripes_first):
        return (f"{match.rule} at {match.root.layer.name!r} reads its {ids} ids a sample, and a field of several "
                f"ids a sample is split only where the linear sum, a first Dense, FM or a bi-interaction reads it")
    after = v.chain - fields.cone(table.output)
    odd = sorted({graph.nodes[i].kind for i in after} - AFTER_LOOKUP)
    if odd:
        return f"its vector is made from the lookup through {', '.join(odd)}"
    return None


def masks_its_ids(graph: Graph, table) -> bool:
    """True for des.train's table (models.layers.FieldEmbedding) on [B, L] ids, maybe with their
    [B, L] weights: it pools them itself, so its stripe is the table called on its own ids, the
    others masked as padding (des_ops.stripes.MaskedStripe), not a lookup of ids.shape + [dim]."""
    ops = table.tensor_operands()
    return table.attrs["source"].name == "FieldEmbedding" and len(ops) in (1, 2) and \
        len(graph.shape(ops[0])) == 2 and (len(ops) == 1 or per_sample(graph, ops[1]) == per_sample(graph, ops[0]))


def ids_a_sample(graph: Graph, v: FieldVector) -> int | None:
    """How many ids a sample the table of ``v`` looks up (1 for [B] or [B, 1] ids), or None when
    that is not a fixed number of integer ids."""
    ops = v.table.tensor_operands()
    ids = per_sample(graph, ops[0]) if len(ops) == 1 or masks_its_ids(graph, v.table) else None
    if ids is None or len(ids) > 1 or not graph.tensors[ops[0]].dtype.is_integer:
        return None
    if ids and not ids[0]:
        return None
    return ids[0] if ids else 1


def split_big_fields(graph: Graph, fields: FieldAnalysis, matches: list[Match], world_size: int,
                     min_rows: int | None, rows: dict[str, float]) -> tuple[list[Match], list[str]]:
    """``matches`` with the vectors of every field too big for one owner (``rows``: each field's
    rows, as the plan counts them) replaced by its N key stripes' vectors, and one report line per
    such field: split, or why it keeps one owner."""
    if min_rows is None or world_size < 2:
        return matches, []
    by_field: dict[str, list[tuple[Match, FieldVector]]] = {}
    for m in matches:
        for v in m.vectors:
            if v.key_range is None and v.key_stripe is None:
                by_field.setdefault(v.field, []).append((m, v))
    total = sum(rows.values())
    big = sorted((f for f in by_field if rows.get(f, 0.0) > total / world_size and rows.get(f, 0.0) >= min_rows),
                 key=lambda f: -rows[f])
    split, notes = set(), []
    for f in big:
        head = (f"field {f!r}: {rows[f]:,.0f} rows, more than an even share ({total:,.0f} / {world_size}) "
                f"and at least stripe_min_rows={min_rows:,}")
        why = next((w for m, v in by_field[f] if (w := why_not_striped(graph, fields, m, v))), None)
        if why:
            notes.append(f"{head}: kept whole by one owner, since {why}")
            continue
        split.add(f)
        tables = sorted({v.table.layer.name for _, v in by_field[f]})
        dense = sorted({m.root.layer.name for m, _ in by_field[f] if "parts" in m.data})
        penalized = sorted({m.root.layer.name for m, _ in by_field[f] if m.data.get("kernel_regularizer") is not None})
        ids = ids_a_sample(graph, by_field[f][0][1])
        summed = sorted({f"{m.rule} at {m.root.layer.name!r}" for m, _ in by_field[f]
                         if ids > 1 and rule_named(m.rule).sums_stripes_first})
        notes.append(f"{head}: {', '.join(tables)} split by key stripe over {world_size} processes (process r holds "
                     f"the keys k mod {world_size} == r and looks up only those)"
                     + (f"; every process holds its rows of the kernel of {', '.join(repr(d) for d in dense)}, their "
                        f"gradients summed each step" if dense else "")
                     + (f"; the kernel penalty of {', '.join(repr(d) for d in penalized)} counts them once, on "
                        f"the process of stripe 0" if penalized else "")
                     + (f"; {', '.join(summed)} square{'s' if len(summed) == 1 else ''} its {ids} ids a sample after "
                        f"the sum over processes" if summed else ""))
    if not split:
        return matches, notes
    out = []
    for m in matches:
        if not any(v.field in split for v in m.vectors):
            out.append(m)
            continue
        vectors, data = [], dict(m.data)
        for v in m.vectors:
            if v.field not in split:
                vectors.append(v)
                continue
            stripes = [FieldVector(v.tensor, v.table, f"{v.field}%{r}", v.width, v.chain, key_stripe=(r, world_size))
                       for r in range(world_size)]
            vectors += stripes
            if m.rule == "field_rows":        # one vector: its stripes' rows, keyed by its ids (des_ops.rows)
                data.update(stripes=world_size, stripe_keys=[unstriped(fields.row_key(stripes[0]))],
                            stripe_shape=(1, v.width))
            elif rule_named(m.rule).sums_stripes_first and ids_a_sample(graph, v) > 1:
                data["summed"] = [*data.get("summed", ()), v.field]     # squared after the sum over processes
        out.append(dataclasses.replace(m, vectors=vectors, data=data))
    return out, notes


def striped_tables(matches: list[Match]) -> dict[int, object]:
    """{table node index: table node} of every table split by key stripe (a table of several fields
    in one key space, or a field too big for one owner)."""
    return {v.table.index: v.table for m in matches for v in m.vectors if v.key_stripe is not None}

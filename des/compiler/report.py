"""What des.transform did to a model: the substitutions, the tables and why any was left as it
was, the field plan, the bytes per step and the options that applied (Report), and the error
a strict transform raises (TransformError)."""
from __future__ import annotations

import dataclasses

import tensorflow as tf

from des.compiler.options import Options
from des.compiler.cost import estimate
from des.graph.fields import GLUE, FieldAnalysis
from des.graph.ir import Graph, Node
from des.compiler.plan import FieldPlan
from des_ops.rows import bytes_per_step as rows_bytes_per_step, samples_bytes_per_step
from des_ops.wire import ring_share
from rewrite_rules import RULES, Match, Rejection


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
    costs: list = dataclasses.field(default_factory=list)   # des.compiler.cost.estimate(...), when known
    tables: list[str] = dataclasses.field(default_factory=list)      # one line per table
    unsubstituted: list[str] = dataclasses.field(default_factory=list)   # names of tables left as they were
    penalty_column: bool = False
    compiled: str = ""                # what became of the model's compile (a report line), if it was compiled
    opaque: list[str] = dataclasses.field(default_factory=list)   # subclassed models inside: why they were not read
    tail: str = "replicated"          # how the layers after the first one run (des_ops.tail)
    tail_reason: str = ""             # tail="auto": what des.compiler.cost.choose_tail weighed
    collectives: int = 1              # fused allreduces per step (one per tower when towers were transformed)
    micro_batches: int = 1            # slices of the batch, each with its own allreduce (DESFirstLayer)
    wire_dtype: str = "float32"       # the partials' type on the wire ("float16": half the bytes, not exact)
    by_rows: dict = dataclasses.field(default_factory=dict)   # first Dense layers by moving rows: name -> (widths, units)
    first_dense_reason: str = ""      # first_dense="auto": what des.compiler.cost.choose_first_dense weighed
    by_samples: list = dataclasses.field(default_factory=list)   # field rows by samples: widths by rank ([]: partials)
    distinct_keys: list = dataclasses.field(default_factory=list)   # inputs whose fields' rows travel once per id
    link: str = ""                  # what the auto choices assumed of the link, when it was measured at start
    communicator: str = ""          # which communicator the default one settled on, and why
    first_layer: str = "operators"  # "rows": no operator split, every field vector by samples
    first_layer_reason: str = ""
    field_rows_reason: str = ""       # data-parallel tail: what des.compiler.cost.choose_field_rows weighed
    options: Options | None = None    # what des.transform was asked (des.Options), printed with the report
    save_refusal: str = ""            # why model.save refuses (towers transformed one by one), else ""
    table_layout: str = ""            # the tables' layout this process used (des.Options.tables_for)
    row_policy: list = dataclasses.field(default_factory=list)   # which tables a des.RowPolicy bounds (lines)
    exchanges: list = dataclasses.field(default_factory=list)    # per field: owner, exchange, bytes (des.compiler.exchange)
    plan_note: str = ""               # the balanced plan: fields it could not size (empty tables, no sample=)
    big_fields: list = dataclasses.field(default_factory=list)   # fields too big for one owner (des.compiler.big_tables)
    mode: str = "des"                 # "ps": des.Options(mode=...) gave the model to a parameter server
    mode_reason: str = ""             # mode="auto" / "ps": what was weighed (des.jobs.auto.choose)

    @property
    def bytes_per_float(self) -> int:
        """Bytes of one partial on the wire: 4 (float32), 2 (float16)."""
        return tf.as_dtype(self.wire_dtype).size

    def estimate_costs(self, batch_size: int, unique_per_slice: dict[str, float]) -> list:
        """DES vs PS bytes per operator (des.compiler.cost); kept for printing with the report."""
        self.costs = estimate(self, batch_size, unique_per_slice)
        return self.costs

    @property
    def changed(self) -> bool:
        return bool(self.substitutions)

    def payload_bytes(self, batch_size: int) -> int:
        """Bytes handed to the fused allreduce(s) per step (float32 partials, or 16-bit ones), and
        to the forward collectives of a first Dense by rows and of field rows by samples (des_ops.rows):
        with ``distinct_keys``, at most (those rows travel once per distinct id, which the data decide)."""
        return self.bytes_per_float * batch_size * self.floats_per_sample + sum(
            rows_bytes_per_step(batch_size, widths, units, self.rank)[0] for widths, units in self.by_rows.values()) + (
            samples_bytes_per_step(batch_size, self.by_samples, self.rank)[0] if self.by_samples else 0)

    def ring_bytes(self, batch_size: int) -> float:
        """Analytic bytes sent per process per step: 2(N-1)/N x the payload of a ring allreduce, and
        of the field rows by samples the (N-1)/N that go to other processes (an all-to-all)."""
        n = self.world_size
        samples = samples_bytes_per_step(batch_size, self.by_samples, self.rank)[0] if self.by_samples else 0
        return ring_share(n) * (self.payload_bytes(batch_size) - samples) + (n - 1) / n * samples

    def _substitution_lines(self) -> list[str]:
        """The header and one line per substitution, collective and cost-model choice."""
        lines = [f"des.transform: {len(self.substitutions)} substitution(s), rank {self.rank} "
                 f"of {self.world_size}:"]
        rows = [m for m in self.substitutions if m.rule == "field_rows"]
        for m in self.substitutions:
            if m.rule != "field_rows":
                lines.append(f"  {m.rule:<20} at {m.root.layer.name!r}: {len(m.vectors)} field vectors, "
                             f"partial width {self.widths.get(m.root.layer.name, '?')}"
                             + (f", {len(m.others)} replicated input(s)" if m.others else ""))
        if rows:
            names = [m.vectors[0].table.layer.name for m in rows]
            shown = ", ".join(names if len(names) <= 4 else names[:3] + ["...", names[-1]])
            lines.append(f"  {'field_rows':<20} {len(rows)} table call(s) ({shown}) read by layers no rule "
                         f"splits: each owner's rows, {sum(_rows_width(m) for m in rows)} floats"
                         + (f", sent to their samples' processes by one all-to-all (widths {self.by_samples} by "
                            f"rank), not in the partials" if self.by_samples else ""))
        if self.penalty_column:
            lines.append("  + 1 float per sample for the weight penalties (regularizers) of owned tables "
                         "and kernel rows, so every process reports the whole loss")
        lines.append((f"  {self.collectives} allreduces (one per tower) of {self.floats_per_sample} floats per "
                      f"sample in all " if self.collectives > 1 else
                      f"  one fused allreduce of {self.floats_per_sample} floats per sample ")
                     + (f"and this process's {self.by_samples[self.rank]} floats per sample of field rows by "
                        f"all-to-all " if self.by_samples else "")
                     + (f"= {self.payload_bytes(1)} bytes/sample; at B=4096: " if not self.by_rows else
                        "and the first Dense's rows and kernel (below); at B=4096: ")
                     + f"{self.payload_bytes(4096):,} bytes handed over, "
                     f"{self.ring_bytes(4096):,.0f} sent per process (ring{', all-to-all' if self.by_samples else ''})")
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
        if self.link:
            lines.append(f"  {self.link}")
        if self.communicator:
            lines.append(f"  {self.communicator}")
        if self.first_layer == "rows":
            lines.append("  first layer by rows: no operator is split; every field vector's rows go to the "
                         "processes of its samples and the first layers run in the data-parallel tail")
        if self.first_layer_reason:
            lines.append(f"  first layer chosen by the cost model (first_layer='auto'): {self.first_layer_reason}")
        if self.tail_reason:
            lines.append(f"  tail chosen by the cost model (tail='auto'): {self.tail_reason}")
        for name, (widths, units) in self.by_rows.items():
            lines.append(f"  first Dense {name!r} by moving rows: each process sends the rows of its fields "
                         f"(widths {widths} by rank) to the processes of their samples and multiplies its "
                         f"samples' rows by the all-gathered kernel ({units} units); no partials for it")
        if self.distinct_keys:
            shown = ", ".join(self.distinct_keys[:6]) + (", ..." if len(self.distinct_keys) > 6 else "")
            lines.append(f"  rows that travel go once per distinct id and process for the fields of "
                         f"{len(self.distinct_keys)} id input(s) ({shown}); the receivers put them back at "
                         f"their samples (des.Options(distinct_rows=False): once per sample); the bytes above "
                         f"are the most they can be")
        if self.first_dense_reason:
            lines.append(f"  first Dense chosen by the cost model (first_dense='auto'): {self.first_dense_reason}")
        if self.field_rows_reason:
            lines.append(f"  field rows by the cost model: {self.field_rows_reason}")
        return lines

    def __str__(self) -> str:
        if self.mode == "ps":
            lines = [f"des.transform: a parameter server, rank {self.rank} of {self.world_size}: every table sharded "
                     f"by key, each process trains its rows of the global batch (des.baselines.ps.user)"]
        elif not self.substitutions:
            lines = ["des.transform: nothing to substitute; the model is returned unchanged."]
        else:
            lines = self._substitution_lines()
        if self.mode_reason:
            lines += [f"  {line}" for line in self.mode_reason.splitlines()]
        if self.compiled:
            lines.append(f"  {self.compiled}")
        lines += [str(c) for c in self.costs]
        for r in self.rejections:
            lines.append(f"  not substituted: {r}")
        lines += [f"  not read: {o}" for o in self.opaque]
        if self.tables:
            lines.append("tables:")
            lines += [f"  {t}" for t in self.tables]
        if self.big_fields:
            lines.append("fields too big for one owner:")
            lines += [f"  {t}" for t in self.big_fields]
        lines += self.row_policy
        if self.plan is not None:
            lines.append(str(self.plan))
            lines += [self.plan_note] if self.plan_note else []
        lines += self.exchanges if self.world_size > 1 else []
        if self.options is not None:
            lines.append(f"options: {self.options}" + (f" (tables: {self.table_layout})" if self.table_layout and
                                                      self.table_layout != self.options.tables else ""))
        return "\n".join(lines)


def _rows_width(m: Match) -> int:
    """Floats per sample of a field_rows match: its vector, or every position of a key-range split."""
    return sum(v.width for v in m.vectors) if "ranges" in m.data else m.vectors[0].width


def explain_tables(graph: Graph, fields: FieldAnalysis, matches: list[Match],
                   rejections: list[Rejection]) -> tuple[list[str], list[str]]:
    """One line per table: where it was substituted, or why not. Returns (lines, unsubstituted names)."""
    used: dict[int, list[str]] = {}
    striped: dict[int, int] = {}
    for m in matches:
        if "ranges" in m.data:          # one table, P fields as key ranges (rewrite_rules.field_rows)
            r = m.data["ranges"]
            used.setdefault(m.root.index, []).append(
                f"split by key range into {len(r)} fields ({m.vectors[0].field} .. {m.vectors[-1].field}: keys "
                f"[{r[0][0]}, {r[0][1]}) .. [{r[-1][0]}, {r[-1][1]})), each range's rows with its field's owner, "
                f"sent in {m.rule}")
            continue
        if "stripes" in m.data and "stripe_shape" not in m.data:   # one table, several fields in one key space
            used.setdefault(m.root.index, []).append(
                f"split by key stripe over {m.data['stripes']} processes (process r holds the keys k mod "
                f"{m.data['stripes']} == r: {m.vectors[0].field} .. {m.vectors[-1].field}), each looks up its own keys, "
                f"sent in {m.rule}")
            continue
        for v in m.vectors:
            said = f"{m.rule} at {m.root.layer.name!r}"
            if said not in used.get(v.table.index, []):     # a field's N key stripes: once
                used.setdefault(v.table.index, []).append(said)
            if v.key_stripe is not None:    # a field too big for one owner (des.compiler.big_tables)
                striped[v.table.index] = v.key_stripe[1]
    lines, left, groups = [], [], {}
    for n in graph.nodes:
        if n.kind != "table":
            continue
        src = n.attrs["source"]
        split = next((m for m in matches if "ranges" in m.data and m.root.index == n.index), None)
        head = f"{n.layer.name} ({src.name}, width {n.attrs['dim']}, " + (
            f"{len(split.vectors)} fields through offsets)" if split else f"field {fields.ids_input(n)!r})")
        if n.index in used:
            what = ", ".join(used[n.index])
            one_space = what.startswith("split by key stripe")
            what = ("substituted: " if what.startswith("split by key") else "substituted in ") + what
            if n.index in striped:
                what += (f"; split by key stripe over {striped[n.index]} processes (process r holds the keys k mod "
                         f"{striped[n.index]} == r)")
            if split is None and not one_space and fields.offset_fields(n):     # ids + offsets, not split by key
                what += (f"; one owner holds all {fields.offset_fields(n)} fields (not split by key range: "
                         f"{fields.offset_ranges(n)})")
            groups.setdefault((src.name, n.attrs["dim"], what), []).append(head)
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

"""Field plan: which process owns which field (its tables, slots and kernel rows).

    >>> plan = make_plan([FieldCost("C1", rows=1e6, width=9), FieldCost("C2", rows=10, width=9)], 2)
    >>> plan.owner
    {'C1': 0, 'C2': 1}

``mod``: field i -> process i mod N (the DES paper). ``balanced`` (default): longest
processing time first over cost = rows*width (memory, optimizer work) normalised, plus
lookups*width (compute per batch) normalised. Rows: the spec's cardinality, else the table's;
an empty TFRA table's, its distinct ids in des.transform's ``sample=`` batch. N may exceed the number of fields; idle
processes own nothing and contribute zeros.
"""
from __future__ import annotations

import dataclasses
import json

from des_ops.comm import agree


@dataclasses.dataclass(frozen=True)
class FieldCost:
    name: str
    rows: float = 1.0      # expected distinct ids
    width: int = 1         # floats per row, summed over the field's tables
    lookups: float = 1.0   # ids per sample


@dataclasses.dataclass
class FieldPlan:
    world_size: int
    owner: dict[str, int]
    strategy: str
    costs: dict[str, float] = dataclasses.field(default_factory=dict)

    def fields_of(self, rank: int) -> list[str]:
        return [f for f, r in self.owner.items() if r == rank]

    def load(self, rank: int) -> float:
        return sum(self.costs.get(f, 0.0) for f in self.fields_of(rank))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @staticmethod
    def from_json(text: str) -> "FieldPlan":
        return FieldPlan(**json.loads(text))

    def __str__(self) -> str:
        lines = [f"field plan ({self.strategy}, {self.world_size} processes):"]
        for r in range(self.world_size):
            fs = self.fields_of(r)
            shown = ", ".join(fs[:12]) + (f", ... ({len(fs)} fields)" if len(fs) > 12 else "")
            lines.append(f"  rank {r}: load {self.load(r):.3f}  [{shown or 'no fields: contributes zeros'}]")
        return "\n".join(lines)


def make_plan(fields: list[FieldCost], world_size: int, strategy: str = "balanced") -> FieldPlan:
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    mem_total = sum(f.rows * f.width for f in fields) or 1.0
    cpu_total = sum(f.lookups * f.width for f in fields) or 1.0
    costs = {f.name: f.rows * f.width / mem_total + f.lookups * f.width / cpu_total for f in fields}
    if strategy == "mod":
        owner = {f.name: i % world_size for i, f in enumerate(fields)}
    elif strategy == "balanced":
        load = [0.0] * world_size
        owner = {}
        for f in sorted(fields, key=lambda f: -costs[f.name]):   # stable: ties keep field order
            r = min(range(world_size), key=lambda r: (load[r], r))
            owner[f.name] = r
            load[r] += costs[f.name]
        owner = {f.name: owner[f.name] for f in fields}
    else:
        raise ValueError(f"unknown plan strategy {strategy!r}: use 'balanced' or 'mod'")
    return FieldPlan(world_size, owner, strategy, costs)


def check_agreement(plan: FieldPlan, comm) -> None:
    """Every process must partition the fields the same way (a plan computed from local table
    sizes, or read per process on restore, could differ): a process whose plan differs from
    rank 0's raises des_ops.comm.DisagreementError naming both (under mpirun that ends the job).
    To pass: the same plan=/spec= (cardinalities) or the same checkpoint on every process."""
    agree(comm, "field plan", ", ".join(f"{f} -> {r}" for f, r in sorted(plan.owner.items())))

"""What each field's tables put on the wire, for des.transform's report: its owner, how its rows
travel (partials of the operators that read them, or rows to the processes of their samples), the
bytes a step on the ``sample=`` batch, and the choice behind it.

    >>> import numpy as np
    >>> f = FieldTraffic("user", 1, ["emb_user"], rows_width=4, key="user")
    >>> ids = {"user": np.array([7, 7, 9, 7, 8, 8])}                         # slices [0, 3) and [3, 6)
    >>> f.rows_sent(ids, 6, 2)                     # rank 1 sends rank 0's slice: 2 distinct ids x 4 floats x 4 B
    32
    >>> f.line(32)
    "user (rank 1; emb_user): rows to its samples' processes, 4 floats a row, once per distinct id: 32 B a step out, as many back"
"""
from __future__ import annotations

import dataclasses

import numpy as np

from des_ops.comm import shard_rows
from des_ops.rows import key_ids


@dataclasses.dataclass
class FieldTraffic:
    """One field: its ``owner``, its ``tables``, the floats per sample of its vectors whose rows travel
    (``rows_width``; 0: none) and the input that decides them (``key``: once per distinct id, else None:
    once per sample), and the operators whose partials it feeds (``partials``: "rule at 'layer'")."""
    field: str
    owner: int
    tables: list[str]
    rows_width: int = 0
    key: str | None = None
    partials: list[str] = dataclasses.field(default_factory=list)
    position_keys: list[str] = dataclasses.field(default_factory=list)   # a key stripe's: one per equal block

    def _rows_of(self, sample: dict | None, key: str | None, lo: int, hi: int) -> int | None:
        if key is None:
            return hi - lo
        try:
            return len(np.unique(np.asarray(key_ids(sample or {}, key)).reshape(-1)[lo:hi]))
        except KeyError:
            return None

    def rows_sent(self, sample: dict | None, batch: int, world_size: int) -> int | None:
        """Bytes its owner sends forward a step: its rows of the other processes' slices (the
        gradients come back in as many); None without the ids a keyed field needs."""
        if not self.rows_width:
            return 0
        keys = self.position_keys or [self.key]
        floats = 0
        for q in range(world_size):
            if q == self.owner:
                continue
            lo, hi = shard_rows(batch, q, world_size)
            for key in keys:
                rows = self._rows_of(sample, key, lo, hi)
                if rows is None:
                    return None
                floats += rows * (self.rows_width // len(keys))
        return 4 * floats

    def line(self, sent: int | None) -> str:
        """The report's line; ``sent``: rows_sent's bytes (None: not known)."""
        parts = []
        if self.rows_width:
            once = ("its keys' rows once per distinct id of each position" if self.position_keys else
                    "once per distinct id" if self.key else "once per sample")
            parts.append(f"rows to its samples' processes, {self.rows_width} floats a row, {once}"
                         + (f": {sent:,} B a step out, as many back" if sent is not None else ""))
        if self.partials:
            parts.append("in the partials of " + ", ".join(self.partials))
        return f"{self.field} (rank {self.owner}; {', '.join(self.tables)}): {'; '.join(parts)}"


def exchange_lines(traffic: list[FieldTraffic], sample: dict | None, world_size: int, why: list[str],
                   shown: int = 12) -> list[str]:
    """The report's section: a line per field, the most bytes first (``shown`` of them, then the
    rest summed), and the choices' reasons (``why``)."""
    batch = None
    if sample:
        batch = int(np.asarray(next(iter(sample.values()))).shape[0])
    sent = {t.field: t.rows_sent(sample, batch, world_size) if batch else None for t in traffic}
    sizes = {f: b or 0 for f, b in sent.items()}
    order = sorted(traffic, key=lambda t: -sizes[t.field])
    head = ("exchange per field (bytes a step its owner sends, on the sample batch of "
            f"{batch} rows at N = {world_size}):" if batch else
            "exchange per field (pass sample=<a global batch> to des.transform for bytes a step):")
    lines = [head] + [f"  {t.line(sent[t.field])}" for t in order[:shown]]
    rest = order[shown:]
    if rest:
        lines.append(f"  ... {len(rest)} more field(s)" + (f": {sum(sizes[t.field] for t in rest):,} B a step of rows"
                                                           if batch else ""))
    lines += [f"  why: {w}" for w in why if w]
    return lines

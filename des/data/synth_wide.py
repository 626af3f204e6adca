"""The "wide" preset: ~950 active features per sample in libffm, the DES paper's regime.

26 single-valued fields (Criteo-like cardinalities) and 20 multi-valued fields with 30..62
values each (uniform), written as ``label field:idx:val``. A multi-valued field's values
carry the weight 1/sqrt(count) (a normalised bag, like TF-IDF features), singles weight 1.
Labels come from a planted LR + field-level FM over the weighted, pooled field vectors -
the same form the reference models have - so the Bayes-optimal AUC is known.

    python -m des.data.synth --preset wide --rows 20000 --out data/wide/train.ffm
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np

from des.data.bayes import BayesStats, zipf_cdf
from des.data.libsvm import sparse_spec


@dataclasses.dataclass
class WidePreset:
    single_card: list[int]
    multi_card: list[int]
    min_len: int = 30
    max_len: int = 62
    zipf: float = 1.05
    k: int = 4
    w_scale: float = 0.15
    v_scale: float = 0.15
    bias: float = -1.2
    missing: float = 0.05


WIDE = WidePreset(single_card=[5, 20, 100, 500, 2000, 10000, 50000] * 3 + [3, 30, 300, 3000, 30000],
                  multi_card=[1000, 5000, 20000, 100000] * 5)


class WideGenerator:
    def __init__(self, preset: WidePreset = WIDE, seed: int = 0):
        self.p, self.seed = preset, seed
        rng = np.random.default_rng([seed, 11])
        cards = preset.single_card + preset.multi_card
        self.cdf = [zipf_cdf(c, preset.zipf) for c in cards]
        self.w = [rng.normal(0, preset.w_scale, c) for c in cards]
        self.v = [rng.normal(0, preset.v_scale, (c, preset.k)) for c in cards]

    @property
    def n_single(self) -> int:
        return len(self.p.single_card)

    def max_lens(self) -> list[int]:
        return [1] * self.n_single + [self.p.max_len] * len(self.p.multi_card)

    def chunk(self, rows: int, rng: np.random.Generator):
        """(label [n], per field (idx [n, L], weight [n, L], present [n, L]), prob [n])."""
        p = self.p
        logit = np.full(rows, p.bias)
        s = np.zeros((rows, p.k))
        q = np.zeros(rows)
        fields = []
        for j, cdf in enumerate(self.cdf):
            width = 1 if j < self.n_single else p.max_len
            idx = np.minimum(np.searchsorted(cdf, rng.random((rows, width))), len(cdf) - 1)
            if j < self.n_single:
                present = rng.random((rows, 1)) >= p.missing
                wt = present.astype(np.float64)
            else:
                count = rng.integers(p.min_len, p.max_len + 1, rows)
                present = np.arange(width)[None, :] < count[:, None]
                wt = np.where(present, np.round(1.0 / np.sqrt(count), 4)[:, None], 0.0)
            logit += (self.w[j][idx] * wt).sum(1)
            pooled = (self.v[j][idx] * wt[..., None]).sum(1)
            s += pooled
            q += (pooled ** 2).sum(1)
            fields.append((idx, wt, present))
        logit += 0.5 * ((s ** 2).sum(1) - q)
        prob = 1 / (1 + np.exp(-logit))
        label = (rng.random(rows) < prob).astype(np.int64)
        return label, fields, prob


def _lines(label, fields) -> list[str]:
    """libffm text of a chunk: one join per (row, field), string pieces looked up, not formatted."""
    n = len(label)
    pieces = [label.astype(str).tolist()]
    for j, (idx, wt, present) in enumerate(fields):
        names = np.arange(int(idx.max()) + 1).astype(str).astype(object)
        if idx.shape[1] == 1:
            tok = np.char.add(f"{j}:", names.astype(str)).astype(object)
            tok = np.char.add(tok.astype(str), ":1").astype(object)[idx[:, 0]]
            pieces.append(np.where(present[:, 0], tok, None).tolist())
            continue
        count = present.sum(1)
        col = []
        for i in range(n):
            w = f"{wt[i, 0]:.4g}"
            col.append(f"{j}:" + f":{w} {j}:".join(names[idx[i, :count[i]]]) + f":{w}" if count[i] else None)
        pieces.append(col)
    return [" ".join(t for t in row if t is not None) for row in zip(*pieces)]


def write_wide(path: str, rows: int, seed: int = 0, chunk: int = 2000, quiet: bool = False,
               sample_seed: int | None = None) -> dict:
    """Write ``rows`` libffm lines; return (and save as <path>.meta.json) the metadata with the spec."""
    gen = WideGenerator(WIDE, seed)
    sample_seed = seed if sample_seed is None else sample_seed  # rows; seed: the planted model
    rng = np.random.default_rng([sample_seed, 12])
    stats = BayesStats()
    active = 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            label, fields, prob = gen.chunk(n, rng)
            stats.add(prob)
            active += sum(int(pr.sum()) for _, _, pr in fields)
            fh.write("\n".join(_lines(label, fields)) + "\n")
    os.replace(tmp, path)
    cards = WIDE.single_card + WIDE.multi_card
    spec = sparse_spec("F", gen.max_lens(), dim=8)
    spec = spec.with_cardinalities({f.name: c for f, c in zip(spec, cards)})
    meta = {"format": "libffm", "preset": "wide", "seed": seed, "sample_seed": sample_seed, "rows": rows,
            "bayes_auc": round(stats.auc(), 6), "bayes_logloss": round(stats.logloss(), 6),
            "active_features_per_sample": round(active / max(rows, 1), 1),
            "cardinalities": {f.name: c for f, c in zip(spec, cards)},
            "spec": json.loads(spec.to_json())}
    with open(path + ".meta.json", "w") as fh:
        json.dump(meta, fh, indent=1)
    if not quiet:
        print(f"wrote {rows} rows to {path} ({meta['active_features_per_sample']} active features per "
              f"sample): Bayes-optimal AUC {meta['bayes_auc']:.4f}, log loss {meta['bayes_logloss']:.4f}",
              file=sys.stderr)
    return meta

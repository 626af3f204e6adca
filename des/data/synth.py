"""Seeded synthetic CTR data in the real file formats, with a planted model.

Labels are Bernoulli(sigmoid(bias + sum_f w_f(x_f) + FM(x))), so the Bayes-optimal AUC and
log loss of the data are known; they are printed and written to ``<path>.meta.json``.
Values per field are Zipf-skewed over a given cardinality, with missing values. Rows are
generated and written in chunks, so millions of rows stream to disk in bounded memory.

    python -m des.data.synth --preset criteo-like --rows 200000 --out data/train.txt
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import numpy as np

from des.data.bayes import BayesStats, zipf_cdf
from des.data.synth_wide import write_wide
from models.spec import CRITEO_CAT, CRITEO_INT


@dataclasses.dataclass
class Preset:
    int_card: list[int]     # cardinality of each integer field (values 0..card-1, some -1)
    cat_card: list[int]     # cardinality of each categorical field
    missing: float = 0.05   # chance that a value is missing
    zipf: float = 1.1       # skew of value frequencies
    k: int = 4              # width of the planted FM factors
    w_scale: float = 0.15   # std of planted linear weights
    v_scale: float = 0.12   # std of planted FM factors
    bias: float = -1.2


PRESETS = {
    "criteo-like": Preset(int_card=[10, 30, 100, 300, 1000] * 2 + [20, 50, 200],
                          cat_card=[5, 20, 100, 500, 2000, 10000, 50000] * 3 + [3, 30, 300, 3000, 30000]),
    "tiny": Preset(int_card=[5] * 13, cat_card=[20] * 26, k=2),
    # criteo-like with C26 of 1,000,000 values (about 80% of all fields' values, as Criteo's largest
    # fields dominate its own): one field too big for one owner (des.compiler.big_tables)
    "criteo-big-field": Preset(int_card=[10, 30, 100, 300, 1000] * 2 + [20, 50, 200],
                               cat_card=[5, 20, 100, 500, 2000, 10000, 50000] * 3 + [3, 30, 300, 3000, 999_999]),
}


def _log_bucket(v: np.ndarray) -> np.ndarray:
    out = v.copy()
    big = v > 2
    out[big] = np.floor(np.log(v[big].astype(np.float64)) ** 2).astype(np.int64)
    return out


class CriteoGenerator:
    """Criteo-format rows from a planted LR + FM model over (field, value) features."""

    def __init__(self, preset: Preset, seed: int = 0):
        self.p, self.seed = preset, seed
        rng = np.random.default_rng([seed, 1])
        self.cdf = [zipf_cdf(c, preset.zipf) for c in preset.int_card + preset.cat_card]
        # planted weights per field and value index; index card = missing
        sizes = [max(int(_log_bucket(np.array([c]))[0]), c) + 3 for c in preset.int_card] + \
                [c + 1 for c in preset.cat_card]
        self.w = [rng.normal(0, preset.w_scale, s) for s in sizes]
        self.v = [rng.normal(0, preset.v_scale, (s, preset.k)) for s in sizes]
        self.salt = rng.integers(1, 2**31, len(preset.cat_card))

    def chunk(self, rows: int, rng: np.random.Generator):
        """(label [n], int values [n,13] with None for missing, cat hex [n,26], p [n])."""
        p, nf_int = self.p, len(self.p.int_card)
        logit = np.full(rows, p.bias)
        s = np.zeros((rows, p.k))
        q = np.zeros(rows)
        ints, cats = [], []
        for j, cdf in enumerate(self.cdf):
            r = np.minimum(np.searchsorted(cdf, rng.random(rows)), len(cdf) - 1)
            miss = rng.random(rows) < p.missing
            if j < nf_int:
                val = r - 1  # -1 occurs, like Criteo
                idx = np.where(miss, len(self.w[j]) - 1, _log_bucket(val) + 1)
                ints.append(np.where(miss, "", val.astype(str)))
            else:
                idx = np.where(miss, len(self.w[j]) - 1, r)
                h = (r.astype(np.uint64) * np.uint64(2654435761) + np.uint64(self.salt[j - nf_int])) % np.uint64(2**32)
                cats.append(np.where(miss, "", np.char.mod("%08x", h)))
            logit += self.w[j][idx]
            vj = self.v[j][idx]
            s += vj
            q += (vj ** 2).sum(1)
        logit += 0.5 * ((s ** 2).sum(1) - q)
        prob = 1 / (1 + np.exp(-logit))
        label = (rng.random(rows) < prob).astype(np.int64)
        return label, np.stack(ints, 1), np.stack(cats, 1), prob


def write_criteo(path: str, rows: int, preset: str = "criteo-like", seed: int = 0,
                 with_label: bool = True, chunk: int = 50_000, quiet: bool = False,
                 sample_seed: int | None = None) -> dict:
    """Write ``rows`` lines in Criteo TSV; return (and save as <path>.meta.json) the metadata.

    ``seed`` fixes the planted model, ``sample_seed`` (default: ``seed``) the rows drawn from
    it: the same seed with another sample_seed gives an independent test set of the same task.
    """
    gen = CriteoGenerator(PRESETS[preset], seed)
    sample_seed = seed if sample_seed is None else sample_seed
    rng = np.random.default_rng([sample_seed, 2])
    stats = BayesStats()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        for start in range(0, rows, chunk):
            n = min(chunk, rows - start)
            label, ints, cats, prob = gen.chunk(n, rng)
            stats.add(prob)
            cols = ([label.astype(str)] if with_label else []) + list(ints.T) + list(cats.T)
            fh.write("\n".join("\t".join(r) for r in zip(*cols)) + "\n")
    os.replace(tmp, path)
    meta = {"format": "criteo" if with_label else "criteo-test", "preset": preset, "seed": seed,
            "sample_seed": sample_seed, "rows": rows, "bayes_auc": round(stats.auc(), 6), "bayes_logloss": round(stats.logloss(), 6),
            "cardinalities": dict(zip(CRITEO_INT + CRITEO_CAT,
                                      [c + 1 for c in gen.p.int_card + gen.p.cat_card]))}
    with open(path + ".meta.json", "w") as fh:
        json.dump(meta, fh, indent=1)
    if not quiet:
        print(f"wrote {rows} rows to {path}: Bayes-optimal AUC {meta['bayes_auc']:.4f}, "
              f"log loss {meta['bayes_logloss']:.4f}", file=sys.stderr)
    return meta


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="criteo-like", choices=sorted(PRESETS) + ["wide"],
                    help="criteo-like / tiny: Criteo TSV; wide: libffm, ~950 active features per sample")
    ap.add_argument("--rows", type=int, default=100_000)
    ap.add_argument("--seed", type=int, default=0, help="the planted model (and, by default, the rows)")
    ap.add_argument("--sample-seed", type=int, default=None,
                    help="the rows drawn from the planted model: another value gives a test set of the same task")
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-label", action="store_true", help="write test.txt layout (39 columns)")
    a = ap.parse_args(argv)
    if a.preset == "wide":
        if a.no_label:
            ap.error("--no-label applies to the Criteo layout only")
        write_wide(a.out, a.rows, a.seed, sample_seed=a.sample_seed)
        return
    write_criteo(a.out, a.rows, a.preset, a.seed, with_label=not a.no_label, sample_seed=a.sample_seed)


if __name__ == "__main__":
    main()

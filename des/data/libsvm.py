"""libsvm (``label idx:val ...``) and libffm (``label field:idx:val ...``) text, vectorised.

Labels are 0/1 or -1/+1 (-1 reads as 0), one convention per file: a file's first 0 or -1
label fixes it, and a line with the other stops the reader (file:line) or is skipped. Every field of the FeatureSpec is a weighted
multi-valued field: ids [B, max_len] (PAD_ID after the last one) and weights [B, max_len]
(``val``; 0 at padding). Which field a feature belongs to:

- libffm: ``field`` is the index of the spec's field (0-based), so ``3:1022:1`` is in the
  fourth field; a field may hold several features on one line.
- libsvm, ``layout="positional"``: the k-th feature of a line is in the k-th field (Frappe,
  iPinYou: one feature per field, in field order); ``layout="bag"``: every feature is in the
  spec's one field (generic libsvm such as a9a).

An id is the stable hash of (field name, idx). Bad lines (label, token syntax, a field index
outside the spec, more features than a field's max_len, bytes that are not UTF-8) are
flagged for the reader, which stops or skips and counts them.

    >>> import os, shutil, tempfile
    >>> from des.data.readers import make_dataset
    >>> tmp = tempfile.mkdtemp(); path = os.path.join(tmp, "train.ffm")
    >>> with open(path, "w") as fh:
    ...     _ = fh.write("+1 0:5:1 1:7:1\\n-1 0:6:1 1:7:0.5 1:8:1\\n-1 0:5:1\\n")
    >>> spec = scan_spec([path], "libffm", dim=8)     # fields and max_len from the data
    >>> [(f.name, f.kind, f.max_len) for f in spec]
    [('F0', 'multi', 1), ('F1', 'multi', 2)]
    >>> ds = make_dataset([path], "libffm", spec, batch_size=1024)
    >>> x, y = next(iter(ds))
    >>> x["F1_weight"].numpy(), y.numpy()                   # 0 at padding; label -1 reads as 0
    (array([[1. , 0. ],
           [0.5, 1. ],
           [0. , 0. ]], dtype=float32), array([1., 0., 0.], dtype=float32))
    >>> shutil.rmtree(tmp)
"""
from __future__ import annotations

import re
from typing import Sequence

import numpy as np
import tensorflow as tf

from des.data.errors import DataError
from des.data.files import check_paths
from des.data.hashing import SEP, hash_ids
from des.data.text import TextParser, utf8_ok
from models.spec import PAD_ID, FeatureSpec, Field

NUM_RE = r"[-+]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][-+]?[0-9]{1,3})?"
LABEL_RE = r"0|1|-1|\+1"
FIELD_RE = r"[0-9]{1,6}"
IDX_RE = r"[^:\s]+"


def _rank_within_runs(keys: tf.Tensor) -> tf.Tensor:
    """For each element, how many earlier elements have the same key (keys in any order)."""
    n = tf.size(keys, tf.int64)
    order = tf.argsort(keys, stable=True)
    sk = tf.gather(keys, order)
    start = tf.concat([[True], sk[1:] != sk[:-1]], 0)
    pos_in_sorted = tf.range(n) - tf.gather(tf.boolean_mask(tf.range(n), start),
                                            tf.cumsum(tf.cast(start, tf.int64)) - 1)
    return tf.scatter_nd(tf.cast(order, tf.int64)[:, None], pos_in_sorted, [n])


class _SparseText(TextParser):
    """Shared parsing; subclasses say how tokens look and which (field, pos) each is in."""

    header = None
    token_re = ""
    # labels that fix a file's convention: a file reads 0/1 or -1/+1, never both
    label_conventions = {"0": "0/1", "-1": "-1/+1"}

    def __init__(self, spec: FeatureSpec):
        self.spec = spec
        self.fields = spec.sparse()
        for f in self.fields:
            if not (f.kind == "multi" and f.weighted):
                raise ValueError(f"{type(self).__name__.lower()} fields must be weighted multi-valued; "
                                 f"field {f.name!r} is {f.kind}")
        self.max_len = [f.max_len for f in self.fields]
        self.lmax = max(self.max_len)

    def line_re(self) -> str:
        return f"({LABEL_RE})( {self.token_re})*"

    def place(self, cols, row, row_starts):  # -> (field int64 [n], idx string [n], pos int64 [n] or None)
        raise NotImplementedError

    def count_ok(self, counts: tf.Tensor) -> tf.Tensor:
        """Whether a line may have this many features (bool per line)."""
        return tf.ones_like(counts, tf.bool)

    def count_problem(self, n: int) -> str | None:
        return None

    def parse(self, lines):
        """Validate whole lines with one RE2 pass, split the good ones on single spaces, and
        decode the ``:``-separated tokens with decode_csv (the costly steps run in C++ once per
        byte or token; about 3x faster than a regex and a split per token)."""
        b = tf.shape(lines, out_type=tf.int64)[0]
        lines = tf.strings.strip(lines)
        single_spaced = tf.reduce_all(tf.strings.regex_full_match(lines, r"\S*( \S+)*"))
        lines = tf.cond(single_spaced, lambda: lines, lambda: tf.strings.regex_replace(lines, r"\s+", " "))
        syntax_ok = tf.strings.regex_full_match(lines, self.line_re()) & utf8_ok(lines)
        toks = tf.strings.split(tf.where(syntax_ok, lines, "0"), " ")  # every row: label, tokens
        label_s = tf.gather(toks.flat_values, toks.row_starts())
        feats = toks[:, 1:]
        flat, row, row_starts = feats.flat_values, feats.value_rowids(), feats.row_starts()
        cols = tf.io.decode_csv(flat, self.record_defaults, field_delim=":", use_quote_delim=False)
        field, idx, pos = self.place(cols, row, row_starts)
        val = cols[-1]
        nf = len(self.fields)
        max_len = tf.gather(tf.constant(self.max_len, tf.int64), tf.clip_by_value(field, 0, nf - 1))
        if pos is None:     # libffm: a token's position is its rank among its line's tokens of its field
            group = row * (nf + 1) + tf.clip_by_value(field, 0, nf)
            count = tf.math.unsorted_segment_sum(tf.ones_like(group), group, b * (nf + 1))
            fits = (field < nf) & (tf.gather(count, group) <= max_len)     # every rank < max_len
        else:
            fits = (field < nf) & (pos < max_len)
        row_fits = tf.math.unsorted_segment_min(tf.cast(fits, tf.int32), row, b) > 0  # no tokens: ok
        finite = tf.math.unsorted_segment_min(tf.cast(tf.math.is_finite(cols[-1]), tf.int32), row, b) > 0
        ok = syntax_ok & row_fits & finite & self.count_ok(feats.row_lengths())
        label = tf.cast(tf.strings.regex_full_match(label_s, r"1|\+1"), tf.float32)
        keep = tf.gather(ok, row)
        if self.wanted is not None:          # only the wanted fields' tokens are hashed and placed
            read = tf.constant([self.reads(f.name) or self.reads(f.weight_name) for f in self.fields])
            keep &= tf.gather(read, tf.clip_by_value(field, 0, nf - 1))
        names = tf.constant([f"{f.name}{SEP}" for f in self.fields])
        field_k, idx_k, row_k = [tf.boolean_mask(t, keep) for t in (field, idx, row)]
        # ranks among the kept tokens only: a (line, field) group is kept or dropped whole
        pos_k = tf.boolean_mask(pos, keep) if pos is not None else _rank_within_runs(row_k * (nf + 1) + field_k)
        ids = hash_ids(tf.strings.join([tf.gather(names, field_k), idx_k]))
        where = tf.stack([row_k, field_k, pos_k], 1)
        shape = tf.stack([b, nf, self.lmax])
        ids3 = tf.tensor_scatter_nd_update(tf.fill(shape, tf.constant(PAD_ID, tf.int64)), where, ids)
        w3 = tf.tensor_scatter_nd_update(tf.zeros(shape, tf.float32), where, tf.boolean_mask(val, keep))
        feats = {}
        for j, f in enumerate(self.fields):
            feats[f.name] = ids3[:, j, :f.max_len]
            feats[f.weight_name] = w3[:, j, :f.max_len]
        return feats, label, tf.logical_not(ok)

    def diagnose(self, line: bytes) -> str:
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            return f"undecodable bytes (not UTF-8) at byte {e.start}"
        toks = text.split()
        if not toks:
            return "empty line (no label)"
        if not re.fullmatch(LABEL_RE, toks[0]):
            return f"label {toks[0]!r} is not 0/1 or -1/+1"
        counts: dict[int, int] = {}
        for k, t in enumerate(toks[1:]):
            if not re.fullmatch(self.token_re, t):
                head, _, value = t.rpartition(":")
                if head and re.fullmatch(self.token_re, f"{head}:0") and _not_finite(value):
                    return f"value {value!r} of feature {k + 1} {t!r} is not finite"
                return f"feature {k + 1} {t!r} is not {self.syntax}"
            j = self.field_of(t, k)
            if j >= len(self.fields):
                return self.too_many(t, k)
            counts[j] = counts.get(j, 0) + 1
            if counts[j] > self.fields[j].max_len:
                return (f"field {self.fields[j].name!r} has more than {self.fields[j].max_len} "
                        f"features (the spec's max_len)")
            value = t.rsplit(":", 1)[1]
            with np.errstate(over="ignore"):                # 1e39: no RuntimeWarning before the message
                finite = np.isfinite(np.float32(float(value)))
            if not finite:
                return f"value {value!r} of feature {k + 1} {t!r} is not a finite float32"
        return self.count_problem(len(toks) - 1) or "line rejected by the parser"


def _not_finite(text: str) -> bool:
    """'nan', 'inf', '-Infinity': a float that is not finite."""
    try:
        return not np.isfinite(float(text))
    except ValueError:
        return False


class Libffm(_SparseText):
    """``label field:idx:val ...``; ``field`` indexes the spec's fields."""
    token_re = f"{FIELD_RE}:{IDX_RE}:{NUM_RE}"
    syntax = "field:idx:val"

    @property
    def record_defaults(self) -> list:      # a property: a tensor made at import would start TensorFlow
        return [[tf.constant(0, tf.int64)], [""], [0.0]]

    def place(self, cols, row, row_starts):
        return cols[0], cols[1], None           # positions: ranks within (line, field), by parse

    def field_of(self, token: str, k: int) -> int:
        return int(token.split(":")[0])

    def too_many(self, token: str, k: int) -> str:
        return f"field index {self.field_of(token, k)} in {token!r} is outside the spec's {len(self.fields)} fields"


class Libsvm(_SparseText):
    """``label idx:val ...``: positional fields, or one bag field (see the module docstring)."""
    token_re = f"{IDX_RE}:{NUM_RE}"
    record_defaults = [[""], [0.0]]
    syntax = "idx:val"

    def __init__(self, spec: FeatureSpec, layout: str | None = None):
        super().__init__(spec)
        self.layout = layout or ("bag" if len(self.fields) == 1 and self.fields[0].max_len > 1 else "positional")
        if self.layout not in ("positional", "bag"):
            raise ValueError(f"libsvm layout must be 'positional' or 'bag', got {self.layout!r}")
        if self.layout == "bag" and len(self.fields) != 1:
            raise ValueError("the libsvm bag layout needs a spec with exactly one field")

    def place(self, cols, row, row_starts):
        k = tf.range(tf.size(row, tf.int64)) - tf.gather(row_starts, row)
        if self.layout == "bag":
            return tf.zeros_like(k), cols[0], k
        return k, cols[0], tf.zeros_like(k)

    def field_of(self, token: str, k: int) -> int:
        return 0 if self.layout == "bag" else k

    def count_ok(self, counts):
        if self.layout == "bag":
            return super().count_ok(counts)
        return tf.equal(counts, len(self.fields))          # a missing feature would shift the later ones

    def count_problem(self, n: int) -> str | None:
        if self.layout == "positional" and n != len(self.fields):
            return (f"the line has {n} features; the positional libsvm layout needs exactly one per field "
                    f"({len(self.fields)}), else later features would land in the wrong fields")
        return None

    def too_many(self, token: str, k: int) -> str:
        return f"the line has more than {len(self.fields)} features (one per field of the spec)"


def sparse_spec(name_prefix: str, max_lens: Sequence[int], dim: int) -> FeatureSpec:
    """Weighted multi-valued fields ``<prefix>0..`` with the given max_len each."""
    return FeatureSpec(tuple(Field(f"{name_prefix}{j}", "multi", dim, max_len=max(1, int(m)), weighted=True)
                             for j, m in enumerate(max_lens)))


def scan_spec(paths: Sequence[str], fmt: str, dim: int = 8, layout: str | None = None,
              batch_lines: int = 65536) -> FeatureSpec:
    """One pass over the files: the fields and the largest number of features per field.

    libffm -> fields F0..F{max field}; every field id from 0 to the largest must occur (a gap,
    e.g. ``9:3:1`` among fields 0-2, stops with the file and line that has it). libsvm:
    ``layout="positional"`` -> F0..F{max features per line - 1} (max_len 1); ``"bag"`` -> one
    field ``features``; ``None`` (auto): positional when every line has the same number of
    features, and otherwise it stops, naming the first line whose count differs from the most
    common one, rather than guess (pass the layout). Malformed tokens are ignored here (the
    reader reports them).
    """
    paths = check_paths(paths)
    if layout not in (None, "auto", "positional", "bag"):
        raise ValueError(f"libsvm layout must be auto, positional or bag, got {layout!r}")
    per_field = np.zeros(0, np.int64)
    counts_seen: dict[int, list] = {}            # features per line -> [lines, first (path, line)]
    field_seen: dict[int, tuple] = {}            # libffm field id -> first (path, line)
    for path in paths:
        start = 1
        for lines in tf.data.TextLineDataset([path]).batch(batch_lines):
            toks = tf.strings.split(tf.strings.strip(lines))[:, 1:]
            counts = toks.row_lengths().numpy()
            values, first, n = np.unique(counts, return_index=True, return_counts=True)
            for v, f, c in zip(values.tolist(), first.tolist(), n.tolist()):
                seen = counts_seen.setdefault(v, [0, (path, start + f)])
                seen[0] += c
            if fmt == "libffm":
                flat = toks.flat_values
                ok = tf.strings.regex_full_match(flat, Libffm.token_re)
                field = tf.strings.to_number(tf.strings.split(tf.boolean_mask(flat, ok), ":").to_tensor("0")[:, 0],
                                             tf.int64).numpy()
                rows = tf.boolean_mask(toks.value_rowids(), ok).numpy()
                if field.size:
                    m = int(field.max()) + 1
                    ids, first_at = np.unique(field, return_index=True)
                    for fid, at in zip(ids.tolist(), first_at.tolist()):
                        field_seen.setdefault(fid, (path, start + int(rows[at])))
                    keys, c = np.unique(rows * m + field, return_counts=True)
                    need = np.zeros(m, np.int64)
                    np.maximum.at(need, keys % m, c)
                    per_field = np.pad(per_field, (0, max(0, m - per_field.size)))
                    per_field[:m] = np.maximum(per_field[:m], need)
            start += int(counts.size)
    if fmt == "libffm":
        if per_field.size == 0:
            raise DataError(f"{paths[0]}: no field:idx:val features found")
        missing = [f for f in range(per_field.size) if f not in field_seen]
        if missing:
            after = min(f for f in field_seen if f > missing[0])
            path, line = field_seen[after]
            raise DataError(f"{path}:{line}: field {after}, but field(s) {_ranges(missing)} never occur: libffm field "
                            f"ids must be 0..F-1 for F fields (a typo here would add {len(missing)} empty field(s))")
        return sparse_spec("F", per_field, dim)
    if fmt != "libsvm":
        raise ValueError(f"scan_spec reads libsvm or libffm, not {fmt!r}")
    n_max = max(counts_seen) if counts_seen else 0
    if layout in (None, "auto"):
        if len(counts_seen) > 1:
            where = lambda v: (paths.index(counts_seen[v][1][0]), counts_seen[v][1][1])   # noqa: E731
            common = max(counts_seen, key=lambda v: (counts_seen[v][0], tuple(-x for x in where(v))))  # ties: first seen
            n_odd = min((v for v in counts_seen if v != common), key=where)
            odd = counts_seen[n_odd][1]
            total = sum(c for c, _ in counts_seen.values())
            raise DataError(f"{odd[0]}:{odd[1]}: {n_odd} feature(s) where {counts_seen[common][0]:,} of {total:,} lines "
                            f"have {common}: the libsvm layout is ambiguous; pass --libsvm-layout positional (the k-th "
                            f"feature is field k: fix this line) or --libsvm-layout bag (each line is a bag of features)")
        layout = "positional"
    if layout == "positional":
        return sparse_spec("F", [1] * n_max, dim)
    return FeatureSpec((Field("features", "multi", dim, max_len=max(1, n_max), weighted=True),))


def _ranges(ids: list[int]) -> str:
    """[3, 4, 5, 8] -> '3-5, 8'."""
    out, start = [], ids[0]
    for a, b in zip(ids, ids[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)

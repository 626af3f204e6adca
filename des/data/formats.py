"""Line formats: vectorised parsing of a batch of text lines with tf ops, plus a
per-line Python diagnosis used only to word the error for a line the parser rejected.

Each format provides
    parse(lines) -> (features: dict[str, Tensor], label: Tensor, bad: bool[B])
    diagnose(line: bytes) -> str       # why this line is bad
    header: str | None                 # the exact header line, if the format has one
"""
from __future__ import annotations

import re

import tensorflow as tf

from des.data.hashing import feature_ids
from des.data.text import TextParser, utf8_ok
from models.spec import AVAZU_COLUMNS, AVAZU_FIELDS, CRITEO_CAT, CRITEO_INT, PAD_ID, FeatureSpec

INT_RE = r"-?[0-9]{1,18}"  # what fits int64 without overflow
HOUR_RE = r"[0-9]{2}(0[1-9]|1[0-2])(0[1-9]|[12][0-9]|3[01])([01][0-9]|2[0-3])"  # YYMMDDHH


def _split(lines: tf.Tensor, sep: str, ncols: int):
    cols = tf.strings.split(lines, sep)
    ok = tf.equal(cols.row_lengths(), ncols)
    return cols.to_tensor("", shape=[None, ncols]), ok


def _log_bucket(v: tf.Tensor) -> tf.Tensor:
    """Criteo integer -> its bucket: v > 2 -> floor(ln(v)^2), else v."""
    vf = tf.cast(tf.maximum(v, 1), tf.float64)
    return tf.where(v > 2, tf.cast(tf.floor(tf.math.log(vf) ** 2), tf.int64), v)


BUCKETS = (-64, 1908)     # every bucket of a positive int64 (floor(ln(2**63)^2) = 1907), and small negatives


def bucket_ids(names: list[str], v: tf.Tensor, empty: tf.Tensor) -> tf.Tensor:
    """The ids of Criteo integers [B, k] (columns ``names``): ``feature_ids(names, token)`` of the
    token "<bucket>", or "" when ``empty``. A bucket in BUCKETS (all but integers below -64) reads a
    table of those ids made once; only the others are formatted and hashed (formatting and hashing
    every integer cost ~6x reading the table).

    >>> v = tf.constant([[5, 0], [-1000, 7]], tf.int64); empty = tf.constant([[False, True], [False, False]])
    >>> tokens = tf.constant([["2", ""], ["-1000", "3"]])
    >>> bool(tf.reduce_all(bucket_ids(["I1", "I2"], v, empty) == feature_ids(["I1", "I2"], tokens)))
    True
    """
    lo, hi = BUCKETS
    with tf.init_scope():               # made eagerly once per trace: a constant of the parse
        known = [str(b) for b in range(lo, hi)] + [""]
        table = feature_ids(names, tf.constant([[t] * len(names) for t in known]))     # [hi - lo + 1, k]
    bucket = _log_bucket(v)
    inside = (bucket >= lo) & (bucket < hi)
    row = tf.where(empty, tf.constant(hi - lo, tf.int64), tf.where(inside, bucket - lo, tf.zeros_like(bucket)))
    ids = tf.gather_nd(table, tf.stack([row, tf.broadcast_to(tf.range(len(names), dtype=tf.int64), tf.shape(row))], -1))
    return tf.cond(tf.reduce_all(inside | empty), lambda: ids,
                   lambda: tf.where(inside | empty, ids, feature_ids(names, tf.strings.as_string(bucket))))


def _columns(line: bytes, sep: str, ncols: int) -> tuple[list[str], str | None]:
    """The line's columns, or the problem of its bytes or column count (for diagnose)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return [], f"undecodable bytes (not UTF-8) at byte {e.start}"
    cols = text.split(sep)
    if len(cols) != ncols:
        name = "tab" if sep == "\t" else "comma"
        return cols, f"expected {ncols} {name}-separated columns, found {len(cols)}"
    return cols, None


class Criteo(TextParser):
    """Criteo DAC TSV: label, I1..I13, C1..C26 (40 columns); ``with_label=False`` is test.txt (39)."""

    header = None

    def __init__(self, spec: FeatureSpec, with_label: bool = True):
        self.spec, self.with_label = spec, with_label
        self.ncols = 39 + int(with_label)
        self.numeric = [f.name for f in spec if f.kind == "numeric"]

    def parse(self, lines):
        cols, ok = _split(lines, "\t", self.ncols)
        off = int(self.with_label)
        ints, cats = cols[:, off:off + 13], cols[:, off + 13:]
        ok &= tf.reduce_all(tf.strings.regex_full_match(ints, INT_RE) | tf.equal(ints, ""), axis=1)
        if self.with_label:
            label_s = cols[:, 0]
            ok &= tf.strings.regex_full_match(label_s, "[01]")
            label = tf.strings.to_number(tf.where(tf.equal(label_s, "1"), "1", "0"), tf.float32)
        else:
            label = tf.zeros(tf.shape(lines), tf.float32)
        ok &= utf8_ok(lines)
        # only the integer columns read (as ids or as numbers) are parsed; bad rows are masked first
        used = [n for n in CRITEO_INT if self.reads(n) or self.reads(f"{n}_num")]
        col = {n: k for k, n in enumerate(used)}                     # an integer column's place in v
        ints = tf.where(ok[:, None], tf.gather(ints, [CRITEO_INT.index(n) for n in used], axis=1), "")
        empty = tf.equal(ints, "")
        v = tf.strings.to_number(tf.where(empty, "0", ints), tf.int64)
        pad = tf.fill(tf.shape(lines), tf.constant(PAD_ID, tf.int64))
        feats = {n: pad for n in CRITEO_INT}
        as_ids = [n for n in used if self.reads(n)]
        if as_ids:
            at = [col[n] for n in as_ids]
            ids = bucket_ids(as_ids, tf.gather(v, at, axis=1), tf.gather(empty, at, axis=1))
            feats.update({n: ids[:, i] for i, n in enumerate(as_ids)})
        feats.update(self.ids(CRITEO_CAT, cats))
        for n in self.numeric:
            if not self.reads(n):
                feats[n] = tf.zeros(tf.shape(lines), tf.float32)
                continue
            k = col[n[: -len("_num")]]
            vv = tf.where(empty[:, k], tf.zeros_like(v[:, k]), tf.maximum(v[:, k], 0))
            feats[n] = tf.math.log1p(tf.cast(vv, tf.float32))
        return feats, label, tf.logical_not(ok)

    def diagnose(self, line: bytes) -> str:
        cols, bad = _columns(line, "\t", self.ncols)
        if bad:
            return bad
        off = int(self.with_label)
        if self.with_label and cols[0] not in ("0", "1"):
            return f"label {cols[0]!r} is not 0 or 1"
        for name, c in zip(CRITEO_INT, cols[off:off + 13]):
            if c and not re.fullmatch(INT_RE, c):
                return f"column {name}: {c!r} is not an integer"
        return "line rejected by the parser"


def _weekday(yymmdd: tf.Tensor) -> tf.Tensor:
    """Day of week (0 = Monday) of 20YY-MM-DD, by days since 1970-01-01 (civil calendar)."""
    y = 2000 + yymmdd // 10000
    m = (yymmdd // 100) % 100
    d = yymmdd % 100
    y = y - tf.cast(m <= 2, tf.int64)
    era = y // 400
    yoe = y - era * 400
    mp = (m + 9) % 12
    doy = (153 * mp + 2) // 5 + d - 1
    doe = yoe * 365 + yoe // 4 - yoe // 100 + doy
    days = era * 146097 + doe - 719468
    return (days + 3) % 7  # 1970-01-01 was a Thursday (3)


class Avazu(TextParser):
    """Avazu CSV with the 24-column header; click is the label; hour YYMMDDHH.
    ``with_label=False`` is Avazu's test.csv (23 columns, no click)."""

    def __init__(self, spec: FeatureSpec, with_label: bool = True):
        self.spec, self.with_label = spec, with_label
        columns = AVAZU_COLUMNS if with_label else [c for c in AVAZU_COLUMNS if c != "click"]
        self.header = ",".join(columns)
        self.ncols = len(columns)

    def parse(self, lines):
        cols, ok = _split(lines, ",", self.ncols)
        if self.with_label:
            ok &= tf.strings.regex_full_match(cols[:, 1], "[01]")
            label = tf.cast(tf.equal(cols[:, 1], "1"), tf.float32)
            cols = tf.concat([cols[:, :1], cols[:, 2:]], axis=1)  # id, hour, C1, ...
        else:
            label = tf.zeros(tf.shape(lines), tf.float32)
        hour = cols[:, 1]
        ok &= tf.strings.regex_full_match(hour, HOUR_RE)
        ok &= utf8_ok(lines)
        hour = tf.where(ok, hour, "00010100")
        h = tf.strings.to_number(hour, tf.int64)
        hod = tf.strings.as_string(h % 100)
        wd = tf.strings.as_string(_weekday(h // 100))
        values = tf.concat([tf.stack([hod, wd], axis=1), cols[:, 2:]], axis=1)
        return self.ids(AVAZU_FIELDS, values), label, tf.logical_not(ok)

    def diagnose(self, line: bytes) -> str:
        cols, bad = _columns(line, ",", self.ncols)
        if bad:
            return bad
        if self.with_label:
            if cols[1] not in ("0", "1"):
                return f"label (click) {cols[1]!r} is not 0 or 1"
            cols = cols[:1] + cols[2:]
        if not re.fullmatch(HOUR_RE, cols[1]):
            return f"hour {cols[1]!r} is not YYMMDDHH"
        return "line rejected by the parser"


from des.data.libsvm import Libffm, Libsvm  # noqa: E402

FORMATS = {"criteo": Criteo, "criteo-test": lambda spec: Criteo(spec, with_label=False),
           "avazu": Avazu, "avazu-test": lambda spec: Avazu(spec, with_label=False),
           "libsvm": Libsvm, "libffm": Libffm}

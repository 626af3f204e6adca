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
from des.data.text import utf8_ok
from models.spec import AVAZU_COLUMNS, AVAZU_FIELDS, CRITEO_CAT, CRITEO_INT, FeatureSpec

INT_RE = r"-?[0-9]{1,18}"  # what fits int64 without overflow
HOUR_RE = r"[0-9]{2}(0[1-9]|1[0-2])(0[1-9]|[12][0-9]|3[01])([01][0-9]|2[0-3])"  # YYMMDDHH


def _split(lines: tf.Tensor, sep: str, ncols: int):
    cols = tf.strings.split(lines, sep)
    ok = tf.equal(cols.row_lengths(), ncols)
    return cols.to_tensor("", shape=[None, ncols]), ok


def _log_bucket(ints: tf.Tensor) -> tf.Tensor:
    """Criteo integer -> categorical token: v > 2 -> floor(ln(v)^2), else v; '' stays ''."""
    empty = tf.equal(ints, "")
    v = tf.strings.to_number(tf.where(empty, "0", ints), tf.int64)
    vf = tf.cast(tf.maximum(v, 1), tf.float64)
    bucket = tf.where(v > 2, tf.cast(tf.floor(tf.math.log(vf) ** 2), tf.int64), v)
    return tf.where(empty, "", tf.strings.as_string(bucket)), v, empty


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


class Criteo:
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
        ints = tf.where(ok[:, None], ints, "")  # bad rows are masked before number parsing
        tokens, v, empty = _log_bucket(ints)
        ids = feature_ids(CRITEO_INT + CRITEO_CAT, tf.concat([tokens, cats], axis=1))
        feats = {n: ids[:, j] for j, n in enumerate(CRITEO_INT + CRITEO_CAT)}
        for n in self.numeric:
            j = CRITEO_INT.index(n[: -len("_num")])
            vv = tf.where(empty[:, j], tf.zeros_like(v[:, j]), tf.maximum(v[:, j], 0))
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


class Avazu:
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
        ids = feature_ids(AVAZU_FIELDS, values)
        return {n: ids[:, j] for j, n in enumerate(AVAZU_FIELDS)}, label, tf.logical_not(ok)

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

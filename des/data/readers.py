"""tf.data pipelines over text files: batches of ({field: ids}, label).

    >>> import os, shutil, tempfile
    >>> from des.data import criteo_spec
    >>> from des.data.synth import write_criteo
    >>> tmp = tempfile.mkdtemp(); path = os.path.join(tmp, "train.txt")
    >>> meta = write_criteo(path, rows=100, quiet=True)          # 100 Criteo-like TSV lines
    >>> ds = make_dataset([path], "criteo", criteo_spec(), batch_size=64, seed=7)
    >>> [(x["C1"].dtype.name, int(y.shape[0])) for x, y in ds]      # the last batch is short
    [('int64', 64), ('int64', 36)]
    >>> shutil.rmtree(tmp)

Every process that calls this with the same arguments gets the same batches in the
same order (DES needs that). ``shard=(rank, world_size)`` gives each process its own
contiguous slice of every global batch instead (the parameter-server mode; it parses the lines
of its slice only, except with ``skip_bad_lines``, where dropped lines move the slices), and
``shard=des.baselines.allocate.Share(allocator, rank)`` the samples any allocator gives it.

Bad lines stop the run with a ``DataError`` naming file, line and problem (under a contiguous
shard, raised by the process whose slice holds the line); with ``skip_bad_lines=True`` they are
dropped and counted in ``skip_report``.
"""
from __future__ import annotations

import gzip
from typing import Callable, Sequence

import tensorflow as tf

from des.data.errors import DataError, SkipReport
from des.data.files import check_paths
from des.data.formats import FORMATS
from des.data.text import TextParser
from models.spec import FeatureSpec

PARSE_CHUNK = 2048  # lines validated and parsed per vectorised call in skip mode
LINE_CHUNK = 8192   # lines read, numbered and tagged per dataset step
_plain = tf.autograph.experimental.do_not_convert   # dataset functions of plain TF ops: autograph only slows the start


def make_dataset(paths: Sequence[str] | str, fmt: str, spec: FeatureSpec, batch_size: int, *,
                 shuffle_buffer: int = 0, seed: int = 0, epochs: int = 1,
                 skip_bad_lines: bool = False, skip_report: SkipReport | None = None,
                 shard=None, drop_remainder: bool = False,
                 take_lines: int | None = None, skip_lines: int = 0,
                 inputs: Sequence[str] | None = None) -> tf.data.Dataset:
    """Batches of ``({field: int64 ids [B] or float32 [B]}, label float32 [B])``.

    take_lines/skip_lines select a line range (e.g. a held-out split) before shuffling.
    inputs: the inputs the caller reads (None: all); every line is still checked in full, the
    others are PAD_ID (numeric: 0) - a DES process hashes only its own fields' values.
    """
    parser = _text_parser(fmt, spec, inputs)
    files = check_paths(paths, parser.header)
    report = skip_report if skip_report is not None else SkipReport()
    ds = order(_numbered_lines(files, has_header=parser.header is not None),
               batch_size=PARSE_CHUNK if skip_bad_lines else batch_size,
               drop_remainder=drop_remainder and not skip_bad_lines, skip_lines=skip_lines,
               take_lines=take_lines, epochs=epochs, shuffle_buffer=shuffle_buffer, seed=seed)
    parse = _line_parser(parser, label_conventions(files, parser), skip_bad_lines, report)
    return _parsed_batches(ds, parse, batch_size, skip_bad_lines=skip_bad_lines, shard=shard,
                           drop_remainder=drop_remainder)


def _text_parser(fmt: str, spec: FeatureSpec, inputs: Sequence[str] | None) -> TextParser:
    """The parser of format ``fmt`` for ``spec``, reading only ``inputs`` (None: all); a
    ValueError for an unknown format or an input the spec does not have."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose from {sorted(FORMATS)}")
    parser = FORMATS[fmt](spec)
    if inputs is not None:
        unknown = sorted(set(inputs) - set(spec.input_names()))
        if unknown:
            raise ValueError(f"inputs {unknown} are not in the spec")
        parser.wanted = frozenset(inputs)
    return parser


def _numbered_lines(files: list[str], has_header: bool) -> tf.data.Dataset:
    """Every file's lines, file after file, in chunks of LINE_CHUNK: (path, line number, line)
    vectors, a header line dropped."""
    # plain TensorFlow (no Python control flow on tensors): traced without autograph, whose
    # conversion of the parsers took ~0.9 s of each run's start
    @_plain
    def lines_of(path):
        """The file's lines in chunks of LINE_CHUNK: (path, line number, line) vectors, the header
        dropped (a step per chunk: numbering and tagging each line cost ~4 us of CPU a line)."""
        comp = tf.where(tf.strings.regex_full_match(path, r".*\.gz"), "GZIP", "")

        @_plain
        def tag(k, lines):
            n = tf.shape(lines, out_type=tf.int64)[0]
            numbers = k * LINE_CHUNK + 1 + tf.range(n)
            chunk = (tf.fill(tf.reshape(n, [1]), path), numbers, lines)
            if has_header:
                chunk = tuple(tf.boolean_mask(t, numbers > 1) for t in chunk)
            return chunk
        return tf.data.TextLineDataset(path, compression_type=comp).batch(LINE_CHUNK).enumerate().map(tag)

    return tf.data.Dataset.from_tensor_slices(files).flat_map(lines_of)


def _bad_line_handler(parser: TextParser, conventions: dict[str, tuple[str, int, str]], skip_bad_lines: bool,
                      report: SkipReport) -> Callable:
    """``on_bad(path, lineno, line, bad)``: an op that words the problem of every bad line of a
    chunk and raises a DataError for the first, or with ``skip_bad_lines`` adds them to ``report``."""
    def on_bad(path, lineno, line, bad):
        def record(p, n, text, b):
            for pi, ni, ti, bi in zip(p.numpy(), n.numpy(), text.numpy(), b.numpy()):
                if not bi:
                    continue
                where = pi.decode()
                problem = _convention_problem(conventions, parser, where, ti) or parser.diagnose(ti)
                if not skip_bad_lines:
                    raise DataError(f"{where}:{ni}: {problem}")
                report.add(where, int(ni), problem)
            return tf.constant(0)
        return tf.cond(tf.reduce_any(bad),
                       lambda: tf.py_function(record, [path, lineno, line, bad], tf.int32),
                       lambda: tf.constant(0))
    return on_bad


def _line_parser(parser: TextParser, conventions: dict[str, tuple[str, int, str]], skip_bad_lines: bool,
                 report: SkipReport) -> Callable:
    """``parse(path, lineno, line) -> (feats, label, bad)`` of a chunk of lines: CRLF endings
    stripped, a label of the other convention than its file's (``conventions``) marked bad, and
    the bad lines reported (``_bad_line_handler``) before the label is used."""
    on_bad = _bad_line_handler(parser, conventions, skip_bad_lines, report)

    @tf.autograph.experimental.do_not_convert
    def parse(path, lineno, line):
        at = tf.maximum(tf.strings.length(line) - 1, 0)
        last = tf.strings.substr(line, at, tf.ones_like(at))
        line = tf.cond(tf.reduce_any(tf.equal(last, "\r")),          # CRLF files: a scan only when one is there
                       lambda: tf.strings.regex_replace(line, "\r$", ""), lambda: line)
        feats, label, bad = parser.parse(line)
        if conventions:                 # a label of the other convention than its file's is a bad line
            first = tf.strings.regex_replace(line, r"^\s*(\S*).*$", r"\1")
            for path_c, (token, _, _) in conventions.items():
                other = [t for t in parser.label_conventions if t != token]
                bad = bad | ((path == path_c) & tf.reduce_any(tf.stack([first == t for t in other]), 0))
        with tf.control_dependencies([on_bad(path, lineno, line, bad)]):
            label = tf.identity(label)
        return feats, label, bad
    return parse


def _parsed_batches(ds: tf.data.Dataset, parse: Callable, batch_size: int, *, skip_bad_lines: bool, shard,
                    drop_remainder: bool) -> tf.data.Dataset:
    """The ordered chunks of lines ``ds`` parsed into batches of ``batch_size``: with
    ``skip_bad_lines`` parsed in chunks, the bad lines dropped and the rest rebatched; under a
    contiguous ``shard`` each process parses only its own slice of the lines; any other shard
    takes its samples from the parsed global batch."""
    if skip_bad_lines:
        ds = ds.map(parse, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
        ds = ds.map(_drop_bad).rebatch(batch_size, drop_remainder=drop_remainder)
    else:
        if shard is not None and not hasattr(shard, "take"):
            # a contiguous slice: cut the global batch's LINES, so a process parses only its own
            # (each line still read by every process: the same batches everywhere)
            ds, shard = ds.map(_plain(lambda p, n, l: _slice_rows((p, n, l), *shard))), None
        ds = ds.map(_plain(lambda p, n, l: parse(p, n, l)[:2]), num_parallel_calls=tf.data.AUTOTUNE,
                    deterministic=True)
    if shard is not None:
        ds = ds.map(share(shard))
    return ds.prefetch(tf.data.AUTOTUNE)


def label_conventions(files: list[str], parser, lines: int = 10_000) -> dict[str, tuple[str, int, str]]:
    """Each file's label convention, from its first line with a label that fixes one (0 or -1
    for libsvm/libffm): {path: (label, line number, convention)}; {} for formats with one."""
    table = getattr(parser, "label_conventions", None)
    out = {}
    for path in files if table else []:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt", errors="replace") as fh:
            for n, line in zip(range(1, lines + 1), fh):
                token = line.split(maxsplit=1)[0] if line.strip() else ""
                if token in table:
                    out[path] = (token, n, table[token])
                    break
    return out


def _convention_problem(conventions: dict, parser, path: str, line: bytes) -> str | None:
    if path not in conventions:
        return None
    token = line.decode("utf-8", "replace").split(maxsplit=1)[0] if line.strip() else ""
    first, at, name = conventions[path]
    if token in parser.label_conventions and token != first:
        return (f"label {token!r}, but this file's labels are {name} (line {at} has {first!r}): one file must "
                f"use one convention")
    return None


def share(shard):
    """The map from a global batch to this process's samples: ``(rank, world_size)``, the
    contiguous slice; or an object with ``take(feats, label)`` (des.baselines.allocate.Share: any
    allocation, e.g. laia), applied in order (a map without parallel calls)."""
    if hasattr(shard, "take"):
        return shard.take
    rank, world = shard
    return lambda f, y: _slice_batch(f, y, rank, world)


def order(lines: tf.data.Dataset | int, *, batch_size: int, drop_remainder: bool = False, skip_lines: int = 0,
          take_lines: int | None = None, epochs: int = 1, shuffle_buffer: int = 0,
          seed: int = 0) -> tf.data.Dataset:
    """Batches of ``batch_size`` lines in training order: the one definition of which line comes
    when, shared by the text and columnar readers (same arguments, same batches).

    ``lines``: a dataset of chunks of lines (structures of tensors with one leading length, e.g.
    (paths, line numbers, lines)), or a number of rows (then the batches hold row numbers). Every
    step is a step per chunk, window or batch, none per line. The line range (``skip_lines``,
    ``take_lines``) is cut first; with ``shuffle_buffer`` > 1 each epoch's lines are cut into
    consecutive windows of ``shuffle_buffer`` lines and every window is put in a random order of
    its own (seeded by ``seed`` and the window's number), so a line moves less than a window.
    It replaced tf.data's element-wise ``shuffle``, ~1 us of CPU a line in every process.

        >>> [b.numpy().tolist() for b in order(10, batch_size=4, skip_lines=1, take_lines=8)]
        [[1, 2, 3, 4], [5, 6, 7, 8]]
        >>> [sorted(b.numpy().tolist()) for b in order(10, batch_size=5, shuffle_buffer=5, seed=3)]
        [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    """
    window = shuffle_buffer if shuffle_buffer > 1 else batch_size
    if isinstance(lines, int):
        lo = min(skip_lines, lines)
        hi = lines if take_lines is None else min(lines, lo + take_lines)
        windows = tf.data.Dataset.range(lo, hi, window).map(_plain(lambda s: tf.range(s, tf.minimum(s + window, hi))))
    else:
        if skip_lines or take_lines is not None:
            lines = _line_range(lines, skip_lines, take_lines)
        windows = lines.rebatch(window)
    if epochs != 1:
        windows = windows.repeat(None if epochs < 0 else epochs)
    if shuffle_buffer > 1:
        windows = windows.enumerate().map(_plain(lambda k, w: _permuted(w, seed, k)))
    return windows.rebatch(batch_size, drop_remainder=drop_remainder)


def _rows(chunk) -> tf.Tensor:
    """The leading length (lines) of a chunk: a structure of tensors with one leading length."""
    return tf.shape(tf.nest.flatten(chunk)[0], out_type=tf.int64)[0]


def _line_range(chunks: tf.data.Dataset, skip: int, take: int | None) -> tf.data.Dataset:
    """Lines [skip, skip + take) of a dataset of chunks of lines, in chunks; reading stops at
    the chunk that holds the range's last line."""
    end = None if take is None else skip + take

    @_plain
    def cut(at, chunk):
        n = _rows(chunk)
        lo = tf.clip_by_value(skip - at, 0, n)
        hi = n if end is None else tf.clip_by_value(end - at, 0, n)
        return tf.nest.map_structure(lambda t: t[lo:hi], chunk)

    ds = chunks.scan(tf.constant(0, tf.int64), _plain(lambda at, chunk: (at + _rows(chunk), (at, chunk))))
    if end is not None:
        ds = ds.take_while(_plain(lambda at, chunk: at < end))
    return ds.map(cut).filter(_plain(lambda *chunk: _rows(chunk) > 0))


@_plain
def _permuted(window, seed: int, k):
    """``window`` (a structure of tensors with one leading length) in the random order of
    (seed, k): the argsort of stateless random 64-bit keys, the same on every process."""
    keys = tf.random.stateless_uniform(tf.reshape(_rows(window), [1]), seed=tf.stack([tf.constant(seed, tf.int64), k]),
                                       minval=None, maxval=None, dtype=tf.int64)
    perm = tf.argsort(keys, stable=True)
    return tf.nest.map_structure(lambda t: tf.gather(t, perm), window)


def _drop_bad(feats, label, bad):
    keep = tf.logical_not(bad)
    return {k: tf.boolean_mask(v, keep) for k, v in feats.items()}, tf.boolean_mask(label, keep)


def _slice_batch(feats, label, rank: int, world: int):
    """Rows [b*rank//world, b*(rank+1)//world) of a global batch of b rows."""
    return _slice_rows((feats, label), rank, world, rows=tf.shape(label, out_type=tf.int64)[0])


def _slice_rows(batch, rank: int, world: int, rows=None):
    """Rows [b*rank//world, b*(rank+1)//world) of every tensor of ``batch`` (a structure of
    tensors with b rows; ``rows``: b, else the first tensor's)."""
    b = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0] if rows is None else rows
    lo, hi = b * rank // world, b * (rank + 1) // world
    return tf.nest.map_structure(lambda v: v[lo:hi], batch)


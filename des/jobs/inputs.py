"""What a des.train job reads: the data's format and spec, the split into training and
evaluation lines, and the tf.data pipelines of both (text readers or the columnar reader).
des.jobs.job trains on them; nothing here knows the mode, beyond the inputs and the shard
it is handed.
"""
from __future__ import annotations

import gzip
import json
import os

from des.data import DataError, columnar
from des.data.readers import make_dataset
from des.data.resolve import describe, metadata, spec_for
from des.jobs.config import RunConfig


def count_lines(paths) -> int:
    if columnar.is_columnar(paths):
        return int(columnar.manifest(paths[0])["rows"])
    n = 0
    for p in paths:
        with (gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")) as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                n += block.count(b"\n")
    return n


def bayes_auc(a, meta: dict):
    """The generator's Bayes-optimal AUC of the evaluated data, if it wrote one."""
    if not a.eval_data:
        return meta.get("bayes_auc")
    path = a.eval_data[0] + ".meta.json"
    if len(a.eval_data) == 1 and os.path.exists(path):
        with open(path) as fh:
            return json.load(fh).get("bayes_auc")
    return None


def dataset(a, spec, batch_size: int, paths=None, inputs=None, skip_bad_lines: bool = False,
            skip_report=None, **kw):
    """The text readers (des.data.readers: every line checked, only ``inputs`` hashed) or, for a
    folder of des.data.convert, the columnar reader reading only ``inputs`` (None: all)."""
    paths = list(paths or a.data)
    if a.format == "columnar":
        bad = [p for p in paths if not columnar.is_columnar([p])]
        if bad or len(paths) != 1:
            raise DataError(f"{(bad or paths)[0]}: with columnar --data, --eval-data must be one columnar "
                            f"folder too (python -m des.data.convert)")
        return columnar.make_dataset(paths[0], spec, batch_size, inputs=inputs, **kw)
    return make_dataset(paths, a.format, spec, batch_size, skip_bad_lines=skip_bad_lines,
                        skip_report=skip_report, inputs=inputs, **kw)


class JobInputs:
    """The data of one run, read once from its checked configuration (``read``)."""

    def __init__(self, config: RunConfig, meta: dict, spec, held: int, n_train: int | None, eval_files,
                 eval_skip: int, eval_name: str, messages: list[str]):
        self.config, self.meta, self.spec = config, meta, spec
        self.held, self.n_train, self.eval_files, self.eval_skip = held, n_train, eval_files, eval_skip
        self.eval_name, self.messages = eval_name, messages

    @classmethod
    def read(cls, config: RunConfig) -> "JobInputs":
        """The data's format (``config`` gets it), spec and training / evaluation split; a
        missing, empty or malformed file raises DataError or FileNotFoundError."""
        meta = metadata(config.data[0])
        fmt = config.format
        if fmt in (None, "columnar") and columnar.is_columnar(config.data):
            fmt, meta = "columnar", columnar.manifest(config.data[0])
        a = config.replace(format=fmt or meta.get("format", "criteo"))
        spec = spec_for(a.format, a.data, a.dim, meta, a.eval_data or [], layout=a.libsvm_layout)  # --eval-data scanned too
        messages = ([f"{a.format}: scanned {', '.join(a.data)}: {describe(spec)}"]
                    if a.format in ("libsvm", "libffm") and not meta.get("spec") else [])
        if a.eval_data:  # train on every line of --data; no counting pass
            return cls(a, meta, spec, 0, None, a.eval_data, 0, " ".join(a.eval_data), messages)
        header = 1 if a.format == "avazu" else 0
        total = count_lines(a.data) - header * len(a.data)
        if total <= 0:
            raise DataError(f"{a.data[0]}: file is empty")
        held = int(a.holdout * total) if a.holdout < 1 else int(a.holdout)
        return cls(a, meta, spec, held, total - held, a.data, total - held, f"{held} held-out lines", messages)

    def first_lines(self, n: int) -> dict:
        """The features of the first ``n`` training lines (one batch)."""
        return next(iter(dataset(self.config, self.spec, n, take_lines=min(n, self.n_train or n))))[0]

    def training(self, config: RunConfig, batch: int, seed: int, inputs, shard, skip_report):
        """One epoch's batches, shuffled by ``seed`` (des.jobs.modes.epoch_seed: the same order
        for a resumed job), the first ``n_train`` lines only."""
        return dataset(config, self.spec, batch, shuffle_buffer=config.shuffle_buffer, inputs=inputs, seed=seed,
                       take_lines=self.n_train, shard=shard, skip_bad_lines=config.skip_bad_lines,
                       skip_report=skip_report)

    def evaluation(self, config: RunConfig, batch: int, inputs, shard, skip_report):
        """The evaluation batches (the held-out lines or --eval-data), or None."""
        if not (self.held or config.eval_data):
            return None
        return dataset(config, self.spec, max(batch, 4096), self.eval_files, skip_lines=self.eval_skip,
                       inputs=inputs, shard=shard, skip_bad_lines=config.skip_bad_lines, skip_report=skip_report)

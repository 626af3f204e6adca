"""Which FeatureSpec a data set has: named by its format, read from a columnar folder or the
generator's metadata, else scanned from the files.

    >>> import os, shutil, tempfile
    >>> tmp = tempfile.mkdtemp()
    >>> for name, text in [("train.ffm", "1 0:5:1 1:7:1\\n"), ("test.ffm", "0 0:6:1 1:7:1 1:8:1\\n")]:
    ...     with open(os.path.join(tmp, name), "w") as fh:
    ...         _ = fh.write(text)
    >>> spec = spec_for("libffm", [os.path.join(tmp, "train.ffm")], dim=8, eval_paths=[os.path.join(tmp, "test.ffm")])
    >>> [(f.name, f.max_len) for f in spec]          # F1 holds two features on a test line
    [('F0', 1), ('F1', 2)]
    >>> spec_for("criteo", [], dim=8).names()[:3]    # named by its format: nothing is read
    ['I1', 'I2', 'I3']
    >>> shutil.rmtree(tmp)
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from des.data import columnar
from des.data.libsvm import scan_spec
from models.spec import FeatureSpec, avazu_spec, criteo_spec


def metadata(path: str) -> dict:
    """The generator's metadata of a data file (``<path>.meta.json``), or {} when there is none."""
    if not os.path.exists(path + ".meta.json"):
        return {}
    with open(path + ".meta.json") as fh:
        return json.load(fh)


def describe(spec: FeatureSpec) -> str:
    """One line: how many fields, of which kinds and widths (printed when a spec was scanned).

    >>> from models.spec import Field
    >>> describe(FeatureSpec((Field("F0", "multi", 8), Field("F1", "multi", 8, max_len=3))))
    '2 field(s): F0 (multi, 1 feature), F1 (multi, up to 3 features)'
    """
    parts = [f"{f.name} ({f.kind}, {'1 feature' if f.max_len == 1 else f'up to {f.max_len} features'})"
             for f in spec]
    shown = parts if len(parts) <= 8 else parts[:6] + ["...", parts[-1]]
    return f"{len(parts)} field(s): {', '.join(shown)}"


def spec_for(fmt: str, paths: Sequence[str], dim: int, meta: dict | None = None,
             eval_paths: Sequence[str] = (), layout: str = "auto") -> FeatureSpec:
    """The FeatureSpec of a data set: named by the format (criteo, avazu), read from a columnar
    folder or from the generator's metadata, else scanned from the files - the training AND the
    evaluation files, so an evaluation file with longer bags than any training line fits."""
    meta = meta or {}
    if fmt == "columnar":
        return columnar.spec_of(paths[0]).with_dim(dim)
    if fmt == "criteo":
        return criteo_spec(dim, cardinalities=meta.get("cardinalities"))
    if fmt == "avazu":
        return avazu_spec(dim)
    if "spec" in meta and meta.get("format") == fmt:
        spec = FeatureSpec.from_json(json.dumps(meta["spec"])).with_dim(dim)
        return spec.with_cardinalities(meta.get("cardinalities") or {})   # e.g. --cache-size 10% on wide
    return scan_spec(list(paths) + list(eval_paths or []), fmt, dim, layout=layout)

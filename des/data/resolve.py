"""Which FeatureSpec a data set has: named by its format, read from a columnar folder or the
generator's metadata, else scanned from the files.

    >>> spec = spec_for("libffm", ["train.ffm"], dim=8, eval_paths=["test.ffm"])
"""
from __future__ import annotations

import json
import os
from typing import Sequence

from des.data import columnar
from des.data.spec import FeatureSpec, avazu_spec, criteo_spec


def metadata(path: str) -> dict:
    """The generator's metadata of a data file (``<path>.meta.json``), or {} when there is none."""
    if not os.path.exists(path + ".meta.json"):
        return {}
    with open(path + ".meta.json") as fh:
        return json.load(fh)


def spec_for(fmt: str, paths: Sequence[str], dim: int, meta: dict | None = None,
             eval_paths: Sequence[str] = ()) -> FeatureSpec:
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
        return FeatureSpec.from_json(json.dumps(meta["spec"])).with_dim(dim)
    from des.data.libsvm import scan_spec
    return scan_spec(list(paths) + list(eval_paths or []), fmt, dim)

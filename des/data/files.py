"""Input files: open (gzip or plain) and check before reading.

    >>> import os, shutil, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "train.txt")
    >>> with open(path, "w") as fh:
    ...     _ = fh.write("1 0:a:1\\n")
    >>> check_paths([path]) == [path]      # existing, non-empty files, or a DataError / FileNotFoundError
    True
    >>> check_paths([path + ".gz"])
    Traceback (most recent call last):
    FileNotFoundError: .../train.txt.gz: no such file
    >>> shutil.rmtree(os.path.dirname(path))
"""
from __future__ import annotations

import gzip
import os
from typing import Sequence

from des.data.errors import DataError


def open_text(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def check_paths(paths: Sequence[str] | str, header: str | None = None) -> list[str]:
    """Existing, non-empty files; a header-only file counts as empty."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not paths:
        raise DataError("no input files given")
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{p}: no such file")
        with open_text(p) as fh:
            first = fh.readline()
            second = fh.readline() if header is not None else b"x"
        if not first:
            raise DataError(f"{p}: file is empty")
        if header is not None:
            got = first.rstrip(b"\r\n").decode("utf-8", "replace")
            if got != header:
                raise DataError(f"{p}:1: header is {got[:80]!r}, expected {header[:80]!r}...")
            if not second:
                raise DataError(f"{p}: file has a header but no data lines")
    return [str(p) for p in paths]

"""Errors and skip accounting of the readers."""
from __future__ import annotations

import collections
import threading


class DataError(ValueError):
    """Bad input: the message names the file, the line and the problem."""


def op_error_message(error: Exception) -> str:
    """The line to show for a tf.errors.OpError raised while reading: the reader's DataError line
    (file:line: problem) when there is one, else the error's first line."""
    text = str(error)
    line = next((line for line in text.splitlines() if "DataError: " in line), None)
    return line.split("DataError: ", 1)[1] if line else text.split("\n")[0]


class SkipReport:
    """Counts lines skipped by a reader run with ``skip_bad_lines=True``, by problem.

    >>> r = SkipReport(); r.add("f.txt", 3, "label must be 0 or 1"); r.total
    1
    """

    def __init__(self) -> None:
        self.by_problem: collections.Counter[str] = collections.Counter()
        self.first: list[str] = []
        self._lock = threading.Lock()

    def add(self, path: str, line: int, problem: str) -> None:
        with self._lock:
            self.by_problem[problem] += 1
            if len(self.first) < 5:
                self.first.append(f"{path}:{line}: {problem}")

    @property
    def total(self) -> int:
        return sum(self.by_problem.values())

    def __str__(self) -> str:
        if not self.total:
            return "skipped 0 bad lines"
        kinds = "; ".join(f"{n} x {p}" for p, n in self.by_problem.most_common())
        return f"skipped {self.total} bad lines ({kinds}); first: " + " | ".join(self.first)

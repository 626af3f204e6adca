"""How many of the project's files a training run's code passes through, per mode.

    .venv/bin/python scripts/trace_files.py --modes single,des,ps,cache

Runs ``des.jobs.train.main`` in this process (world size 1, a small generated libffm file) under
``sys.setprofile`` and counts the project files (des, des_ops, models, rewrite_rules) whose
functions (not module bodies) were called: over the whole run, and inside ``train_step`` (what Keras traces into
the step graph; run eagerly here, so that autograph's converted copies do not hide the project's
files). A measure of how spread out a mode's code is, for issue 14's before/after.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PACKAGES = tuple(os.path.join(ROOT, p) + os.sep for p in ("des", "des_ops", "models", "rewrite_rules"))


class FileTrace:
    """Project files whose Python functions run: ``run`` (all), ``step`` (inside train_step)."""

    def __init__(self):
        self.run: set[str] = set()
        self.step: set[str] = set()
        self.depth = 0

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if event == "call":
            if code.co_name == "train_step":
                self.depth += 1
            if code.co_filename.startswith(PACKAGES) and code.co_name != "<module>":
                name = os.path.relpath(code.co_filename, ROOT)
                self.run.add(name)
                if self.depth:
                    self.step.add(name)
        elif event == "return" and code.co_name == "train_step":
            self.depth -= 1

    def __enter__(self):
        sys.setprofile(self)
        threading.setprofile(self)
        return self

    def __exit__(self, *exc):
        sys.setprofile(None)
        threading.setprofile(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="single,des,ps,cache")
    ap.add_argument("--list", action="store_true", help="also print the files")
    a = ap.parse_args()
    import des  # noqa: F401
    import tensorflow as tf
    from des.jobs import train
    tf.config.run_functions_eagerly(True)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from helpers import write_small_ffm

    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "train.ffm")
        write_small_ffm(data, 600, fields=4)
        print(f"{'mode':>6} | files in the run | files in train_step")
        for mode in a.modes.split(","):
            extra = ["--staleness", "0", "--optimizer", "sgd", "--cache-size", "50"] if mode == "cache" else []
            with FileTrace() as t:
                rc = train.main(["--mode", mode, "--data", data, "--batch", "128", "--steps", "2",
                                 "--hidden", "8", "--holdout", "128", "--shuffle-buffer", "0"] + extra)
            assert rc == 0, f"des.train --mode {mode} exited {rc}"
            print(f"{mode:>6} | {len(t.run):>16} | {len(t.step):>19}")
            if a.list:
                print("   run: ", " ".join(sorted(t.run)))
                print("   step:", " ".join(sorted(t.step)))


if __name__ == "__main__":
    main()

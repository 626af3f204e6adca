"""TensorFlow's and TFRA's start-up noise kept off stderr, everything else let through.

Importing TensorFlow 2.15 on a machine without a GPU prints cuDNN, cuFFT and cuBLAS "Unable to
register factory" errors (and, below TF_CPP_MIN_LOG_LEVEL=2, a few notices); importing TFRA
logs a GraphKeys deprecation warning. None of them is about the user's job. ``install()`` (run
by ``import des``, before anything loads TensorFlow) wraps the loaders of those two packages:
while their top module runs, file descriptor 2 goes to a temporary file, and afterwards every
line of it that is not one of the known start-up messages is written to stderr, so a real error
or warning raised during the import still shows. Nothing else is touched, and ``DES_QUIET=0``
leaves stderr alone.

    >>> import subprocess, sys
    >>> out = subprocess.run([sys.executable, "-c", "import des, tensorflow"], capture_output=True, text=True)
    >>> out.stderr
    ''
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import tempfile

NOISE = ("Unable to register cuDNN factory", "Unable to register cuFFT factory", "Unable to register cuBLAS factory",
         "dynamic_embedding.GraphKeys has already been deprecated", "oneDNN custom operations are on",
         "Could not find cuda drivers on your machine", "This TensorFlow binary is optimized to use",
         "To enable the following instructions", "TF-TRT Warning: Could not find TensorRT")
PACKAGES = ("tensorflow", "tensorflow_recommenders_addons")


class _QuietLoader(importlib.abc.Loader):
    """The package's own loader, run with stderr captured and filtered."""

    def __init__(self, loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        sys.stderr.flush()
        saved = os.dup(2)
        with tempfile.TemporaryFile(mode="w+b") as captured:
            os.dup2(captured.fileno(), 2)
            try:
                self.loader.exec_module(module)
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                os.close(saved)
                captured.seek(0)
                kept = [line for line in captured.read().decode(errors="replace").splitlines(keepends=True)
                        if not any(n in line for n in NOISE)]
                if kept:
                    sys.stderr.write("".join(kept))
                    sys.stderr.flush()


class _QuietFinder(importlib.abc.MetaPathFinder):
    """Finds PACKAGES as the other finders do and wraps their loader."""

    def find_spec(self, name, path=None, target=None):
        if name not in PACKAGES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader)
        return spec


def install() -> None:
    """Filter the start-up noise of the packages not imported yet (idempotent)."""
    if os.environ.get("DES_QUIET", "1") == "0" or any(isinstance(f, _QuietFinder) for f in sys.meta_path):
        return
    if all(p in sys.modules for p in PACKAGES):
        return
    sys.meta_path.insert(0, _QuietFinder())

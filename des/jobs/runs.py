"""What the comparison and the projection share to launch des.train runs and title their reports.

    >>> import subprocess, sys
    >>> subprocess.run([sys.executable, "-m", "des.train", ...], env=launch_env(), cwd=ROOT)   # doctest: +SKIP
    >>> launch_env()["PYTHONPATH"].split(os.pathsep)[0] == ROOT      # the runs import this checkout
    True
"""
from __future__ import annotations

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # the checkout


def launch_env() -> dict:
    return dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2",
                PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))


def data_files(data) -> list[str]:
    """``data``: one path (a preset's file) or a list of paths."""
    return [data] if isinstance(data, str) else list(data)


def describe_source(a, short: bool = False) -> str:
    """What the runs read, for titles: the preset, or the data (and evaluation) files
    (``a``: des.compare's options: preset, data, eval_data)."""
    data = a.data
    if not data:
        return a.preset if short else f"preset {a.preset}"
    name = (lambda p: os.path.basename(p)) if short else (lambda p: p)
    text = ", ".join(name(p) for p in data)
    if a.eval_data:
        text += " (eval " + ", ".join(name(p) for p in a.eval_data) + ")"
    return text if short else f"data {text}"

"""One home per training mode, each with the interface of ``des.jobs.modes.base.Mode``.

    >>> from des.jobs import modes
    >>> sorted(modes.MODES)
    ['cache', 'des', 'ps', 'single']
    >>> modes.mode_class("cache").__mro__[1].name        # the cache mode is the PS mode plus caches
    'ps'

``des.train`` is a dispatcher: it reads the options and the data, asks ``make`` for the mode,
and calls the mode's hooks (des.jobs.modes.base) in a fixed order. ``--mode auto`` is not a mode of
its own: ``make`` asks des.jobs.auto which of des and ps moves fewer bytes on the first global
batch, and returns that mode with the choice in ``mode.auto``.
"""
from __future__ import annotations

import dataclasses
import importlib

from des.jobs.config import MODES
from des.jobs.modes.base import Mode, ModeError, Run, epoch_seed

__all__ = ["MODES", "Mode", "ModeError", "Run", "epoch_seed", "make", "mode_class"]


def mode_class(name: str) -> type[Mode]:
    """The class of mode ``name`` (des.jobs.modes.MODES), imported on first use."""
    entry = MODES[name]
    if isinstance(entry, str):
        module, cls = entry.split(":")
        entry = MODES[name] = getattr(importlib.import_module(module), cls)
    return entry


def make(name: str, run: Run) -> Mode:
    """The mode ``name`` (or the one ``auto`` chooses) for this run, its options checked."""
    auto = None
    if name == "auto":
        from des.jobs import auto as chooser                # TensorFlow: only when a run is made
        from des_ops.comm import launcher_rank
        first = {k: v.numpy() for k, v in run.first_batch().items()}
        allocation = run.config.allocation
        rank, size = launcher_rank()
        auto = chooser.choose(run.reference_model(), first, size, allocation.strategy)
        name = auto.mode
        if allocation.strategy != "contiguous" and name == "des":
            if rank == 0:      # the run's log prints once the mode is made; this is before
                print(f"--mode auto chose des: --allocate {allocation.strategy} does not apply (every process "
                      f"reads the whole batch)")
            allocation = dataclasses.replace(allocation, strategy="contiguous")
        run.config = run.config.replace(mode=name, allocation=allocation)   # the run's record says what runs
    mode = mode_class(name)(run)
    mode.auto = auto
    mode.check()
    return mode

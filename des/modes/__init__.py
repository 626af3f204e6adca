"""One home per training mode, each with the interface of ``des.modes.base.Mode``.

    >>> from des import modes
    >>> sorted(modes.MODES)
    ['cache', 'des', 'ps', 'single']
    >>> modes.MODES["cache"].__mro__[1].name             # the cache mode is the PS mode plus caches
    'ps'

``des.train`` is a dispatcher: it reads the options and the data, asks ``make`` for the mode,
and calls the mode's hooks (des.modes.base) in a fixed order. ``--mode auto`` is not a mode of
its own: ``make`` asks des.auto which of des and ps moves fewer bytes on the first global
batch, and returns that mode with the choice in ``mode.auto``.
"""
from __future__ import annotations

from des.modes.base import Mode, ModeError, Run, epoch_seed
from des.baselines.cache.mode import Cache
from des.modes.des import DES
from des.baselines.ps.mode import PS
from des.modes.single import Single

__all__ = ["MODES", "Mode", "ModeError", "Run", "epoch_seed", "make"]

MODES: dict[str, type[Mode]] = {m.name: m for m in (Single, DES, PS, Cache)}   # the modules import
# nothing heavy at the top: TensorFlow, Horovod and TFRA load inside the hooks


def make(name: str, run: Run) -> Mode:
    """The mode ``name`` (or the one ``auto`` chooses) for this run, its options checked."""
    auto = None
    if name == "auto":
        import dataclasses
        from des import auto as chooser
        from des_ops.comm import launcher_rank
        first = {k: v.numpy() for k, v in run.first_batch().items()}
        allocation = run.config.allocation
        auto = chooser.choose(run.reference_model(), first, launcher_rank()[1], allocation.strategy)
        name = auto.mode
        if allocation.strategy != "contiguous" and name == "des":
            print(f"--mode auto chose des: --allocate {allocation.strategy} does not apply (every process "
                  f"reads the whole batch)")
            allocation = dataclasses.replace(allocation, strategy="contiguous")
        run.config = run.config.replace(mode=name, allocation=allocation)   # the run's record says what runs
    mode = MODES[name](run)
    mode.auto = auto
    mode.check()
    return mode

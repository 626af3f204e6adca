"""The one handle on what des.transform made of a model: ``des.distributed(model)``.

    >>> import des, models
    >>> from des.data import FeatureSpec, Field
    >>> model, _ = des.transform(models.fm(FeatureSpec((Field("a", dim=2), Field("b", dim=2)))))
    >>> handle = des.distributed(model)
    >>> handle.plan.owner, handle.layer.collective, handle.tail, handle.comm.world_size
    ({'a': 0, 'b': 0}, 'des_partials__linearsum1__fm3', 'replicated', 1)
    >>> des.distributed(models.fm(FeatureSpec((Field("a", dim=2),)))) is None    # not transformed
    True

The handle is kept beside the model (a weak-keyed registry), not as attributes stuck onto the
Keras object: the field plan, the DES layer (owned tables, sub-operators, its collective), the
state keys checkpoints and snapshots use, and the tail's mode and variables.
"""
from __future__ import annotations

import dataclasses
import weakref
from typing import Any


@dataclasses.dataclass
class Distributed:
    """What des.transform made of one model on this process."""
    layer: Any                  # des_ops.suboperators.DESFirstLayer: owned tables, sub-operators, collective
    plan: Any                   # des.compiler.plan.FieldPlan: which process owns which field
    state: Any                  # des.compiler.keys.StateKeys: how rows and weights are keyed in checkpoints
    tail: str = "replicated"    # or "data_parallel" (des_ops.tail)
    tail_variables: list = dataclasses.field(default_factory=list)   # summed gradients: the data-parallel tail's, shared kernel rows
    source: Any = None          # the model des.transform was given: the architecture a save writes (des.runtime.saving)
    subclassed: Any = None      # a subclassed model rewritten in place: the user's object (a save writes its class)
    frozen: list = dataclasses.field(default_factory=list)   # its substituted Dense layers (des.runtime.saving.as_written)

    @property
    def comm(self):
        """The communicator of the model's collectives (des_ops.comm)."""
        return self.layer.comm


_HANDLES: "weakref.WeakKeyDictionary[Any, Distributed]" = weakref.WeakKeyDictionary()


def attach(model, handle: Distributed) -> None:
    """Record ``handle`` for ``model`` (des.compiler does, for the models transform returns)."""
    _HANDLES[model] = handle


def comm_of(model):
    """The communicator whose processes save and checkpoint ``model`` together: a DES model's, or
    that of a model that carries its own (``des_comm``: des.baselines.ps.user's); None for a model
    of one process."""
    handle = distributed(model)
    return handle.comm if handle is not None else getattr(model, "des_comm", None)


def distributed(model) -> Distributed | None:
    """The handle of a model des.transform returned, or None for any other model."""
    try:
        return _HANDLES.get(model)
    except TypeError:           # not weak-referenceable: not a model transform returned
        return None

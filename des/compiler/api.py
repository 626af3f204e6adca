"""des.transform: find the weights-rich first layers of a Keras model and substitute them.

    >>> import des
    >>> from models import deepfm
    >>> from des.data import FeatureSpec, Field
    >>> spec = FeatureSpec((Field("C1", dim=4), Field("C2", dim=4)))
    >>> model, report = des.transform(deepfm(spec, hidden=(8,)))          # world from the launcher under mpirun
    >>> print(report)
    des.transform: 3 substitution(s), rank 0 of 1:
    ...
    >>> des.distributed(model).layer.floats_per_sample()          # the partials' width: 1 (LR) + 4+1 (FM) + 8 (Dense)
    14

Steps: IR of the functional graph (des.graph.ir: one canonical graph whatever the spelling) ->
field vectors and layouts (des.graph.fields) -> every registered rule tried at every node ->
safety checks (no intermediate used outside its match; every table of a substituted field
used only by substituted operators) -> every process takes rank 0's weights -> field plan
-> one DESFirstLayer with this process's tables, their chains and the sub-operators -> the
rest of the graph replayed on top of it, with the same layer objects (so trained weights of
the replicated tail are kept). A subclassed model is traced first (des.compiler.subclassed).
"""
from __future__ import annotations

import tensorflow as tf

from des.compiler.functional import transform_functional
from des.compiler.options import Options
from des.compiler.report import Report
from des.compiler.subclassed import transform_subclassed
from des_ops.comm import Communicator
from des_ops.mpi import default_communicator


def transform(model: tf.keras.Model, options: Options | None = None, *, comm: Communicator | None = None,
              spec=None, sample=None, chosen: str = "") -> tuple[tf.keras.Model, Report]:
    """Return (DES model for this process, report); ``options``: a des.Options (how to split).

    ``comm``: the collectives (default: under mpirun des_ops.mpi.SettlingCommunicator, mpi4py's
    sleeping waits for the replicated tail and Horovod otherwise; else a world of one). ``spec`` (a
    FeatureSpec) gives expected cardinalities to the balanced plan. ``sample`` (a batch of the
    inputs, optional for a functional model): the cost model's share of rows that travel once per
    distinct id (des.AutoTail.distinct) is measured on it. A subclassed model (a
    ``tf.keras.Model`` or ``tfrs.models.Model`` with its own ``call``) is traced: its ``call``
    runs on symbolic inputs shaped like ``sample`` (a batch of its inputs; not needed once the
    model has been called), the functional graph this gives is rewritten, and the SAME model
    object is returned with its forward pass replaced by the rewritten graph, so its own
    ``compute_loss``, ``train_step``, tasks and metrics stay as they are. A model without a
    ``call`` of its own whose ``compute_loss`` calls towers (a TFRS retrieval model) has each
    tower that holds tables transformed on its own and put back in its place. ``chosen``: why
    DES, when des.transform weighed it against a parameter server (des.Options(mode="auto")).
    """
    options = options if options is not None else Options()
    if not isinstance(options, Options):
        raise TypeError(f"des.transform: options={options!r}; a des.Options")
    if options.mode != "des" and not chosen:
        raise ValueError(f"des.compiler.transform substitutes (mode 'des'); des.Options(mode={options.mode!r}) is "
                         f"des.transform's to weigh (des.baselines.ps.user.transform)")
    comm = comm or default_communicator()
    if getattr(model, "_is_graph_network", False):
        model, report = transform_functional(model, options, comm, spec, sample)
    else:
        model, report = transform_subclassed(model, options, comm, spec, sample)
    report.mode_reason = chosen
    return model, report

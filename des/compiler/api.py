"""des.transform: find the weights-rich first layers of a Keras model and substitute them.

    >>> import des
    >>> from models import deepfm
    >>> from des.data import FeatureSpec, Field
    >>> spec = FeatureSpec((Field("C1", dim=4), Field("C2", dim=4)))
    >>> model, report = des.transform(deepfm(spec, hidden=(8,)))          # world from Horovod under mpirun
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
from des_ops.comm import Communicator, agree, default_communicator


def transform(model: tf.keras.Model, options: Options | None = None, *, comm: Communicator | None = None,
              spec=None, sample=None) -> tuple[tf.keras.Model, Report]:
    """Return (DES model for this process, report); ``options``: a des.Options (how to split).

    ``comm``: the collectives (default: Horovod under mpirun, else a world of one). ``spec`` (a
    FeatureSpec) gives expected cardinalities to the balanced plan. ``sample`` (a batch of the
    inputs, optional for a functional model): the cost model's share of rows that travel once per
    distinct id (des.AutoTail.distinct) is measured on it. A subclassed model (a
    ``tf.keras.Model`` or ``tfrs.models.Model`` with its own ``call``) is traced: its ``call``
    runs on symbolic inputs shaped like ``sample`` (a batch of its inputs; not needed once the
    model has been called), the functional graph this gives is rewritten, and the SAME model
    object is returned with its forward pass replaced by the rewritten graph, so its own
    ``compute_loss``, ``train_step``, tasks and metrics stay as they are. A model without a
    ``call`` of its own whose ``compute_loss`` calls towers (a TFRS retrieval model) has each
    tower that holds tables transformed on its own and put back in its place.
    """
    options = options if options is not None else Options()
    if not isinstance(options, Options):
        raise TypeError(f"des.transform: options={options!r}; a des.Options")
    comm = comm or default_communicator()
    functional = getattr(model, "_is_graph_network", False)
    if options.mode != "des":
        mode, why = _mode(model, options, comm, sample, functional)
        if mode == "ps":
            return _parameter_server(model, options, comm, why)
    else:
        why = ""
    if functional:
        model, report = transform_functional(model, options, comm, spec, sample)
    else:
        model, report = transform_subclassed(model, options, comm, spec, sample)
    report.mode_reason = why
    return model, report


def _mode(model: tf.keras.Model, options: Options, comm: Communicator, sample, functional: bool) -> tuple[str, str]:
    """("des" | "ps", why) for des.Options(mode="ps" | "auto"); the same on every process (checked)."""
    if not functional:
        if options.mode == "ps":
            raise ValueError(f"des.Options(mode='ps'): the parameter server shards the tables of a functional "
                             f"model; {type(model).__name__} is subclassed (use mode='des')")
        return "des", "mode auto: DES (a subclassed model: the parameter server shards functional models only)"
    if options.mode == "ps":
        return "ps", "mode ps: asked for"
    if sample is None:
        raise ValueError("des.Options(mode='auto') weighs DES against a parameter server on a batch of the inputs: "
                         "pass sample= (a global batch, the same on every process)")
    from des.baselines.ps.rewrite import refusal
    from des.graph.ir import Graph
    from des.jobs.auto import choose
    cannot = refusal(Graph(model), "ps")        # nothing to weigh: the PS cannot take this model
    if cannot:
        mode, why = "des", f"mode auto: DES, as a PS cannot shard this model ({cannot})"
    else:
        choice = choose(model, sample, comm.world_size)
        mode, why = choice.mode, str(choice).replace("plan auto:", "mode auto:", 1)
    agree(comm, "mode des.Options(mode='auto') chose (is sample= the same batch on every process?)", mode)
    return mode, why


def _parameter_server(model: tf.keras.Model, options: Options, comm: Communicator, why: str):
    from des.baselines.ps.user import ps_lines, shard_users_model
    ps = shard_users_model(model, comm, options.seed, options.sync_weights)
    report = Report([], [], None, comm.rank, comm.world_size, tables=ps_lines(model, comm.world_size),
                    options=options, compiled=ps.des_compiled, mode="ps", mode_reason=why)
    return ps, report

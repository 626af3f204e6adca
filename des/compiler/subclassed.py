"""des.transform of a subclassed model: its ``call`` traced into a functional graph
(trace_call), that graph rewritten (des.compiler.functional), and the SAME object given the
rewritten forward pass; a model whose ``compute_loss`` calls towers (TFRS retrieval) has each
tower transformed on its own."""
from __future__ import annotations


import tensorflow as tf

import dataclasses

from des.compiler.handle import attach, distributed
from des.graph.ir import trace_used
from des.graph.sources import source_of
from des_ops.comm import Communicator
from des_ops.keras_internals import input_spec_of
from des_ops.tail import sum_tail_gradients

from des.compiler.report import Report, TransformError
from des.compiler.functional import transform_functional
from des.compiler.options import Options


def transform_subclassed(model: tf.keras.Model, options: Options, comm: Communicator, spec=None, sample=None,
                         input_prefix: str = "input") -> tuple[tf.keras.Model, Report]:
    """des.transform of a subclassed model (or of a tower, traced like one): see transform's
    docstring. ``input_prefix`` names the traced inputs that are not keys of a dict."""
    traced, why = trace_call(model, sample, input_prefix)
    if traced is None and type(model).call is tf.keras.Model.call:
        towers = _towers(model)
        if towers:
            return _transform_towers(model, towers, options, comm, spec, sample)
    if traced is None:
        report = Report([], [], None, comm.rank, comm.world_size, opaque=[why])
        if options.strict:
            raise TransformError(report)
        return model, report
    rewritten, report = transform_functional(traced, options, comm, spec)
    if not report.changed:
        return model, report
    model.des_forward = rewritten                   # tracked: its DES layer's weights are the model's
    for m in report.substitutions:                  # the user's object still holds the substituted Dense:
        if type(m.root.layer) is tf.keras.layers.Dense:    # its kernel is split into the owners' blocks, its
            m.root.layer.trainable = False          # bias lives on in the DES tail: nothing to train there

    def call(inputs, training=None, **_):
        return rewritten(inputs, training=training)
    model.call = call
    handle = distributed(rewritten)
    handle.subclassed = model                       # a save writes the user's own class (des.runtime.saving)
    handle.frozen = [m.root.layer for m in report.substitutions if type(m.root.layer) is tf.keras.layers.Dense]
    attach(model, handle)                           # the same handle: plan, DES layer, state keys, tail
    if handle.tail_variables:        # the data-parallel tail's and shared kernel rows' (des.compiler.big_tables)
        sum_tail_gradients(model, comm, handle.tail_variables)     # the user compiles this model
    return model, report


def _towers(model: tf.keras.Model) -> dict[str, tf.keras.Model]:
    """The model's direct attributes that are Keras models holding tables, in tracking order
    (the same on every process)."""
    out = {}
    for attr, value in vars(model).items():
        if attr.startswith("_") or not isinstance(value, tf.keras.Model):
            continue
        if any(isinstance(m, tf.keras.layers.Layer) and source_of(m) for m in value.submodules):
            out[attr] = value
    return dict(sorted(out.items()))


def _transform_towers(model: tf.keras.Model, towers: dict, options: Options, comm: Communicator, spec,
                      sample) -> tuple[tf.keras.Model, Report]:
    """des.transform of a model whose compute_loss calls towers (TFRS retrieval): each tower on
    its own, its DES layer's collective named by the tower's attribute; one report."""
    if options.tail == "data_parallel":
        raise ValueError(f"des.transform: {model.name!r} calls its towers in compute_loss; only tail='replicated' "
                         f"is supported there (each tower's outputs are already the whole batch's)")
    unbuilt = [a for a, t in towers.items() if input_spec_of(t) is None]
    if unbuilt and sample is not None and hasattr(model, "compute_loss"):
        model.compute_loss(dict(sample) if isinstance(sample, dict) else sample, training=False)  # builds the towers
        for m in model.metrics:
            m.reset_state()
        unbuilt = [a for a, t in towers.items() if input_spec_of(t) is None]
    if unbuilt:
        report = Report([], [], None, comm.rank, comm.world_size, opaque=[
            f"{model.name!r} ({type(model).__name__}): its towers {unbuilt} have not been called yet, so their input "
            f"shapes are unknown: pass sample=<a batch of the features compute_loss reads> to des.transform"])
        if options.strict:
            raise TransformError(report)
        return model, report
    reports = {}
    for attr, tower in towers.items():      # traced: inputs named by the attribute, the same on every process
        mine = dataclasses.replace(options, scope=f"{options.scope}{attr}",
                                   tail="replicated")   # each tower's outputs are already the whole batch's
        if getattr(tower, "_is_graph_network", False):      # Sequential / functional: put the DES model in its place
            traced, why = trace_call(tower, None, attr)
            new, reports[attr] = transform_functional(traced, mine, comm, spec) if traced is not None else \
                (tower, Report([], [], None, comm.rank, comm.world_size, opaque=[why]))
            if reports[attr].changed:
                setattr(model, attr, new)
        else:                                               # subclassed: the same object, its call replaced
            _, reports[attr] = transform_subclassed(tower, mine, comm, spec, None, input_prefix=attr)
    changed = [r for r in reports.values() if r.changed]
    report = Report([m for r in changed for m in r.substitutions], [x for r in reports.values() for x in r.rejections],
                    None, comm.rank, comm.world_size,
                    tables=[f"{attr}: {line}" for attr, r in reports.items() for line in r.tables],
                    unsubstituted=[t for r in reports.values() for t in r.unsubstituted],
                    opaque=[o for r in reports.values() for o in r.opaque])
    if changed:
        report.save_refusal = (f"{model.name!r}: des.transform rewrote its towers one by one "
                             f"({', '.join(a for a, r in reports.items() if r.changed)}): the whole model does not save yet; "
                             f"save each tower (model.<tower>.save(path), on every process)")
        report.floats_per_sample = sum(r.floats_per_sample for r in changed)
        report.collectives = len(changed)
        report.widths = {k: w for r in changed for k, w in r.widths.items()}
        report.compiled = f"towers transformed one by one: {', '.join(a for a, r in reports.items() if r.changed)}"
    return model, report


def trace_call(model: tf.keras.Model, sample=None, input_prefix: str = "input") -> tuple[tf.keras.Model | None, str]:
    """A functional model of ``model.call`` on symbolic inputs (those ``call`` reads), sharing
    ``model``'s layers, or (None, why not). Inputs that are not keys of a dict are named
    ``input_prefix`` (one) or ``input_prefix_<i>``: the same on every process."""
    name = f"{model.name!r} ({type(model).__name__}, subclassed)"
    spec = input_spec_of(model, sample)
    if spec is None:
        return None, (f"{name}: its input shapes are unknown: pass sample=<a batch of its inputs> to des.transform, "
                      f"or call the model once on a batch first")
    try:
        traced = trace_used(model, spec, input_prefix)
    except Exception as e:  # noqa: BLE001 - any failure of the user's call is a reason, not a traceback
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return None, (f"{name}: its call() could not be traced on symbolic inputs ({type(e).__name__}: {first}); "
                      f"write it with TensorFlow ops (tf.cond, tf.where) instead of Python control flow on "
                      f"tensor values, and keep its state in layers")
    return traced, ""

"""DES: Distributed Equivalent Substitution for tf.keras CTR models.

    >>> import des, models
    >>> from des.data import FeatureSpec, Field
    >>> spec = FeatureSpec((Field("user", dim=4), Field("item", dim=4)))
    >>> model, report = des.transform(models.deepfm(spec, hidden=(8,)))   # under mpirun: Horovod world; else size 1
    >>> print(report)
    des.transform: 3 substitution(s), rank 0 of 1:
      lr_sum               at 'add': 2 field vectors, partial width 1, 2 replicated input(s)
      fm_interaction       at 'fm': 2 field vectors, partial width 5
      embed_concat_dense   at 'dnn_0': 2 field vectors, partial width 8
      one fused allreduce of 14 floats per sample = 56 bytes/sample; at B=4096: 229,376 bytes handed over, 0 sent per process (ring)
      tail chosen by the cost model (tail='auto'): replicated: one process, nothing to share
    tables:
      emb4_user (FieldEmbedding, width 4, field 'user'): substituted in fm_interaction at 'fm', embed_concat_dense at 'dnn_0'
      emb4_item (FieldEmbedding, width 4, field 'item'): substituted in fm_interaction at 'fm', embed_concat_dense at 'dnn_0'
      emb1_user (FieldEmbedding, width 1, field 'user'): substituted in lr_sum at 'add'
      emb1_item (FieldEmbedding, width 1, field 'item'): substituted in lr_sum at 'add'
      fused table des_fused4_rank0...: the rows of 2 table(s) of width 4 (emb4_user, emb4_item) in one TFRA table
      fused table des_fused1_linear_rank0...: the rows of 2 table(s) of width 1 (emb1_user, emb1_item) in one TFRA table
    field plan (balanced, 1 processes):
      rank 0: load 2.000  [user, item]
    options: plan=balanced tail=auto first_dense=auto tables=auto micro_batches=1 wire_dtype=float32 seed=0 (tables: fused)

Backends (TensorFlow, Horovod, TFRA) are imported lazily.
"""
import os as _os

_os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from des import quiet as _quiet  # noqa: E402 - before anything loads TensorFlow

_quiet.install()

__version__ = "0.1.0"


def transform(model, options=None, *, comm=None, spec=None, sample=None, **moved):
    """(DES model for this process, report) of a Keras model; ``options``: a des.Options.
    See des.compiler.api.transform. The model it returns saves, checkpoints and exports with
    every process's trained rows (des.runtime.saving). ``moved``: the keywords that were
    des.transform's own before des.Options (``tail=...``) raise a TypeError naming their new place."""
    if moved:
        shown = {k: v for k, v in moved.items() if k not in ("fuse_tables", "join_linear")}
        if moved.get("fuse_tables"):
            shown["tables"] = "joined" if moved.get("join_linear") else "fused"
        given = ", ".join(f"{k}={v!r}" for k, v in shown.items())
        raise TypeError(f"des.transform: {', '.join(moved)} {'is' if len(moved) == 1 else 'are'} now of "
                        f"des.Options: des.transform(model, des.Options({given}))")
    if options is not None and getattr(options, "mode", "des") != "des":     # DES weighed against a PS
        from des.baselines.ps.user import transform as compile_model
    else:
        from des.compiler import transform as compile_model
    from des.runtime.saving import install
    new, report = compile_model(model, options, comm=comm, spec=spec, sample=sample)
    if report.changed or report.save_refusal:
        install(new, report.save_refusal)
    if options is not None and options.row_policy.active:
        from des.runtime.bounded import bound_rows, describe
        report.row_policy = describe(new, options.row_policy, bound_rows(new, options.row_policy))
    return new, report


def distributed(model):
    """The handle (plan, DES layer, state keys, tail) of a model des.transform returned, else None;
    see des.compiler.handle."""
    from des.compiler.handle import distributed as _distributed
    return _distributed(model)


_HOMES = {"Options": "des.compiler.options", "AutoTail": "des.compiler.options", "RowPolicy": "des.compiler.options",
          "TransformError": "des.compiler", "make_keyed": "des.compiler.keys",
          "register_adapter": "des.graph.adapters", "bound_rows": "des.runtime.bounded",
          "table_rows": "des.runtime.bounded"}


def __getattr__(name):
    """Lazily: des.Options (how des.transform splits a model), des.TransformError, des.make_keyed (TFRA tables with key-deterministic new rows),
    des.register_adapter (map a third-party layer to canonical math), des.AutoTail (what
    tail="auto" assumes: batch size, FLOP rate, bandwidth), des.RowPolicy (admission and eviction
    of table rows; des.bound_rows applies one to an untouched model, des.table_rows counts), des.export (``des.export(model, out)``:
    one SavedModel for serving) and des.checkpoint (save and restore with optimizer state)."""
    if name in ("export", "checkpoint"):  # des.export(model, out) (a callable module), des.checkpoint.save(...)
        import importlib
        return importlib.import_module(f"des.{name}")
    if name in _HOMES:
        import importlib
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(name)

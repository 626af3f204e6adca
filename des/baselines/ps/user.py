"""A user's model on the parameter server through des.transform: ``des.Options(mode="ps")``, or
``mode="auto"`` (DES or the PS, whichever moves fewer bytes on a batch of the inputs,
des.jobs.auto.choose; DES weighed by the exchange des.transform would build: its rows exchange
when its first layer goes by rows, else its partials, as ``des.train --mode auto`` weighs them).

The model keeps DES's contract: every process is handed the whole global batch and sees the
whole batch's loss, metrics and predictions. Its tables are sharded by key (des.baselines.ps.rewrite.shard,
each key's row on process key mod N); a training step takes this process's rows of the batch
(des_ops.comm.shard_rows), trains on them as the PS does (its share of the global mean loss,
rows and gradient rows by all-to-all, dense gradients summed) and all-gathers the predictions for
the metrics, so the update and the reported loss are the single process's on the whole batch.
Evaluation and prediction look up the whole batch on every process. ``model.save``,
``save_weights``, ModelCheckpoint and ``des.export`` (every process calls them) write the model
the user gave des.transform, its tables holding every process's rows (gathered on rank 0).

    >>> import des
    >>> from gallery import BUILDERS, batches_for          # tests/gallery.py: models users write
    >>> model = BUILDERS["tfra_deepfm"]()
    >>> x, _ = batches_for(model, 1, 64, seed=0)[0]
    >>> ps, report = des.transform(model, des.Options(mode="ps"), sample=x)
    >>> type(ps).__name__, report.mode
    ('WholeBatchPS', 'ps')
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
from typing import Iterator

import numpy as np
import tensorflow as tf

from des.baselines.ps.rewrite import PSModel, refusal, shard, table_inputs
from des.baselines.ps.tables import KeyExchange
from des.compiler.api import transform as substitute
from des.compiler.options import Options
from des.compiler.cost import AutoTail
from des.compiler.functional import _compile_like, first_layer_plan, mark_linear_tables
from des.compiler.keys import sync_from_root
from des.compiler.report import Report
from des.graph.ir import Graph
from des.graph.sources import source_of
from des.runtime.saving import allgather_bytes, written_by_root
from des.jobs.auto import choose
from des_ops.comm import Communicator, agree, shard_rows
from des_ops.mpi import default_communicator


def transform(model: tf.keras.Model, options: Options, *, comm: Communicator | None = None, spec=None,
              sample=None) -> tuple[tf.keras.Model, Report]:
    """des.transform for des.Options(mode="ps" | "auto"): (the model for this process, report),
    a WholeBatchPS or, when DES is chosen, des.compiler.transform's model with the reason."""
    comm = comm or default_communicator()
    mode, why, planned = choose_mode(model, options, comm, sample)
    if mode == "des":
        if planned is None:
            return substitute(model, options, comm=comm, spec=spec, sample=sample, chosen=why)
        # the link measured once: DES is built on the costs it was weighed with
        costs, link = planned
        new, report = substitute(model, dataclasses.replace(options, costs=costs), comm=comm, spec=spec,
                                 sample=sample, chosen=why)
        report.link = link
        return new, report
    ps = shard_users_model(model, comm, options.seed, options.sync_weights, options.tables_for(model))
    report = Report([], [], None, comm.rank, comm.world_size,
                    tables=ps_lines(model, comm.world_size) + list(ps.fused_lines),
                    options=options, compiled=ps.des_compiled, mode="ps", mode_reason=why)
    return ps, report


def choose_mode(model: tf.keras.Model, options: Options, comm: Communicator,
                sample) -> tuple[str, str, tuple[AutoTail, str] | None]:
    """("des" | "ps", why, planned) for des.Options(mode="ps" | "auto"); the same on every process
    (checked: processes that chose otherwise end the job, named). DES is weighed by the exchange
    des.transform would pick with ``options``: its rows exchange when its first layer goes by
    rows (des.compiler.functional.first_layer_plan), else its partials. ``planned``: the costs
    and link line that plan assumed (the link is measured once), or None."""
    if not getattr(model, "_is_graph_network", False):
        if options.mode == "ps":
            raise ValueError(f"des.Options(mode='ps'): the parameter server shards the tables of a functional "
                             f"model; {type(model).__name__} is subclassed (use mode='des')")
        return "des", "mode auto: DES (a subclassed model: the parameter server shards functional models only)", None
    if options.mode == "ps":
        return "ps", "mode ps: asked for", None
    if sample is None:
        raise ValueError("des.Options(mode='auto') weighs DES against a parameter server on a batch of the inputs: "
                         "pass sample= (a global batch, the same on every process)")
    cannot = refusal(Graph(model), "ps")        # nothing to weigh: the PS cannot take this model
    planned = None
    if cannot:
        mode, why = "des", f"mode auto: DES, as a PS cannot shard this model ({cannot})"
    else:
        plan = first_layer_plan(model, dataclasses.replace(options, mode="des"), comm, sample)
        rows = plan is not None and plan[2]
        choice = choose(model, sample, comm.world_size, des_exchange="rows" if rows else "partials")
        mode, why = choice.mode, str(choice).replace("plan auto:", "mode auto:", 1)
        planned = plan[:2] if plan is not None else None
    agree(comm, "mode des.Options(mode='auto') chose (is sample= the same batch on every process?)", mode)
    return mode, why, planned


class WholeBatchPS(PSModel):
    """A PSModel that takes the global batch (des.transform's contract) and trains on its rows."""

    def train_step(self, data):
        x, y = data[0], data[1]
        comm = self.exchange.comm
        b = tf.shape(tf.nest.flatten(y)[0], out_type=tf.int64)[0]
        lo, hi = shard_rows(b, comm.rank, comm.world_size)
        rows_of = lambda t: tf.nest.map_structure(lambda v: v[lo:hi], t)  # noqa: E731
        trackers = self._loss_trackers()
        before = [tf.stack([tf.identity(t.total), tf.identity(t.count)]) for t in trackers]   # before this step
        with tf.control_dependencies(before):
            pred, share = self.update(rows_of(x), rows_of(y))
        flat = tf.nest.flatten(pred)
        whole = tf.nest.pack_sequence_as(pred, [comm.allgather(tf.stop_gradient(p), f"ps_whole_batch_predictions{i}")
                                                for i, p in enumerate(flat)])
        # update() left Keras's loss Means with this slice's losses; make them the global batch's, from
        # their state before the step: the total from the processes' shares (penalties included), each
        # output's from what the slices added to it, summed: the same bits on every process
        added = [t.total - was[0] for t, was in zip(trackers[1:], before[1:])]
        total, *per_output = tf.unstack(self.exchange.sum_across(tf.stack([share] + added), counter="metrics_bytes"))
        rows = tf.cast(b, tf.float32)
        for t, was, summed in zip(trackers, before, [rows * total] + per_output):
            t.total.assign(was[0] + summed)
            t.count.assign(was[1] + rows)
        return self.compute_metrics(x, y, whole, None)

    def _loss_trackers(self) -> list:
        """Keras's Means of the total loss and of each output's loss (LossesContainer's, built here
        if this is the first step, so that their state can be read before the step updates them)."""
        losses = self.compiled_loss
        total = getattr(losses, "_total_loss_mean", None)
        if total is None:
            return []
        if not losses.built:
            losses.build(self.output)
        return [total] + [m for m in tf.nest.flatten(losses._per_output_metrics or []) if m is not None]

    @property
    def des_comm(self) -> Communicator:
        """The processes that save this model together (des.runtime.saving)."""
        return self.exchange.comm

    @contextlib.contextmanager
    def des_untouched(self) -> Iterator[tf.keras.Model | None]:
        """On rank 0, the model des.transform was given, its tables holding every process's
        trained rows (its other layers are this model's: trained in place); None elsewhere. Every
        process enters it (one gather of the rows in pieces); afterwards the given model's tables
        hold again what they held before."""
        comm = self.exchange.comm
        held = [source_of(new).export(new) for new, _ in self.table_pairs]     # the rows this process holds
        blob = io.BytesIO()
        np.savez(blob, **{f"{kind}{i}": a for i, rows in enumerate(held) for kind, a in zip("kv", rows)})
        blobs = allgather_bytes(comm, blob.getvalue(), "des_ps_save_rows")
        if comm.rank != 0:
            yield None
            return
        parts = [np.load(io.BytesIO(b)) for b in blobs]
        before = []
        try:
            for i, (_, old) in enumerate(self.table_pairs):
                source = source_of(old)
                before.append((source, old, source.export(old)))
                source.load(old, np.concatenate([p[f"k{i}"] for p in parts]), np.concatenate([p[f"v{i}"] for p in parts]))
            yield self.des_source
        finally:
            for source, old, (keys, values) in before:
                source.load(old, keys, values)

    def save(self, filepath, *args, **kwargs):
        """``model.save``: every process calls it; rank 0 writes the model des.transform was given,
        with every trained row and weight (des.runtime.saving)."""
        written_by_root(self, "model.save", filepath,
                        lambda full: type(full).save(full, filepath, *args, **kwargs))

    def save_weights(self, filepath, *args, **kwargs):
        """``model.save_weights``: as ``save``, the given model's weights."""
        written_by_root(self, "model.save_weights", filepath,
                        lambda full: type(full).save_weights(full, filepath, *args, **kwargs))


def shard_users_model(model: tf.keras.Model, comm: Communicator, seed: int, sync_weights: bool,
                      tables: str = "per-field") -> WholeBatchPS:
    """``model``'s tables sharded by key over ``comm``'s processes, as a WholeBatchPS compiled as
    ``model`` was (``des_compiled``: the report's line). ``sync_weights``: every process first takes
    rank 0's weights (a model built with random initialisers starts the same everywhere). ``tables``
    (des.Options.tables_for): "fused", the sharded TFRA tables of one width in one table per process
    (one set of all-to-alls per width and step, not per table: des.baselines.ps.tables.ShardedFusedTable);
    "joined", and each field's linear weight in its embedding's row; "per-field", as declared."""
    if sync_weights and comm.world_size > 1:
        sync_from_root(Graph(model), comm)
    if tables == "joined":
        mark_linear_tables(model)                # which 1-wide tables are the linear part, as DES finds them
    ps = shard(model, KeyExchange(comm), cls=WholeBatchPS, seed=seed, fuse=tables != "per-field",
               join_linear=tables == "joined")
    object.__setattr__(ps, "des_source", model)      # not tracked: what a save writes
    ps.des_compiled = _compile_like(model, ps)
    return ps


def ps_lines(model: tf.keras.Model, world_size: int) -> list[str]:
    """One report line per table the PS shards: its ids input and width."""
    return [f"table of {ids!r} (width {dim}) sharded by key over {world_size} process(es): key k on process "
            f"k mod {world_size}" for ids, _, dim in table_inputs(model)]

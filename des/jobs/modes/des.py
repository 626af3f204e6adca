"""``--mode des``: the first layers field-partitioned over the processes (des.transform).

    mpirun -np 4 python -m des.train --mode des --model deepfm --data train.txt

Every process reads the whole global batch (on columnar data only the labels and its own
fields' columns; from text it checks every line but turns only its own fields' values into ids),
computes its fields' partials and one allreduce combines them. Measured per step: the bytes
handed to the allreduce (against 4*B*floats), their ring share, and the replica check (every K
steps the replicated weights and the batch fingerprint agree).
"""
from __future__ import annotations

import tensorflow as tf

import des
from des.runtime import checkpoint
from des.runtime.callbacks import BytesPerStep, ReplicaCheck
from des.compiler.choices import exchanged_keys
from des.compiler.cost import distinct_share, unique_ids_per_slice
from des.compiler.handle import distributed
from des.jobs.modes.base import Mode
from des_ops.mpi import default_communicator
from des_ops.rows import key_input


class DES(Mode):
    name = "des"
    _reads = "every process reads the whole batch"
    _inputs: list[str] | None = None      # this process's own inputs (set by prepare)

    def _communicator(self):
        return default_communicator(self.config.network.comm)

    def prepare(self, model):
        a = self.config
        plan = (a.restore and checkpoint.load_plan(a.restore, self.world_size)) or a.plan
        first = {k: v.numpy() for k, v in self.run.first_batch().items()}
        distinct = distinct_share(first, self.run.spec, self.world_size)
        model, self.report = des.transform(model, a.options(plan, distinct), comm=self.comm, spec=self.run.spec)
        self.report.estimate_costs(a.batch, unique_ids_per_slice(first, self.run.spec, self.world_size))
        self.run.log(self.report)
        self._inputs = own_inputs(model, self.run.spec, self.rank)
        read = ("reads the labels and its own fields' columns" if a.format == "columnar" else
                "checks every line and turns only its own fields' values into ids")
        self.run.log(f"each process {read} (rank {self.rank}: {len(self._inputs)} of "
                     f"{len(self.run.spec.input_names())} inputs)")
        return model

    def read_inputs(self):
        return self._inputs

    def callbacks(self, model) -> list:
        self.traffic = BytesPerStep(self.comm)
        every = self.config.replica_check
        return [self.traffic] + ([ReplicaCheck(self.comm, every)] if every else [])

    def sum_across(self, values):
        if self.world_size == 1:
            return list(values)
        return [float(v) for v in self.comm.allreduce_counted(tf.constant(values, tf.float32), "barrier").numpy()]

    def summarise(self, model, summary: dict) -> None:
        report, comm, batch, traffic = self.report, self.comm, self.config.batch, self.traffic
        counted = comm.counted()
        summary.update(floats_per_sample=report.floats_per_sample, tail=report.tail, tail_reason=report.tail_reason,
                       first_layer=report.first_layer, first_layer_reason=report.first_layer_reason,
                       first_dense_by_rows=sorted(report.by_rows), first_dense_reason=report.first_dense_reason,
                       micro_batches=report.micro_batches, wire_dtype=report.wire_dtype,
                       bytes_per_step_measured=traffic.median(),
                       bytes_per_step_analytic=report.payload_bytes(batch),
                       ring_bytes_per_step=report.ring_bytes(batch), collectives=counted,
                       check_bytes_per_step=counted["check"]["bytes"] / max(1, len(traffic.per_step)))
        summary.update(sent_bytes_per_step=comm.ring_bytes(summary["bytes_per_step_measured"]
                                                           + summary["check_bytes_per_step"]),
                       analytic_sent_bytes_per_step=report.ring_bytes(batch),
                       costs=[dict(rule=c.rule, layer=c.layer, des_bytes=c.des_bytes, ps_bytes=c.ps_bytes,
                                   verdict=c.verdict) for c in report.costs])
        c = summary["collectives"]
        self.run.log(f"DES bytes/step handed to allreduce: measured {summary['bytes_per_step_measured']:.0f}, "
                     f"analytic {summary['bytes_per_step_analytic']} ({self.report.bytes_per_float}*B*{self.report.floats_per_sample}); a ring "
                     f"would send {summary['ring_bytes_per_step']:.0f} per process (model); replica checks "
                     f"{c['check']['bytes']} B in {c['check']['calls']} allreduce(s), broadcasts "
                     f"{c['broadcast']['bytes']} B"
                     + (f"; data-parallel tail: the partials reduce-scattered, {c['tail']['bytes']} B in "
                        f"{c['tail']['calls']} all-gather(s) and gradient allreduce(s)"
                        if self.report.tail == "data_parallel" else ""))


def own_inputs(model, spec, rank: int) -> list[str]:
    """The inputs a DES process needs: its own fields' ids (and weights), the first field's, which
    every process reads so the replica check's batch fingerprint stays comparable, and the id
    inputs by which rows travel once per distinct id (des_ops.rows.Block: a receiver places the
    rows of its samples by their ids, whoever owns the field)."""
    handle = distributed(model)
    plan = handle.plan
    first = spec.sparse()[0].name
    keyed = {key_input(k) for k in exchanged_keys(handle.layer.ops)}
    fields = [f for f in spec if f.kind == "numeric" or plan.owner.get(f.name) == rank or f.name == first
              or f.name in keyed]
    unknown = [f.name for f in spec.sparse() if f.name not in plan.owner]
    if unknown:            # the plan's fields are not the spec's: read everything
        return spec.input_names()
    handle.layer.fingerprint_inputs = (first,)
    return [n for f in fields for n in ([f.name, f.weight_name] if f.weighted else [f.name])]

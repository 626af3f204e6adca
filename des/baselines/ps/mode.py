"""``--mode ps``: the parameter-server baseline, tables sharded by key (des.baselines.ps.rewrite), data parallel.

    mpirun -np 4 python -m des.train --mode ps --allocate laia --data train.txt

Each process trains its share of every global batch: a contiguous slice, or the share an
allocator gives it (``--allocate``, des.baselines.allocate). Measured per step: the bytes each process
sends and receives by all-to-all, per counter, checked against the analytic formula.
"""
from __future__ import annotations

import sys

import tensorflow as tf

from des.baselines import allocate
from des.baselines.ps import rewrite as ps
from des.baselines.ps.tables import KeyExchange
from des.runtime.callbacks import CounterDeltas
from des.jobs.modes.base import Mode, ModeError, epoch_seed
from des_ops.mpi import NoopCommunicator, default_communicator


class PS(Mode):
    name = "ps"
    sharded = True

    def _communicator(self):
        kind = self.config.network.comm
        meet = {"noop": "never", "sync": "scalars", "meet": "every"}.get(kind)   # timing only (des.cluster.timemodel)
        self.exchange = KeyExchange(NoopCommunicator(meet=meet) if meet else default_communicator(launched="horovod"),
                                    wire_dtype=self.config.wire_dtype)
        self.allocators: list = []
        return self.exchange.comm

    @property
    def global_batch(self) -> int:
        return self.config.batch * (self.world_size if self.config.allocation.ps_batch == "per-process" else 1)

    def check(self) -> None:
        cache = self.config.cache
        if cache.on_demand or cache.plan_pushes:
            raise ModeError(f"--{'on-demand' if cache.on_demand else 'plan-pushes'} is a plan of --mode cache "
                            f"--staleness 0")
        self._check_top_k()
        self._check_options_of_other_modes()

    def _check_top_k(self) -> None:
        k = self.config.allocation.top_k
        if k is not None and (self.config.allocation.strategy != "laia" or k < 1):
            raise ModeError(f"--allocate-top-k {k}: a count >= 1 of inputs laia scores (with --allocate laia)")

    def train_shard(self, epoch: int):
        """Contiguous slices, or a des.baselines.allocate.Share of a new allocator per epoch (batches the
        input pipeline prefetched but fit never trained cannot make the processes differ)."""
        if self.config.allocation.strategy == "contiguous" and not self.config.cache.on_demand:
            return self.eval_shard()
        # The allocator runs in the input pipeline's thread and holds the GIL for most of its
        # numpy work; with Python's default 5 ms switch interval Keras's step loop, which takes the
        # GIL hundreds of times per step (callbacks, counters), waits up to 5 ms each time and the
        # step slowed several-fold (measured: PS laia 831 vs 3,700 samples/s on 2 processes).
        sys.setswitchinterval(2e-4)
        a = self.config
        sgd = a.sgd_everywhere                # the cache's local update
        self.allocators.append(allocate.make(a.allocation.strategy, self.world_size, self._keys, self._capacity(),
                                             seed=epoch_seed(a.seed, epoch), keeps_own_updates=sgd,
                                             top_k=a.allocation.top_k))
        return allocate.Share(self.allocators[-1], self.rank, others=a.cache.on_demand, evictions=self._planned())

    def eval_shard(self):
        return (self.rank, self.world_size)

    def _capacity(self):
        return None

    def _planned(self) -> bool:
        """The caches evict what the allocator's simulation evicts (the cache mode with laia)."""
        return False

    def prepare(self, model):
        model = self._shard(model)
        self._keys = [ids for ids, _, _ in ps.table_inputs(model)]
        self._log_allocation()
        return model

    def _shard(self, model):
        """The reference model with its tables sharded by key (the cache mode: and cached)."""
        model = ps.shard(model, self.exchange, fuse=self.config.tables != "per-field",
                         join_linear=self.config.join_linear)
        model.record_first_steps(self.config.check_bytes)
        for line in model.fused_lines:
            self.run.log(line)
        self.run.log(f"PS: {len(ps.table_inputs(model))} tables sharded by key over {self.world_size} process(es), "
                     f"{ps.dense_parameters(model)} dense parameters allreduced; global batch {self.global_batch}")
        return model

    def _log_allocation(self) -> None:
        a = self.config
        if a.allocation.strategy == "contiguous" and not a.cache.on_demand:
            return
        if a.cache.on_demand:
            self.run.log("cache: on-demand plan (each process reads the keys the others use this step; no queries)")
        how = {"laia": "samples go to the process that owns or caches their keys", "random": "a seeded random split",
               "contiguous": "contiguous slices"}[a.allocation.strategy]
        b, n = self.global_batch, self.world_size
        self.run.log(f"allocation: {a.allocation.strategy} ({how}, {b // n}-{-(-b // n)} per process; "
                     f"evaluation: contiguous slices)")

    def _counters(self, model) -> dict:
        ex = self.exchange
        counters = dict(ex.counters)
        counters.update({f"sent_{k}": v for k, v in ex.sent.items()})
        counters.update({f"received_{k}": v for k, v in ex.received.items()})
        return counters

    def callbacks(self, model) -> list:
        self.traffic = CounterDeltas(self._counters(model))
        return [self.traffic]

    def sum_across(self, values):
        if self.world_size == 1:
            return list(values)
        total = self.exchange.sum_across(tf.constant(values, tf.float32), counter="barrier_bytes")
        return [float(v) for v in total.numpy()]

    def evaluate(self, model, data) -> dict:
        model.evaluate(data, verbose=0, return_dict=True)
        return ps.aggregate_metrics(model, self.exchange)      # the metrics of every slice together

    def summarise(self, model, summary: dict) -> None:
        self._summarise_allocation(summary)
        summary.update(ps.traffic_summary(model, self.traffic.steps, self.rank, self.world_size),
                       tables=len(ps.table_inputs(model)), lookups=len(ps.lookup_tables(model)))
        self.run.log(f"PS bytes/step sent per process: measured {summary['sent_bytes_per_step']:.0f} "
                     f"(all-to-all {summary['alltoall_bytes_per_step']:.0f} + dense ring model "
                     f"{summary['dense_ring_bytes_per_step']:.0f}), analytic "
                     f"{summary['analytic_sent_bytes_per_step']:.0f}; {summary['unique_ids_per_step']:.0f} unique "
                     f"ids per step; measured == analytic in {summary['bytes_exact_steps']} steps")

    def _summarise_allocation(self, summary: dict) -> None:
        a, allocators = self.config, self.allocators
        summary["allocate"] = a.allocation.strategy
        if allocators:
            trained = [x.hashes[:a.steps] for x in allocators]   # not the batches prefetched past --steps
            samples = sum(x.samples for x in allocators)
            wall = sum(x.seconds + x.extra_seconds for x in allocators)   # with the key lists the plan reads
            cpu = sum(x.cpu_seconds + x.extra_cpu_seconds for x in allocators)
            speed, cpu_speed = (samples / wall if wall else None), (samples / cpu if cpu else None)
            summary["allocation"] = {"batches": sum(map(len, trained)),
                                     "digest": "-".join(x.digest(a.steps) for x in allocators),
                                     "samples_per_second": speed, "samples_per_cpu_second": cpu_speed}
            if wall and cpu:
                trains = summary["samples_per_second"]
                self.run.log(f"allocation ({a.allocation.strategy}): {speed:.0f} samples/s of allocator wall time "
                             f"({speed / trains:.1f}x the training's {trains:.0f}), {cpu_speed:.0f} per second of "
                             f"its CPU time ({cpu_speed / trains:.1f}x)")
        summary["collectives"] = {k: v for k, v in self.exchange.snapshot().items()
                                  if k in ("metrics_bytes", "barrier_bytes")}

"""des.jobs.modes: each training mode is one class with the same interface; des.train only dispatches.

In one process (world size 1): the registry matches the CLI's choices, options that do not
apply to a mode are refused with a clear message, the PS/cache modes hand the reader a new
allocator's share per epoch, and each mode's hooks run in des.train's order on a tiny batch
(prepare -> compile -> callbacks -> fit -> evaluate -> summarise) with the summary a mode owes.
"""
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

import models
from des.jobs import modes
from des.jobs.config import RunConfig
from des.jobs.verify import random_batches, small_spec


def options(**kw) -> RunConfig:
    """des.train's options, parsed as the CLI does (so the defaults are the real ones)."""
    argv = ["--data", "unused.txt"]
    for k, v in kw.items():
        argv += [f"--{k.replace('_', '-')}"] + ([] if v is True else [str(v)])
    return RunConfig.parse(argv)


def make_run(spec, first, **kw) -> modes.Run:
    x, _ = first
    return modes.Run(options(**kw), spec, lambda: {k: tf.constant(v) for k, v in x.items()},
                     lambda: models.build("deepfm", spec, seed=1, hidden=(4,)))


def test_every_registered_mode_is_made_and_the_cli_offers_exactly_those():
    _args = RunConfig.parse
    for name in modes.MODES:
        mode = modes.make(name, make_run(small_spec(), random_batches(small_spec(), 1, 8)[0], mode=name))
        assert mode.name == name and (mode.rank, mode.world_size) == (0, 1)
        assert mode.sharded == (name in ("ps", "cache"))
        assert _args(["--data", "x", "--mode", name]).mode == name
    with pytest.raises(SystemExit):
        _args(["--data", "x", "--mode", "laia"])      # an allocation, not a mode


@pytest.mark.parametrize("name, kw, message", [
    ("single", {"allocate": "laia"}, "--allocate laia is for --mode ps and cache (under single there is one process)"),
    ("des", {"allocate": "random"}, "under des every process reads the whole batch"),
    ("des", {"on_demand": True}, "--on-demand is a plan of --mode cache --staleness 0"),
    ("ps", {"on_demand": True}, "--on-demand is a plan of --mode cache"),
    ("cache", {"staleness": "1.5"}, "--staleness must be a whole number"),
    ("cache", {"cache_size": "0"}, "--cache-size must be rows"),
    ("ps", {"allocate_top_k": 3}, "--allocate-top-k 3: a count >= 1 of inputs laia scores"),
    ("cache", {"allocate": "laia", "allocate_top_k": 0}, "--allocate-top-k 0: a count >= 1"),
    ("des", {"allocate_top_k": 3}, "--allocate-top-k is an option of --allocate laia"),
    ("cache", {"allocate": "laia", "eviction": "lfu"}, "--allocate laia simulates LRU caches"),
    ("cache", {"tables": "fused", "staleness": "0", "on_demand": True},
     "--tables fused: --on-demand name each field's keys; they need --tables per-field"),
    ("cache", {"staleness": "0", "on_demand": True, "plan_pushes": True, "optimizer": "adam"},
     "--plan-pushes keeps updates in the workers' cache lines"),
    ("ps", {"plan_pushes": True}, "--plan-pushes is a plan of --mode cache"),
    # options of another mode (the PS and the cache once ignored these without a word)
    ("ps", {"micro_batches": 2}, "--micro-batches is an option of --mode des"),
    ("cache", {"tail": "data_parallel"}, "--tail data_parallel is an option of --mode des"),
    ("cache", {"wire_dtype": "float16"}, "--wire-dtype float16 is an option of --mode des (the partials) and ps"),
    ("single", {"wire_dtype": "float16"}, "--wire-dtype float16 is an option of --mode des"),
])
def test_options_that_do_not_apply_are_refused(name, kw, message):
    spec = small_spec()
    with pytest.raises(modes.ModeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        modes.make(name, make_run(spec, random_batches(spec, 1, 8)[0], mode=name, **kw))


def test_options_that_apply_are_accepted():
    spec = small_spec()
    batch = random_batches(spec, 1, 8)[0]
    for name, kw in [("ps", {"allocate": "laia"}), ("ps", {"wire_dtype": "float16"}),
                     ("ps", {"tail": "auto"}), ("single", {"tail": "auto"}),   # --mode auto --tail auto may pick them
                     ("cache", {"allocate": "random", "staleness": "0",
                                                               "on_demand": True, "cache_size": "5"})]:
        assert modes.make(name, make_run(spec, batch, mode=name, **kw)).name == name


@pytest.mark.parametrize("kw, fused", [({}, True), ({"tables": "per-field"}, False), ({"allocate": "laia"}, False),
                                       ({"allocate": "random"}, True)])
def test_the_cache_fuses_its_tables_unless_told_or_a_plan_names_each_fields_keys(kw, fused):
    from des.baselines.cache.tables import CachedFieldEmbedding, CachedFusedTable
    spec = small_spec()
    mode = modes.make("cache", make_run(spec, random_batches(spec, 1, 8)[0], mode="cache", cache_size="5", **kw))
    tables = [type(layer) for layer, _ in mode.prepare(mode.run.reference_model()).cached_tables()]
    want = [CachedFusedTable] * 2 if fused else [CachedFieldEmbedding] * (2 * len(spec))   # rows and linear part
    assert tables == want


def test_ps_hands_the_reader_a_new_allocator_per_epoch():
    from des.baselines.allocate import Share
    spec = small_spec()
    batch = random_batches(spec, 1, 16)[0]
    mode = modes.make("ps", make_run(spec, batch, mode="ps", allocate="laia"))
    mode.prepare(mode.run.reference_model())
    first, second = mode.train_shard(0), mode.train_shard(1)
    assert isinstance(first, Share) and isinstance(second, Share) and first.allocator is not second.allocator
    assert len(mode.allocators) == 2 and mode.eval_shard() == (0, 1)
    assert first.allocator.top_k is None
    top = modes.make("ps", make_run(spec, batch, mode="ps", allocate="laia", allocate_top_k=2))
    top.prepare(top.run.reference_model())
    assert top.train_shard(0).allocator.top_k == 2
    contiguous = modes.make("ps", make_run(spec, batch, mode="ps"))
    assert contiguous.train_shard(0) == (0, 1) and contiguous.allocators == []


@pytest.mark.parametrize("name, kw, owed", [
    ("single", {}, set()),
    ("des", {"replica_check": 1}, {"bytes_per_step_measured", "bytes_per_step_analytic", "sent_bytes_per_step",
                                   "costs", "collectives"}),
    ("ps", {"allocate": "laia"}, {"sent_bytes_per_step", "analytic_sent_bytes_per_step", "bytes_exact_steps",
                                  "allocation", "collectives"}),
    ("cache", {"staleness": "0", "cache_size": "5", "optimizer": "sgd"},
     {"sent_bytes_per_step", "hit_rate", "rows_fetched_per_step", "bytes_exact_steps"}),
])
def test_a_mode_runs_des_train_s_hooks_in_order(name, kw, owed):
    """The hooks on 3 steps of 16 samples: the prepared model trains, evaluation gives AUC and
    log loss, and the summary holds what the mode owes (bytes exact at world size 1: zero)."""
    spec = small_spec()
    batches = random_batches(spec, 3, 16, seed=4)
    mode = modes.make(name, make_run(spec, batches[0], mode=name, batch=16, **kw))
    model = mode.prepare(mode.run.reference_model())
    model.compile(models.make_optimizer(mode.config.optimizer, 0.05), "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(name="auc"), tf.keras.metrics.BinaryCrossentropy(name="logloss")])
    callbacks = mode.callbacks(model)
    shard = mode.train_shard(0)
    whole = tf.data.Dataset.from_tensor_slices(({k: np.stack([b[0][k] for b in batches]) for k in batches[0][0]},
                                                np.stack([b[1] for b in batches])))
    from des.data.readers import share
    data = whole if shard is None else whole.map(share(shard))
    before = [w.copy() for w in model.get_weights()]
    model.fit(data, epochs=1, verbose=0, callbacks=callbacks)
    assert any(not np.array_equal(a, b) for a, b in zip(before, model.get_weights())), "nothing trained"
    result = mode.evaluate(model, whole if mode.eval_shard() is None else whole.map(share(mode.eval_shard())))
    assert 0 <= result["auc"] <= 1 and result["logloss"] > 0
    summary = {"samples_per_second": 1000.0}
    mode.summarise(model, summary)
    assert owed <= set(summary), owed - set(summary)
    if name in ("ps", "cache"):
        assert summary["bytes_exact_steps"] == "3/3" and summary["sent_bytes_per_step"] == 0
    if name == "ps":
        alloc = summary["allocation"]
        assert alloc["batches"] == 3
        x = mode.allocators[0]      # its thread's CPU time, at most its wall time (+ the clocks' reads)
        assert 0 < x.cpu_seconds <= x.seconds + 1e-4 * x.batches and alloc["samples_per_cpu_second"] > 0
    if name == "des":
        assert summary["bytes_per_step_measured"] == summary["bytes_per_step_analytic"] > 0


def test_auto_resolves_to_a_mode_with_its_choice():
    spec = small_spec()
    run = make_run(spec, random_batches(spec, 1, 32)[0], mode="auto")
    mode = modes.make("auto", run)
    assert mode.name == "des" and mode.auto.mode == "des" and run.config.mode == "des"   # one process: DES
    assert mode.auto.world_size == 1 and mode.auto.des_bytes == 0


def test_cpu_time_counts_the_process_cpu_of_a_step_not_its_wall_time():
    """des.runtime.callbacks.CPUTime (des.train's 'cpu_seconds_per_step'): a step that spins 60 ms of
    CPU and sleeps 250 ms counts about 60 ms, not the ~310 ms of wall time; the first step
    (tracing) is left out of the median."""
    import time
    from des.runtime.callbacks import CPUTime

    class SpinThenSleep(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            end = time.process_time() + 0.06
            while time.process_time() < end:
                pass
            time.sleep(0.25)

    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    model = tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(4,))])
    model.compile("sgd", "mse")
    cpu = CPUTime()
    t0 = time.perf_counter()
    model.fit(x, x[:, :1], batch_size=16, epochs=1, verbose=0, callbacks=[cpu, SpinThenSleep()])
    wall = (time.perf_counter() - t0) / 4
    assert len(cpu.times) == 4 and wall > 0.3
    assert 0.055 <= cpu.median() <= 0.2, cpu.times


def test_a_mode_registered_in_one_place_reaches_the_cli_and_compare(monkeypatch):
    """A new mode is one class (a file in des/modes/) registered in des.jobs.modes.MODES: des.train's
    --mode, des.compare's --modes and modes.make take it with nothing else changed."""
    from des.jobs.compare import Cell

    class Echo(modes.Mode):
        name = "echo"
    monkeypatch.setitem(modes.MODES, "echo", Echo)
    assert RunConfig.parse(["--data", "x", "--mode", "echo"]).mode == "echo"
    mode = modes.make("echo", make_run(small_spec(), random_batches(small_spec(), 1, 8)[0], mode="echo"))
    assert type(mode) is Echo and (mode.rank, mode.world_size) == (0, 1)
    assert Cell.parse("echo") == Cell("echo") and Cell.parse("echo").key == "echo"
    monkeypatch.delitem(modes.MODES, "echo")
    with pytest.raises(SystemExit):
        RunConfig.parse(["--data", "x", "--mode", "echo"])


def test_the_run_configuration_round_trips_through_its_command_line():
    """to_argv (what des.compare hands to des.train) parses back to the same record, for every
    option set off its default; parts hold their options."""
    from des.jobs.config import OPTIONS
    argv = ["--data", "a.txt", "b.txt", "--mode", "cache", "--staleness", "inf", "--cache-size", "5000",
            "--eviction", "lfu", "--on-demand", "--plan-pushes", "--allocate", "laia", "--allocate-top-k", "3",
            "--ps-batch", "per-process", "--comm", "sync", "--link", "100mbit", "--eval-data", "e.txt",
            "--batch", "64", "--hidden", "8,4", "--tail", "replicated", "--skip-bad-lines", "--lr", "0.5"]
    config = RunConfig.parse(argv)
    assert (config.cache.staleness, config.cache.size, config.cache.eviction, config.cache.on_demand,
            config.cache.plan_pushes) == ("inf", "5000", "lfu", True, True)
    assert (config.allocation.strategy, config.allocation.top_k, config.allocation.ps_batch) == ("laia", 3, "per-process")
    assert (config.network.comm, config.network.link_bytes_per_second) == ("sync", 12_500_000.0)
    assert config.hidden_units == (8, 4) and config.eval_data == ["e.txt"] and config.lr == 0.5
    assert RunConfig.parse(config.to_argv()) == config
    assert sorted(config.to_argv()) == sorted(argv)            # exactly the options given, nothing else
    assert len({o.flag for o in OPTIONS}) == len(OPTIONS)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.batch = 1                                         # a record is replaced, never changed


def test_compare_builds_each_run_from_one_cell_and_passes_other_train_options(tmp_path):
    from des.jobs.compare import Cell, cells, parser, train_config
    assert [c.key for c in cells("single,ps+laia,cache+laia+on-demand", "0,inf")] == [
        "single", "ps+laia", "cache+laia+on-demand s=0", "cache+laia+on-demand s=inf"]
    with pytest.raises(ValueError, match="unknown mode 'des\\+laia'"):
        Cell.parse("des+laia")
    a = parser().parse_args(["--batch", "256", "--steps", "5"])
    a.holdout = 100
    config = train_config(Cell.parse("cache+laia+on-demand s=0"), "lr", "d.txt", a, str(tmp_path / "s.json"))
    assert (config.mode, config.model, config.batch, config.steps, config.holdout) == ("cache", "lr", 256, 5, 100)
    assert (config.cache.staleness, config.cache.on_demand, config.allocation.strategy) == ("0", True, "laia")
    assert RunConfig.parse(config.to_argv()) == config


def test_compare_refuses_an_option_neither_it_nor_des_train_has(capsys):
    from des.jobs import compare
    with pytest.raises(SystemExit) as e:
        compare.main(["--models", "lr", "--tables", "per-field", "--no-such-option", "1"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("error: not an option of des.compare or des.train: --tables per-field --no-such-option 1")
    assert not any("des.train" in line and "usage" in line for line in err)


@pytest.mark.parametrize("distinct", [True, False])
def test_a_des_process_reads_the_ids_its_received_rows_are_placed_by(distinct):
    """des.train's DES process reads only some inputs (own_inputs: on columnar data the others are
    padding). When rows travel once per distinct id (the first Dense by rows), a receiver places
    the rows of its samples by every keyed field's ids, whoever owns the field: it reads those
    too; once per sample it reads its own fields and the first one only."""
    from des.jobs.modes.des import own_inputs
    from des.jobs.verify import run_in_process_world
    spec = small_spec(4, dim=3)
    L = tf.keras.layers

    def build():
        x = {f.name: tf.keras.Input(shape=(), dtype=tf.int64, name=f.name) for f in spec}
        e = [L.Embedding(f.cardinality, 3, name=f"emb_{f.name}")(x[f.name]) for f in spec]
        h = L.Dense(8, activation="relu", name="dnn_0")(L.Concatenate()(e))
        return tf.keras.Model(x, L.Dense(1, activation="sigmoid", name="out")(h))

    got = run_in_process_world(2, build, lambda m: (own_inputs(m, spec, des_rank(m)), des_owned(m)),
                               tail="data_parallel", first_dense="rows", distinct_rows=distinct)
    for inputs, owned in got:
        assert owned and len(owned) < 4
        assert sorted(inputs) == (["f0", "f1", "f2", "f3"] if distinct else sorted(set(owned) | {"f0"}))


def des_rank(model) -> int:
    import des
    return des.distributed(model).layer.comm.rank


def des_owned(model) -> list[str]:
    import des
    handle = des.distributed(model)
    return [f for f, r in handle.plan.owner.items() if r == handle.layer.comm.rank]

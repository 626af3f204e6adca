"""Shared test data (defined in des.jobs.verify so the mpirun scripts use the same) and the one way the
tests launch processes under mpirun."""
import json
import os
import subprocess
import sys

import numpy as np

from des.jobs.verify import random_batches, small_spec  # noqa: F401

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MPI_ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)


def mpirun(n: int, *args, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python ARGS`` on ``n`` processes under mpirun, from the repository's root (``env``: variables
    added to MPI_ENV, which lets root run it and more processes than cores); the finished run."""
    cmd = ["mpirun", "-np", str(n), "--oversubscribe", "--bind-to", "none", sys.executable, *args]
    return subprocess.run(cmd, env=dict(MPI_ENV, **(env or {})), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def write_small_ffm(path: str, rows: int, seed: int = 0, fields: int = 6) -> dict:
    """A generated libffm file with few fields, for the des.train / des.predict subprocess tests
    whose assertions do not depend on Criteo's 39 fields: a process traces 2 x ``fields`` TFRA
    tables instead of 78 (measured: a 3000-line des.train run takes 15 s instead of 59 s).

    Rows come from des.data.synth's planted LR + FM model (the generator of the Criteo presets,
    here over one integer and ``fields - 1`` categorical fields, Zipf-skewed, with missing
    values), one ``field:value:1`` token per present value. Returns the metadata written to
    <path>.meta.json (format, spec, Bayes-optimal AUC): des.train takes the spec from it."""
    from des.data.libsvm import sparse_spec
    from des.data.bayes import BayesStats
    from des.data.synth import CriteoGenerator, Preset

    assert fields >= 2
    cards = ([20, 100, 500, 2000, 10000] * fields)[:fields - 1]
    gen = CriteoGenerator(Preset(int_card=[10], cat_card=cards, k=2, w_scale=0.4, v_scale=0.25), seed)
    rng = np.random.default_rng([seed, 2])
    label, ints, cats, prob = gen.chunk(rows, rng)
    stats = BayesStats()
    stats.add(prob)
    with open(path, "w") as fh:
        for y, row in zip(label, np.concatenate([ints, cats], 1)):
            fh.write(" ".join([str(y)] + [f"{j}:{v}:1" for j, v in enumerate(row) if v]) + "\n")
    meta = {"format": "libffm", "rows": rows, "seed": seed, "bayes_auc": round(stats.auc(), 6),
            "spec": json.loads(sparse_spec("F", [1] * fields, 8).to_json())}
    with open(path + ".meta.json", "w") as fh:
        json.dump(meta, fh, indent=1)
    return meta


def copy_meta(src: str, dst: str) -> None:
    """Give ``dst`` (lines taken from ``src``) the metadata of ``src``: its format and spec."""
    with open(src + ".meta.json") as fh, open(dst + ".meta.json", "w") as out:
        out.write(fh.read())


def single_process_predictions(name: str, optimizer: str, learning_rates: dict, batches, probe,
                               with_snapshot: bool = False):
    """The untouched reference model (PS_SPEC, seed 3, hidden 8,4) trained on whole global batches:
    its predictions on ``probe`` after every step (what the PS and cache mpirun runs must match);
    ``with_snapshot``: also its final rows and weights (des.jobs.verify.snapshot)."""
    import models
    from des.compiler.keys import create_slots
    from des.jobs.verify import PS_SPEC, optimizer_factory, snapshot
    ref = models.build(name, PS_SPEC, seed=3, hidden=(8, 4))
    ref.compile(optimizer_factory(optimizer, learning_rates)(), "binary_crossentropy")
    create_slots(ref, ref.optimizer)
    out = []
    for x, y in batches:
        ref.train_on_batch(x, y)
        out.append(ref.predict_on_batch(probe))
    return (out, snapshot(ref)) if with_snapshot else out


def train_ps_counting(exchange, batches, probe, fuse: bool = False, bytes_per_float: int = 4,
                      learning_rate: float = 0.01, join_linear: bool = False):
    """One rank of a PS DeepFM (PS_SPEC, seed 3, hidden 8,4, Adam) trained on its slice of each
    global batch: its predictions on ``probe`` after every step, the model, and per step and
    counter (ids/rows/grad bytes, unique/remote ids) the pair (measured at the all-to-alls,
    des.baselines.ps.rewrite.analytic_bytes of the slice's ids at ``bytes_per_float``; ``join_linear``:
    of the untouched model's lookups as joined rows, table_inputs(..., join_linear=True))."""
    import models
    from des.baselines.ps.rewrite import analytic_bytes, dense_parameters, shard, table_inputs
    from des.data.readers import _slice_batch
    from des.jobs.verify import PS_SPEC, optimizer_factory
    model = shard(models.build("deepfm", PS_SPEC, seed=3, hidden=(8, 4)), exchange, fuse=fuse,
                  join_linear=join_linear)
    model.compile(optimizer_factory("adam", {"adam": learning_rate})(), "binary_crossentropy")
    tables, dense = table_inputs(model), dense_parameters(model)
    if join_linear:
        tables = table_inputs(models.build("deepfm", PS_SPEC, seed=3, hidden=(8, 4)), join_linear=True)
    rank, n = exchange.rank, exchange.world_size
    preds, steps = [], []
    for x, y in batches:
        xs, ys = _slice_batch(x, y, rank, n)
        before = exchange.snapshot()
        model.train_on_batch(xs, ys)
        after = exchange.snapshot()
        an = analytic_bytes({k: v.numpy() for k, v in xs.items()}, tables, rank, n, dense, bytes_per_float)
        steps.append({k: (after[k] - before[k], an[k])
                      for k in ("ids_bytes", "rows_bytes", "grad_bytes", "unique_ids", "remote_ids")})
        preds.append(model.predict_on_batch(probe))
    return preds, model, steps


def within(name: str, value: float, bound: float, floor: float | None = None, case: str = "") -> float:
    """Assert ``value < bound`` (and ``value > floor`` when given), first printing one line that
    scripts/tolerances.py collects (run pytest with -s to see it):
    ``MEASURED <test id> <file:line> <name>[ @ <case>] <value> <bound>``. The test id is pytest's
    current one, file:line where this is called (one bound, whichever test reaches it), ``name``
    what it checks, ``case`` which of the cases a loop checks with it."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0]
    caller = sys._getframe(1)
    site = f"{os.path.basename(caller.f_code.co_filename)}:{caller.f_lineno}"
    value = float(value)
    print(f"\nMEASURED {test} {site} {name}{' @ ' + case if case else ''} {value:.3e} {bound:.1e}", flush=True)
    assert value < bound, (name, value, bound)
    if floor is not None:
        assert value > floor, (name, value, floor)
    return value


def trained(model, batches, probe) -> np.ndarray:
    """``model.train_on_batch`` over ``batches`` in order, then its predictions on ``probe``."""
    for x, y in batches:
        model.train_on_batch(x, y)
    return np.asarray(model.predict_on_batch(probe))


def untouched_adam(build, base):
    """``build()`` with ``base``'s state, its TFRA rows keyed as DES keys them (des.make_keyed), compiled
    with Adam as adam_world's models are: the one-process model a DES run is held to."""
    import des
    from des.jobs.verify import copy_state
    from gallery import optimizer_for
    model = build()
    copy_state(base, model)
    des.make_keyed(model, seed=0)
    model.compile(optimizer_for(model, "adam"), "binary_crossentropy")
    return model


def adam_world(n: int, build, base, options=None, spec=None) -> tuple:
    """(an InProcessWorld of ``n``, its models): ``build()`` transformed on every simulated rank (with
    des.Options ``options`` and ``spec``), rank 0 from ``base``'s state (the transform's broadcast
    gives it to the others), each compiled with Adam as tests/gallery.py's optimizer_for makes it."""
    import des
    from des.jobs.verify import copy_state
    from des_ops.comm import InProcessWorld
    from gallery import optimizer_for
    world, models = InProcessWorld(n), []
    for r in range(n):
        model = build()
        if r == 0:
            copy_state(base, model)
        models.append(des.transform(model, options, comm=world.communicator(r), spec=spec)[0])
        models[-1].compile(optimizer_for(models[-1], "adam"), "binary_crossentropy")
    return world, models


def served(path: str, probe: dict) -> np.ndarray:
    """The predictions, flat, of the SavedModel des.export wrote at ``path`` on the batch ``probe``."""
    import tensorflow as tf
    serve = tf.saved_model.load(path).signatures["serving_default"]
    return np.reshape(next(iter(serve(**{k: tf.constant(v) for k, v in probe.items()}).values())), [-1])


def fit_counting_rows(model, batches, probe, n: int) -> tuple:
    """(fit_and_snapshot's snapshot with Adam 0.02, the bytes its rows exchange handed to the
    collectives under "step" and "tail", every process's blocks by samples) of one DES model."""
    import des
    from des.jobs.verify import fit_and_snapshot
    layer = des.distributed(model).layer
    before = layer.comm.counted()
    snap = fit_and_snapshot(model, batches, probe, optimizer="adam", learning_rate=0.02)
    after = layer.comm.counted()
    sent = [op for op, s in zip(layer.ops, layer.to_samples) if s]
    blocks = [[b for op in sent for b in op.samples_blocks(n)[p]] for p in range(n)]
    return snap, {k: after[k]["bytes"] - before[k]["bytes"] for k in ("step", "tail")}, blocks


def check_rows_saved_by_distinct_ids(runs: dict, batches, probe, rank: int) -> None:
    """``runs[True]`` / ``runs[False]``: fit_counting_rows of every rank with distinct_rows on / off.
    Rank ``rank`` handed over exactly the bytes numpy counts fewer (des_ops.rows.distinct_rows, per
    slice and block of its keyed blocks), forward under "step" and back under "tail" (the probe's
    prediction: no backward), and some."""
    import dataclasses
    from des_ops.rows import distinct_rows
    keyed = runs[True][rank][2]
    unkeyed = [[dataclasses.replace(b, key=None) for b in bl] for bl in keyed]
    fed = [{k: np.asarray(v) for k, v in x.items()} for x in [x for x, _ in batches] + [probe]]
    size = lambda x: len(next(iter(x.values())))  # noqa: E731
    saved = [tuple(e - d for d, e in zip(distinct_rows(x, keyed, size(x), rank),
                                         distinct_rows(x, unkeyed, size(x), rank))) for x in fed]
    step = runs[False][rank][1]["step"] - runs[True][rank][1]["step"]
    tail = runs[False][rank][1]["tail"] - runs[True][rank][1]["tail"]
    assert step == 4 * sum(s for s, _ in saved) > 0, (rank, step, saved)
    assert tail == 4 * sum(g for _, g in saved[:-1]) > 0, (rank, tail, saved)


def save_three_ways(model, where) -> None:
    """des.checkpoint.save to ``where``/ckpt, model.save to ``where``/saved and des.export to
    ``where``/served (on every process of a DES model)."""
    import des
    from des.runtime import checkpoint
    checkpoint.save(os.path.join(where, "ckpt"), model, model.optimizer)
    model.save(os.path.join(where, "saved"))
    des.export(model, os.path.join(where, "served"))

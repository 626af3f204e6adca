"""des.Options: one frozen, checked record of how des.transform splits a model; des.train builds
it from its command line (RunConfig.options), the report prints it, and the keywords des.transform
took before it raise an error naming their new place."""
import dataclasses
import inspect
import json
import os
import subprocess
import sys

import pytest

import des
import models
from des.compiler.choices import costs_for
from des.data import FeatureSpec, Field
from des.jobs.config import RunConfig
from des_ops.comm import InProcessWorld
from helpers import write_small_ffm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = FeatureSpec((Field("user", dim=4), Field("item", dim=4)))


def test_transform_takes_the_model_the_options_and_where_it_runs():
    params = inspect.signature(des.transform).parameters
    assert len(params) <= 8
    assert list(params)[:5] == ["model", "options", "comm", "spec", "sample"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        des.Options().tail = "replicated"


@pytest.mark.parametrize("kwargs, message", [
    ({"tail": "sideways"}, "tail='sideways'; choose from auto, replicated, data_parallel"),
    ({"tables": "fused-ish"}, "tables='fused-ish'; choose from auto, per-field, fused, joined"),
    ({"plan": "random"}, "plan='random'; 'balanced', 'mod' or a FieldPlan"),
    ({"micro_batches": 0}, "micro_batches=0; a whole number >= 1"),
    ({"first_dense": "rows", "tail": "replicated"}, "needs the data-parallel tail"),
    ({"field_rows": "samples", "tail": "auto"}, "des.Options(field_rows='samples'): needs the data-parallel tail"),
    ({"field_rows": "rows"}, "field_rows='rows'; choose from auto, partials, samples"),
    ({"costs": 1e9}, "costs=1000000000.0; a des.AutoTail"),
    ({"first_layer": "rows", "tail": "replicated"}, "des.Options(first_layer='rows'): the rows go to their samples'"),
    ({"first_layer": "split"}, "first_layer='split'; choose from auto, operators, rows"),
    ({"stripe_min_rows": -1}, "stripe_min_rows=-1; a whole number >= 0 or None"),
    ({"stripe_min_rows": "1M"}, "stripe_min_rows='1M'; a whole number >= 0 or None"),
    ({"stripe_min_rows": True}, "stripe_min_rows=True; a whole number >= 0 or None"),
])
def test_bad_options_are_one_line_errors_when_made(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        des.Options(**kwargs)


def test_the_old_keywords_say_where_they_went():
    with pytest.raises(TypeError, match=r"des.transform\(model, des.Options\(tail='data_parallel', tables='joined'\)\)"):
        des.transform(models.deepfm(SPEC, hidden=(8,)), tail="data_parallel", fuse_tables=True, join_linear=True)
    with pytest.raises(TypeError, match="a des.Options"):
        des.transform(models.deepfm(SPEC, hidden=(8,)), {"tail": "auto"})


def test_the_report_prints_the_options_that_applied():
    opts = des.Options(tables="fused", micro_batches=2, costs=des.AutoTail(batch_size=512))
    _, report = des.transform(models.deepfm(SPEC, hidden=(8,)), opts, comm=InProcessWorld(1).communicator(0))
    last = str(report).splitlines()[-1]
    assert last == ("options: plan=balanced tail=auto first_dense=auto tables=fused micro_batches=2 "
                    "wire_dtype=float32 seed=0 costs=AutoTail(batch_size=512, flops=50000000000.0, "
                    "bandwidth=1250000000.0, per_collective=0.003, distinct=1.0)")
    assert report.options is opts and report.tail == "replicated" and report.micro_batches == 2


def test_des_train_builds_its_options_with_the_library_defaults():
    """The defaults of the command line are des.Options' own, so the two cannot drift apart."""
    config = RunConfig.parse(["--data", "x.txt", "--mode", "des"])
    opts = config.options()
    default = des.Options()
    assert (opts.tail, opts.first_dense, opts.plan, opts.micro_batches, opts.wire_dtype) == \
        (default.tail, default.first_dense, default.plan, default.micro_batches, default.wire_dtype)
    assert opts.tables == "joined"            # des.train's default with one optimizer
    # --link auto (the default): the bandwidth is measured at transform, as des.transform's own default
    assert opts.costs == des.AutoTail(batch_size=1024, bandwidth=None)
    assert opts.assumed == des.AutoTail(batch_size=1024, bandwidth=1.25e9)     # until it is measured
    one = InProcessWorld(1).communicator(0)       # one process: nothing to time, the default class
    assert costs_for(opts, one, None, [], None) == (des.AutoTail(batch_size=1024, bandwidth=1.25e9), "")
    fixed = RunConfig.parse(["--data", "x.txt", "--link", "1gbit"]).options()
    assert costs_for(fixed, one, None, [], None) == (des.AutoTail(batch_size=1024, bandwidth=1.25e8), "")
    with pytest.raises(SystemExit):
        RunConfig.parse(["--data", "x.txt", "--link", "fast"])
    assert RunConfig.parse(["--data", "x.txt", "--linear-optimizer", "sgd"]).options().tables == "fused"
    custom = RunConfig.parse(["--data", "x", "--tail", "data_parallel", "--first-dense", "rows", "--tables",
                              "per-field", "--link", "100mbit", "--batch", "64"]).options()
    assert (custom.tail, custom.first_dense, custom.tables) == ("data_parallel", "rows", "per-field")
    assert custom.costs == des.AutoTail(batch_size=64, bandwidth=1.25e7)


def test_mode_auto_takes_the_des_options(tmp_path):
    """--mode auto --tail auto runs whichever mode auto picks (the DES options apply when it picks
    des; test_modes: the PS and single accept tail="auto"); a data-parallel tail asked of a mode
    that has none is still refused in one line."""
    data = str(tmp_path / "d.txt")
    write_small_ffm(data, 1200, seed=5)
    env = dict(os.environ, PYTHONPATH=ROOT)
    base = [sys.executable, "-m", "des.train", "--model", "fm", "--batch", "256", "--threads", "1", "--data", data,
            "--steps", "2", "--holdout", "0"]
    r = subprocess.run(base + ["--mode", "auto", "--tail", "auto", "--summary-json", str(tmp_path / "s.json")],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.load(open(tmp_path / "s.json"))
    assert summary["auto"]["chosen"] == summary["mode"] == "des"      # one process: DES equals the model
    assert summary["tail_reason"] == "replicated: one process, nothing to share"   # the DES option applied
    bad = subprocess.run(base + ["--mode", "single", "--tail", "data_parallel"], env=env, cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1] == \
        "error: --tail data_parallel is an option of --mode des"


@pytest.mark.parametrize("value", ["1.5", "-1", "-0.1"])
def test_a_holdout_that_is_neither_a_fraction_nor_a_count_is_one_line(value, capsys):
    with pytest.raises(SystemExit) as e:
        RunConfig.parse(["--data", "x.txt", "--holdout", value])
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"error: --holdout {float(value):g}: a fraction of the lines in [0, 1) or a whole number of lines")
    assert RunConfig.parse(["--data", "x.txt", "--holdout", "400"]).holdout == 400

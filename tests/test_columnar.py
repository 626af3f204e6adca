"""Columnar data (des.data.columnar, python -m des.data.convert): the same batches as the text
readers, only the requested columns read, clear errors; under mpirun a DES process reads only its
own fields' columns and still equals one process reading the text (with --mode auto, which picks
DES on the wide preset)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from des.data import DataError, columnar
from des.data.readers import make_dataset
from des.data.resolve import spec_for

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
           OMPI_MCA_mpi_yield_when_idle="1", TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """600 rows of the wide preset (26 single + 20 weighted bag fields) and its columnar copy."""
    d = tmp_path_factory.mktemp("wide")
    text, cols = str(d / "w.ffm"), str(d / "w.cols")
    subprocess.run([sys.executable, "-m", "des.data.synth", "--preset", "wide", "--rows", "600", "--seed", "1",
                    "--out", text], check=True, env=ENV, cwd=ROOT, capture_output=True)
    done = subprocess.run([sys.executable, "-m", "des.data.convert", "--data", text, "--out", cols],
                          env=ENV, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "600 rows, 92 input columns + labels" in done.stdout
    meta = json.load(open(text + ".meta.json"))
    return text, cols, spec_for("libffm", [text], 8, meta)


def test_same_batches_as_the_text_reader(wide):
    """Shuffled (same seed), a line range, a PS slice: every batch equal, every input."""
    text, cols, spec = wide
    for kw in (dict(shuffle_buffer=200, seed=5, take_lines=500, skip_lines=30), dict(shard=(1, 3), seed=2),
               dict(shuffle_buffer=1000, seed=9, epochs=2)):
        a = list(make_dataset([text], "libffm", spec, 64, **kw))
        b = list(columnar.make_dataset(cols, spec, 64, **kw))
        assert len(a) == len(b) > 1
        for (fa, ya), (fb, yb) in zip(a, b):
            assert np.array_equal(ya.numpy(), yb.numpy())
            assert sorted(fa) == sorted(fb) == sorted(spec.input_names())
            for k in fa:
                assert fa[k].dtype == fb[k].dtype and np.array_equal(fa[k].numpy(), fb[k].numpy()), k


def test_the_wide_presets_cardinalities_reach_the_spec(wide):
    """The generator knows every field's cardinality: the spec of the text file and of its
    columnar copy carry them (the cache's --cache-size 10% and the DES plan's balance need them)."""
    text, cols, spec = wide
    known = json.load(open(text + ".meta.json"))["cardinalities"]
    assert {f.name: f.cardinality for f in spec} == known
    assert {f.name: f.cardinality for f in columnar.spec_of(cols)} == known


def test_only_requested_columns_are_read(wide, monkeypatch):
    """Asked for F3 (and its weights): those equal the text's; every other input is padding; the
    column files of the others are never opened."""
    text, cols, spec = wide
    opened = []
    real = np.memmap

    def spy(path, *a, **k):
        opened.append(os.path.basename(str(path)))
        return real(path, *a, **k)
    monkeypatch.setattr(columnar.np, "memmap", spy)
    fb, yb = next(iter(columnar.make_dataset(cols, spec, 50, inputs=["F3", "F3_weight"])))
    assert sorted(opened) == ["F3.bin", "F3_weight.bin", "label.bin"]
    fa, ya = next(iter(make_dataset([text], "libffm", spec, 50)))
    assert np.array_equal(fa["F3"].numpy(), fb["F3"].numpy()) and np.array_equal(ya.numpy(), yb.numpy())
    assert np.all(fb["F30"].numpy() == -1) and np.all(fb["F30_weight"].numpy() == 0)
    assert fb["F30"].shape == fa["F30"].shape


def test_errors_name_the_file(wide, tmp_path):
    text, cols, spec = wide
    with pytest.raises(DataError, match="already exists"):
        columnar.convert([text], "libffm", spec, cols)
    bad = tmp_path / "bad.ffm"
    lines = open(text).read().splitlines()
    bad.write_text("\n".join(lines[:3] + ["1 0:5:1 zz"] + lines[3:5]) + "\n")
    with pytest.raises(DataError, match=r"bad\.ffm:4:"):
        columnar.convert([str(bad)], "libffm", spec, str(tmp_path / "bad.cols"))
    assert not os.path.exists(tmp_path / "bad.cols")
    broken = tmp_path / "broken.cols"
    subprocess.run(["cp", "-r", cols, str(broken)], check=True)
    with open(broken / "F7.bin", "r+b") as fh:
        fh.truncate(100)
    with pytest.raises(DataError, match=r"F7\.bin: expected .* bytes"):
        columnar.make_dataset(str(broken), spec, 10)
    with pytest.raises(DataError, match="not a columnar data folder"):
        columnar.make_dataset(str(tmp_path), spec, 10)
    with pytest.raises(DataError, match=r"inputs \['nope'\] are not in the spec"):
        columnar.make_dataset(cols, spec, 10, inputs=["nope"])


@pytest.mark.mpi
def test_des_on_columnar_reads_own_columns_and_equals_one_process_on_text(wide, tmp_path):
    """mpirun -np 2 des.train --mode auto on the columnar copy: auto picks DES (the wide preset), each
    process reads fewer than all 92 inputs, the replica check (every step) passes, and AUC and log
    loss equal one process trained on the text file, to the bit."""
    text, cols, _ = wide
    args = ["-m", "des.train", "--model", "deepfm", "--batch", "128", "--hidden", "16", "--dim", "4",
            "--threads", "1", "--holdout", "100", "--shuffle-buffer", "300", "--optimizer", "adagrad",
            "--lr", "0.05"]
    one = subprocess.run([sys.executable, *args, "--data", text, "--summary-json", str(tmp_path / "one.json")],
                         env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert one.returncode == 0, one.stderr[-3000:]
    des = subprocess.run(["mpirun", "-np", "2", "--oversubscribe", "--bind-to", "none", sys.executable, *args,
                          "--mode", "auto", "--replica-check", "1", "--data", cols,
                          "--summary-json", str(tmp_path / "des.json")],
                         env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert des.returncode == 0, des.stdout[-2000:] + des.stderr[-3000:]
    assert "plan auto: DES" in des.stdout and "each process reads the labels and its own fields' columns" in des.stdout
    ref = json.load(open(tmp_path / "one.json"))
    ranks = [json.load(open(tmp_path / f"des.json.rank{r}")) for r in range(2)]
    for s in ranks:
        assert s["mode"] == "des" and s["auto"]["chosen"] == "des"
        assert s["auto"]["des_bytes_estimate"] < s["auto"]["ps_bytes_estimate"]
        assert s["auc"] == ref["auc"] and s["logloss"] == ref["logloss"]
        assert s["collectives"]["check"]["calls"] >= 4      # the replica check ran every step
    assert ref["inputs_read"] == 92 and all(s["inputs_read"] < 92 for s in ranks)
    assert sum(s["inputs_read"] for s in ranks) <= 92 + 2 * 2      # own fields, + F0 (ids, weights) each

"""Readers on well-formed and malformed input, id stability, generator determinism."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from des.data import DataError, SkipReport, avazu_spec, criteo_spec, feature_id
from des.data.readers import make_dataset
from des.data.synth import write_criteo
from models.spec import AVAZU_COLUMNS

GOOD = "1\t5\t-1\t\t0\t1\t2\t3\t4\t5\t6\t7\t8\t9\t" + "\t".join(f"{i:08x}" for i in range(26))


def criteo_line(label="1", ints=None, cats=None):
    ints = ints if ints is not None else ["5", "-1", "", "0", "1", "2", "300", "4", "5", "6", "7", "8", "9"]
    cats = cats if cats is not None else [f"{i:08x}" for i in range(25)] + [""]
    return "\t".join([label] + ints + cats)


def write(tmp_path, name, lines, raw=None):
    p = tmp_path / name
    if raw is not None:
        p.write_bytes(raw)
    else:
        p.write_text("\n".join(lines) + "\n")
    return str(p)


def read_all(path, fmt="criteo", spec=None, **kw):
    spec = spec or (avazu_spec() if fmt == "avazu" else criteo_spec())
    return list(make_dataset(path, fmt, spec, 4, **kw))


def test_criteo_parses_values_and_log_buckets(tmp_path):
    p = write(tmp_path, "t.txt", [criteo_line(), criteo_line(label="0")])
    (x, y), = read_all(p)
    assert y.numpy().tolist() == [1.0, 0.0]
    assert set(x) == {f"I{i}" for i in range(1, 14)} | {f"C{i}" for i in range(1, 27)}
    # 300 > 2 -> floor(ln(300)^2) = 32; -1 stays -1; missing is a value of its own
    assert x["I7"][0] == feature_id("I7", "32")
    assert x["I2"][0] == feature_id("I2", "-1")
    assert x["I3"][0] == feature_id("I3", "")
    assert x["C1"][0] == feature_id("C1", "00000000")
    assert x["C26"][0] == feature_id("C26", "")
    assert x["C1"][0] != feature_id("C2", "00000000")  # the field is part of the id


def test_criteo_numeric_inputs(tmp_path):
    p = write(tmp_path, "t.txt", [criteo_line()])
    (x, _), = list(make_dataset(p, "criteo", criteo_spec(numeric=True), 4))
    assert x["I7_num"].numpy()[0] == pytest.approx(np.log1p(300))
    assert x["I2_num"].numpy()[0] == 0.0 and x["I3_num"].numpy()[0] == 0.0


def test_criteo_test_layout_without_label(tmp_path):
    p = write(tmp_path, "test.txt", ["\t".join(criteo_line().split("\t")[1:])])
    (x, y), = read_all(p, "criteo-test")
    assert x["I7"][0] == feature_id("I7", "32")
    with pytest.raises(tf.errors.OpError, match="bad.txt:1: expected 39 tab-separated columns, found 40"):
        read_all(write(tmp_path, "bad.txt", [criteo_line()]), "criteo-test")


@pytest.mark.parametrize("bad_line, problem", [
    (criteo_line(cats=["0"] * 25), "expected 40 tab-separated columns, found 39"),
    (criteo_line() + "\textra", "expected 40 tab-separated columns, found 41"),
    (criteo_line(ints=["5", "x7"] + ["1"] * 11), "column I2: 'x7' is not an integer"),
    (criteo_line(ints=["1.5"] + ["1"] * 12), "column I1: '1.5' is not an integer"),
    (criteo_line(label="2"), "label '2' is not 0 or 1"),
    (criteo_line(label=""), "label '' is not 0 or 1"),
])
def test_criteo_bad_lines_name_file_line_and_problem(tmp_path, bad_line, problem):
    p = write(tmp_path, "t.txt", [criteo_line()] * 6 + [bad_line] + [criteo_line()])
    with pytest.raises(tf.errors.OpError) as e:
        read_all(p)
    assert f"{p}:7: {problem}" in str(e.value)


def test_undecodable_bytes(tmp_path):
    raw = (criteo_line() + "\n").encode() * 2 + criteo_line().encode().replace(b"00000003", b"0000\xff\xfe3") + b"\n"
    p = write(tmp_path, "t.txt", None, raw)
    with pytest.raises(tf.errors.OpError, match=r"t.txt:3: undecodable bytes \(not UTF-8\)"):
        read_all(p)


def test_skip_bad_lines_counts_them(tmp_path):
    lines = [criteo_line(), criteo_line(label="7"), criteo_line(), "garbage", criteo_line(ints=["a"] * 13)]
    p = write(tmp_path, "t.txt", lines * 3)
    report = SkipReport()
    batches = read_all(p, skip_bad_lines=True, skip_report=report)
    assert sum(int(y.shape[0]) for _, y in batches) == 6
    assert report.total == 9
    assert report.by_problem["label '7' is not 0 or 1"] == 3
    assert "skipped 9 bad lines" in str(report) and f"{p}:2:" in str(report)


def test_empty_and_missing_files(tmp_path):
    with pytest.raises(DataError, match="file is empty"):
        read_all(write(tmp_path, "e.txt", None, b""))
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_all(str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match="no input files"):
        read_all([])


def test_crlf_and_gzip(tmp_path):
    import gzip
    p = tmp_path / "t.txt.gz"
    with gzip.open(p, "wb") as fh:
        fh.write((criteo_line() + "\r\n").encode() * 3)
    (x, y), = read_all(str(p))
    assert y.shape[0] == 3 and x["C26"][0] == feature_id("C26", "")


def avazu_line(click="1", hour="14102100", **over):
    row = dict(zip(AVAZU_COLUMNS, ["1000009418151094273", click, hour] + [f"v{i}" for i in range(21)]))
    row.update(over)
    return ",".join(row[c] for c in AVAZU_COLUMNS)


def test_avazu_header_label_hour_and_weekday(tmp_path):
    header = ",".join(AVAZU_COLUMNS)
    p = write(tmp_path, "a.csv", [header, avazu_line(), avazu_line("0", "14102523")])
    (x, y), = read_all(p, "avazu")
    assert y.numpy().tolist() == [1.0, 0.0]
    assert x["hour_of_day"][1] == feature_id("hour_of_day", "23")
    # 2014-10-21 was a Tuesday (1), 2014-10-25 a Saturday (5)
    assert x["weekday"][0] == feature_id("weekday", "1")
    assert x["weekday"][1] == feature_id("weekday", "5")
    assert x["site_id"][0] == feature_id("site_id", "v2")


def test_avazu_test_layout_without_click(tmp_path):
    """Avazu's test.csv has no click column: same ids as the labelled line, label 0."""
    header = ",".join(AVAZU_COLUMNS)
    labelled = read_all(write(tmp_path, "a.csv", [header, avazu_line()]), "avazu")[0][0]
    drop = lambda line: ",".join(c for i, c in enumerate(line.split(",")) if i != 1)  # noqa: E731
    p = write(tmp_path, "test.csv", [drop(header), drop(avazu_line())])
    (x, y), = read_all(p, "avazu-test", spec=avazu_spec())
    assert y.numpy().tolist() == [0.0]
    assert all(x[k].numpy()[0] == labelled[k].numpy()[0] for k in labelled)
    bad = write(tmp_path, "bad.csv", [drop(header), drop(avazu_line(hour="14102125"))])
    with pytest.raises(tf.errors.OpError, match="bad.csv:2: hour '14102125' is not YYMMDDHH"):
        read_all(bad, "avazu-test", spec=avazu_spec())


@pytest.mark.parametrize("line, problem", [
    (avazu_line(click="yes"), "label (click) 'yes' is not 0 or 1"),
    (avazu_line(hour="14102125"), "hour '14102125' is not YYMMDDHH"),
    (avazu_line() + ",x", "expected 24 comma-separated columns, found 25"),
])
def test_avazu_bad_lines(tmp_path, line, problem):
    p = write(tmp_path, "a.csv", [",".join(AVAZU_COLUMNS), avazu_line(), line])
    with pytest.raises(tf.errors.OpError) as e:
        read_all(p, "avazu")
    assert f"{p}:3: {problem}" in str(e.value)


def test_avazu_wrong_or_missing_header(tmp_path):
    with pytest.raises(DataError, match=r"a.csv:1: header is"):
        read_all(write(tmp_path, "a.csv", [avazu_line()]), "avazu")
    with pytest.raises(DataError, match="header but no data"):
        read_all(write(tmp_path, "b.csv", [",".join(AVAZU_COLUMNS)]), "avazu")


def test_ids_stable_across_processes():
    code = ("import des; from des.data import feature_id; "
            "print(int(feature_id('C1', '68fd1e64')), int(feature_id('I5', '-1')))")
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, TF_CPP_MIN_LOG_LEVEL="3")
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout.strip())
    assert len(outs) == 1
    here = f"{int(feature_id('C1', '68fd1e64'))} {int(feature_id('I5', '-1'))}"
    assert outs == {here}
    assert int(feature_id("C1", "68fd1e64")) >= 0


def test_same_batches_for_every_process_and_disjoint_shards(tmp_path):
    p = str(tmp_path / "d.txt")
    write_criteo(p, 1000, "tiny", seed=3, quiet=True)
    spec = criteo_spec()
    a = [x["C1"].numpy() for x, _ in make_dataset(p, "criteo", spec, 64, shuffle_buffer=500, seed=9, epochs=2)]
    b = [x["C1"].numpy() for x, _ in make_dataset(p, "criteo", spec, 64, shuffle_buffer=500, seed=9, epochs=2)]
    plain = [x["C1"].numpy() for x, _ in make_dataset(p, "criteo", spec, 64)]
    assert len(a) == len(b) == 32 and all(np.array_equal(u, v) for u, v in zip(a, b))
    assert not np.array_equal(np.concatenate(a[:16]), np.concatenate(plain))  # it did shuffle
    shards = [[x["C2"].numpy() for x, _ in make_dataset(p, "criteo", spec, 64, shard=(r, 3))] for r in range(3)]
    full = [x["C2"].numpy() for x, _ in make_dataset(p, "criteo", spec, 64)]
    for step, batch in enumerate(full):
        assert np.array_equal(np.concatenate([s[step] for s in shards]), batch)


def test_a_shard_parses_only_its_own_lines_and_the_owner_names_a_bad_one(tmp_path):
    """shard=(r, N) slices the global batch's lines before parsing them: with a bad line 8 in
    rank 1's slice of the first batch (8 lines, 2 processes: lines 5-8), rank 1 stops with file
    and line and rank 0 reads on; at N = 3 rank 0's slice of the last batch (2 lines) is empty,
    with every field's shape."""
    p = tmp_path / "d.txt"
    write_criteo(str(p), 10, "tiny", seed=3, quiet=True)
    lines = p.read_text().splitlines()
    lines[7] = "1\t2"
    p.write_text("\n".join(lines) + "\n")
    spec = criteo_spec()
    read = lambda shard: [(x, y.numpy()) for x, y in make_dataset(str(p), "criteo", spec, 8, shard=shard)]  # noqa: E731
    with pytest.raises(tf.errors.OpError, match=r"d\.txt:8: expected 40 tab-separated columns, found 2"):
        read((1, 2))
    rank0 = read((0, 2))
    assert [len(y) for _, y in rank0] == [4, 1]
    good = [x["C1"].numpy() for x, _ in make_dataset(str(p), "criteo", spec, 8, take_lines=4)]
    assert np.array_equal(rank0[0][0]["C1"].numpy(), good[0])            # lines 1-4, parsed as one process does
    empty = read((0, 3))[-1][0]
    assert all(v.shape[0] == 0 for v in empty.values()) and set(empty) == set(rank0[0][0])


def test_generator_is_deterministic_and_reports_bayes_auc(tmp_path):
    p1, p2 = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    m1 = write_criteo(p1, 20_000, seed=5, quiet=True)
    m2 = write_criteo(p2, 20_000, seed=5, quiet=True)
    assert open(p1, "rb").read() == open(p2, "rb").read()
    assert m1 == json.load(open(p1 + ".meta.json")) and m1["bayes_auc"] == m2["bayes_auc"]
    assert 0.7 < m1["bayes_auc"] < 0.9
    lines = open(p1).read().splitlines()
    assert len(lines) == 20_000 and all(len(l.split("\t")) == 40 for l in lines[:100])
    assert write_criteo(str(tmp_path / "c.txt"), 2000, seed=6, quiet=True) != m1


def test_sample_seed_draws_other_rows_of_the_same_planted_model(tmp_path):
    """A test set of the same task: same planted model (seed), other rows (sample_seed)."""
    from des.data.synth import PRESETS, CriteoGenerator
    train, test = str(tmp_path / "train.txt"), str(tmp_path / "test.txt")
    m_train = write_criteo(train, 20_000, seed=5, quiet=True)
    m_test = write_criteo(test, 20_000, seed=5, sample_seed=8, with_label=False, quiet=True)
    assert m_test["format"] == "criteo-test" and m_test["cardinalities"] == m_train["cardinalities"]
    assert abs(m_test["bayes_auc"] - m_train["bayes_auc"]) < 0.01
    rows = [l.split("\t") for l in open(test).read().splitlines()]
    assert len(rows) == 20_000 and all(len(r) == 39 for r in rows)
    assert set(l.split("\t", 1)[1] for l in open(train).read().splitlines()[:50]).isdisjoint(
        "\t".join(r) for r in rows)
    label, ints, cats, _ = CriteoGenerator(PRESETS["criteo-like"], 5).chunk(20_000, np.random.default_rng([8, 2]))
    assert rows[7][13:] == list(cats[7]) and rows[7][:13] == list(ints[7])  # the planted model of seed 5


def test_bayes_auc_matches_auc_of_true_probabilities():
    from des.data.bayes import BayesStats
    from des.data.synth import PRESETS, CriteoGenerator
    gen = CriteoGenerator(PRESETS["criteo-like"], seed=1)
    label, _, _, prob = gen.chunk(200_000, np.random.default_rng(0))
    stats = BayesStats()
    stats.add(prob)
    order = np.argsort(prob)
    ranks = np.empty(len(prob))
    ranks[order] = np.arange(1, len(prob) + 1)
    pos = label == 1
    empirical = (ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum())
    assert abs(stats.auc() - empirical) < 0.005


def test_criteo_integer_ids_by_table_equal_the_hashed_tokens():
    """Integers' ids come from a table of the buckets of every positive int64 and of small negatives;
    any other bucket is hashed as a string - the same ids as hashing every token, at both ends."""
    from des.data.formats import BUCKETS, _log_bucket, bucket_ids
    values = [-(2**62), -100_000, BUCKETS[0] - 1, BUCKETS[0], -1, 0, 1, 2, 3, 8, 300, 10**6, 2**62, 2**63 - 1]
    v = tf.constant([[x, x] for x in values], tf.int64)
    empty = tf.constant([[False, i % 3 == 0] for i in range(len(values))])
    tokens = tf.where(empty, "", tf.strings.as_string(_log_bucket(v)))
    expect = [[int(feature_id(n, t.decode())) for n, t in zip(("I1", "I9"), row)] for row in tokens.numpy()]
    assert bucket_ids(["I1", "I9"], v, empty).numpy().tolist() == expect
    assert int(_log_bucket(tf.constant([2**63 - 1], tf.int64))[0]) < BUCKETS[1]


@pytest.mark.parametrize("fmt", ["criteo", "avazu", "libffm"])
def test_a_reader_hashes_only_the_wanted_inputs_but_checks_every_column(tmp_path, fmt):
    """inputs=[...] (a DES process's own fields): the wanted inputs equal a full read, the others
    are the padding id (numeric: 0), and a bad value in a column nobody wants still stops the job
    at its file:line - every process finds the same bad lines."""
    from des.data.libsvm import scan_spec
    if fmt == "criteo":
        spec = criteo_spec(numeric=True)
        p = write(tmp_path, "t.txt", [criteo_line(), criteo_line("0", ints=["1"] * 13)])
        bad = write(tmp_path, "b.txt", [criteo_line(), criteo_line(ints=["7"] * 12 + ["x"])])
        wanted = ["I2", "I7_num", "C3", "C26"]
    elif fmt == "avazu":
        spec = avazu_spec()
        header = ",".join(AVAZU_COLUMNS)
        p = write(tmp_path, "a.csv", [header, avazu_line(), avazu_line("0", "14102523")])
        bad = write(tmp_path, "b.csv", [header, avazu_line(), avazu_line(hour="14109923")])
        wanted = ["weekday", "site_id"]
    else:
        p = write(tmp_path, "t.ffm", ["1 0:a:1 1:b:0.5 1:c:2 2:d:1", "0 2:e:1 1:f:1"])
        spec = scan_spec([p], "libffm", dim=4)
        bad = write(tmp_path, "b.ffm", ["1 0:a:1 1:b:0.5", "0 0:a:1 2:e:nan"])
        wanted = ["F1", "F1_weight"]
    (full, y_full), = list(make_dataset(p, fmt, spec, 4))
    (part, y_part), = list(make_dataset(p, fmt, spec, 4, inputs=wanted))
    assert set(part) == set(full) and y_part.numpy().tolist() == y_full.numpy().tolist()
    for name in full:
        if name in wanted:
            np.testing.assert_array_equal(part[name], full[name])
        else:
            assert not np.any((part[name].numpy() != -1) & (part[name].numpy() != 0)), name
            assert np.any(full[name].numpy() != part[name].numpy()), name
    with pytest.raises(tf.errors.OpError, match=rf"{bad}:{3 if fmt == 'avazu' else 2}: "):
        list(make_dataset(bad, fmt, spec, 4, inputs=wanted))
    with pytest.raises(ValueError, match="not in the spec"):
        make_dataset(p, fmt, spec, 4, inputs=["nope"])


def test_order_shuffles_each_window_of_each_epoch_once_and_the_same_everywhere():
    """des.data.readers.order: every line once an epoch, each inside its own window of
    shuffle_buffer lines, a new order every epoch and window, the same for the same seed."""
    from des.data.readers import order

    def run(**kw):
        return np.concatenate([b.numpy() for b in order(1000, batch_size=64, **kw)])

    got = run(shuffle_buffer=300, seed=4, skip_lines=50, take_lines=900, epochs=2)
    assert got.size == 1800 and np.array_equal(got, run(shuffle_buffer=300, seed=4, skip_lines=50,
                                                            take_lines=900, epochs=2))
    one, two = got[:900], got[900:]
    for epoch in (one, two):
        for w in range(3):                        # windows [50, 350), [350, 650), [650, 950)
            part = epoch[300 * w: 300 * (w + 1)]
            assert sorted(part.tolist()) == list(range(50 + 300 * w, 350 + 300 * w))
            assert not np.array_equal(part, np.sort(part))
    assert not np.array_equal(one, two)
    assert not np.array_equal(one, run(shuffle_buffer=300, seed=5, skip_lines=50, take_lines=900))
    assert np.array_equal(run(skip_lines=50, take_lines=900, epochs=2), np.tile(np.arange(50, 950), 2))
    sizes = [int(b.shape[0]) for b in order(1000, batch_size=64, shuffle_buffer=300, drop_remainder=True)]
    assert sizes == [64] * 15                     # across windows, the last short batch dropped


def test_text_read_in_chunks_keeps_line_numbers_and_line_ranges(tmp_path, monkeypatch):
    """Lines are read, numbered and cut to a line range a chunk at a time (des.data.readers.LINE_CHUNK,
    64 here): a bad line past the first chunks of the second file is still named by its own number,
    and every line range equals that slice of the whole read, across chunk and file boundaries."""
    import des.data.readers as readers
    monkeypatch.setattr(readers, "LINE_CHUNK", 64)
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.txt")
    write_criteo(a, 100, "tiny", seed=1, quiet=True)
    write_criteo(b, 300, "tiny", seed=2, quiet=True)
    spec = criteo_spec()
    full = np.concatenate([x["C1"].numpy() for x, _ in make_dataset([a, b], "criteo", spec, 50)])
    assert full.size == 400
    for skip, take in [(0, 64), (30, 100), (100, 300), (163, None), (399, 10), (400, 5)]:
        got = [x["C1"].numpy() for x, _ in make_dataset([a, b], "criteo", spec, 50, skip_lines=skip, take_lines=take)]
        want = full[skip: None if take is None else skip + take]
        assert np.array_equal(np.concatenate(got) if got else np.zeros(0, np.int64), want), (skip, take)
    lines = open(b).read().splitlines(True)
    lines[200] = "x" + lines[200]
    open(b, "w").writelines(lines)
    with pytest.raises(Exception, match=r"b\.txt:201: label 'x"):
        for _ in make_dataset([a, b], "criteo", spec, 50, shuffle_buffer=128, seed=3):
            pass

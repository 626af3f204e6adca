"""libsvm / libffm readers: values, field placement, weights, every bad-line class."""
import numpy as np
import pytest
import tensorflow as tf

from des.data import DataError, SkipReport, feature_id
from des.data.libsvm import scan_spec, sparse_spec
from des.data.readers import make_dataset
from models.spec import PAD_ID


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


def one_batch(path, fmt, spec, **kw):
    batches = list(make_dataset(path, fmt, spec, 64, **kw))
    assert len(batches) == 1
    x, y = batches[0]
    return {k: v.numpy() for k, v in x.items()}, y.numpy()


def test_libffm_fields_multi_values_weights_and_labels(tmp_path):
    p = write(tmp_path, "a.ffm", "1 0:5:1 1:7:0.5 1:8:2e0\n-1 1:7:1\n-1 0:9:1 0:5:1 2:ab:-1.5\n+1\n")
    spec = scan_spec([p], "libffm", dim=4)
    assert spec.names() == ["F0", "F1", "F2"] and [f.max_len for f in spec] == [2, 2, 1]
    x, y = one_batch(p, "libffm", spec)
    assert y.tolist() == [1, 0, 0, 1]
    fid = lambda f, v: int(feature_id(f, v))
    assert x["F0"].tolist() == [[fid("F0", "5"), PAD_ID], [PAD_ID] * 2, [fid("F0", "9"), fid("F0", "5")], [PAD_ID] * 2]
    assert x["F1"][0].tolist() == [fid("F1", "7"), fid("F1", "8")] and x["F1"][1, 0] == fid("F1", "7")
    np.testing.assert_allclose(x["F1_weight"], [[0.5, 2.0], [1.0, 0.0], [0, 0], [0, 0]])
    np.testing.assert_allclose(x["F2_weight"][:, 0], [0, 0, -1.5, 0])
    assert x["F2"][2, 0] == fid("F2", "ab")


def test_libsvm_positional_and_bag_layouts(tmp_path):
    p = write(tmp_path, "a.svm", "1 5:1 7:0.5\n-1 9:1 3:2\n")
    spec = scan_spec([p], "libsvm", dim=4)                    # same count on every line: positional
    assert spec.names() == ["F0", "F1"] and [f.max_len for f in spec] == [1, 1]
    x, y = one_batch(p, "libsvm", spec)
    assert y.tolist() == [1, 0]
    assert x["F1"][:, 0].tolist() == [int(feature_id("F1", "7")), int(feature_id("F1", "3"))]
    np.testing.assert_allclose(x["F1_weight"][:, 0], [0.5, 2.0])

    q = write(tmp_path, "b.svm", "1 5:1 7:0.5 8:1\n0 9:1\n")  # varying counts: ask, then one bag field
    with pytest.raises(DataError, match=r"b.svm:2: 1 feature\(s\) where 1 of 2 lines have 3: the libsvm layout is ambiguous"):
        scan_spec([q], "libsvm", dim=4)
    spec = scan_spec([q], "libsvm", dim=4, layout="bag")
    assert spec.names() == ["features"] and spec["features"].max_len == 3
    x, _ = one_batch(q, "libsvm", spec)
    assert x["features"][1].tolist() == [int(feature_id("features", "9")), PAD_ID, PAD_ID]
    np.testing.assert_allclose(x["features_weight"], [[1, 0.5, 1], [1, 0, 0]])


FFM_SPEC = sparse_spec("F", [2, 2, 1], dim=4)


@pytest.mark.parametrize("bad, problem", [
    ("2 0:5:1", "label '2' is not 0/1 or -1/+1"),
    ("0.5 0:5:1", "label '0.5' is not 0/1 or -1/+1"),
    ("1 0:5", "feature 1 '0:5' is not field:idx:val"),
    ("1 0:5:1 1:7:x", "feature 2 '1:7:x' is not field:idx:val"),
    ("1 a:5:1", "feature 1 'a:5:1' is not field:idx:val"),
    ("1 3:5:1", "field index 3 in '3:5:1' is outside the spec's 3 fields"),
    ("1 2:5:1 2:6:1", "field 'F2' has more than 1 features (the spec's max_len)"),
    ("", "empty line (no label)"),
    ("1 0:5:1e39", "value '1e39' of feature 1 '0:5:1e39' is not a finite float32"),
    ("1 0:5:nan", "value 'nan' of feature 1 '0:5:nan' is not finite"),
    ("1 0:5:1 1:7:-inf", "value '-inf' of feature 2 '1:7:-inf' is not finite"),
])
def test_libffm_bad_lines_name_file_line_and_problem(tmp_path, bad, problem):
    import warnings
    p = write(tmp_path, "t.ffm", "1 0:1:1\n" * 4 + bad + "\n0 1:2:1\n")
    with pytest.raises(tf.errors.OpError) as e, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)       # 1e39: the message alone, no numpy overflow warning
        one_batch(p, "libffm", FFM_SPEC)
    assert f"{p}:5: {problem}" in str(e.value)


@pytest.mark.parametrize("bad, problem", [
    ("3 5:1", "label '3' is not 0/1 or -1/+1"),
    ("1 5:1:1", "feature 1 '5:1:1' is not idx:val"),
    ("1 5:1 7:1 9:1", "the line has more than 2 features (one per field of the spec)"),
    ("0 7:1", "the line has 1 features; the positional libsvm layout needs exactly one per field (2)"),
    ("0", "the line has 0 features; the positional libsvm layout needs exactly one per field (2)"),
    ("1 5:1e39 7:1", "value '1e39' of feature 1 '5:1e39' is not a finite float32"),
    ("1 5:1 7:-4e38", "value '-4e38' of feature 2 '7:-4e38' is not a finite float32"),
])
def test_libsvm_bad_lines(tmp_path, bad, problem):
    p = write(tmp_path, "t.svm", "1 5:1 7:1\n" + bad + "\n")
    with pytest.raises(tf.errors.OpError) as e:
        one_batch(p, "libsvm", sparse_spec("F", [1, 1], dim=4))
    assert f"{p}:2: {problem}" in str(e.value)


def test_positional_line_with_a_missing_feature_is_skipped_and_counted(tmp_path):
    p = write(tmp_path, "t.svm", "1 5:1 7:1\n0 7:1\n0 5:2 9:1e39\n1 6:1 8:1\n")
    report = SkipReport()
    x, y = one_batch(p, "libsvm", sparse_spec("F", [1, 1], dim=4), skip_bad_lines=True, skip_report=report)
    assert y.tolist() == [1, 1] and report.total == 2
    assert x["F0"][:, 0].tolist() == [int(feature_id("F0", "5")), int(feature_id("F0", "6"))]
    assert np.isfinite(x["F1_weight"]).all()


def test_undecodable_bytes_and_skip_mode(tmp_path):
    p = write(tmp_path, "t.ffm", b"1 0:1:1\n1 0:\xff:1\n7 0:1:1\n0 1:2:1\n")
    with pytest.raises(tf.errors.OpError, match=r"t.ffm:2: undecodable bytes \(not UTF-8\)"):
        one_batch(p, "libffm", FFM_SPEC)
    report = SkipReport()
    x, y = one_batch(p, "libffm", FFM_SPEC, skip_bad_lines=True, skip_report=report)
    assert y.tolist() == [1, 0] and report.total == 2
    assert report.by_problem["label '7' is not 0/1 or -1/+1"] == 1


def test_empty_file_is_an_error(tmp_path):
    p = write(tmp_path, "e.ffm", "")
    with pytest.raises(Exception, match="file is empty"):
        scan_spec([p], "libffm")


def test_wide_preset_is_deterministic_libffm_with_950_features(tmp_path):
    import json

    from des.data import FeatureSpec
    from des.data.synth_wide import write_wide
    p1, p2 = str(tmp_path / "a.ffm"), str(tmp_path / "b.ffm")
    m1 = write_wide(p1, 300, seed=3, chunk=128, quiet=True)
    write_wide(p2, 300, seed=3, chunk=128, quiet=True)
    assert open(p1, "rb").read() == open(p2, "rb").read()
    assert write_wide(str(tmp_path / "c.ffm"), 300, seed=4, quiet=True)["bayes_auc"] != m1["bayes_auc"]
    assert 900 < m1["active_features_per_sample"] < 1000 and 0.75 < m1["bayes_auc"] < 0.95
    spec = FeatureSpec.from_json(json.dumps(json.load(open(p1 + ".meta.json"))["spec"]))
    assert len(spec) == 46 and max(f.max_len for f in spec) == 62
    active, rows = 0, 0
    for x, y in make_dataset(p1, "libffm", spec, 128):
        active += sum(int(np.sum(x[f.name].numpy() != PAD_ID)) for f in spec)
        rows += int(y.shape[0])
        w = x["F30_weight"].numpy()
        n = (x["F30"].numpy() != PAD_ID).sum(1)
        np.testing.assert_allclose(w.sum(1), n * np.round(1 / np.sqrt(n), 4), rtol=1e-3)
    assert rows == 300 and active / rows == pytest.approx(m1["active_features_per_sample"], abs=0.05)


def test_a_file_mixing_label_conventions_stops_at_the_first_line_of_the_other(tmp_path):
    """0/1 and -1/+1 are both accepted, one per file: a -1 after a 0 (or a 0 after a -1) is a
    bad line naming the convention its file set, and --skip-bad-lines counts it."""
    p = write(tmp_path, "mix.ffm", "1 0:5:1\n0 0:6:1\n1 0:7:1\n-1 0:8:1\n")
    with pytest.raises(tf.errors.OpError) as e:
        one_batch(p, "libffm", FFM_SPEC)
    assert f"{p}:4: label '-1', but this file's labels are 0/1 (line 2 has '0'): one file must use one convention" \
        in str(e.value)
    report = SkipReport()
    x, y = one_batch(p, "libffm", FFM_SPEC, skip_bad_lines=True, skip_report=report)
    assert y.tolist() == [1, 0, 1] and report.total == 1
    q = write(tmp_path, "pm.svm", "-1 5:1 7:1\n+1 5:1 7:1\n0 5:1 7:1\n")
    with pytest.raises(tf.errors.OpError, match=r"pm.svm:3: label '0', but this file's labels are -1/\+1 \(line 1 has '-1'\)"):
        one_batch(q, "libsvm", sparse_spec("F", [1, 1], dim=4))

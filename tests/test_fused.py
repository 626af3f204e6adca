"""Fused tables (des.transform(model, des.Options(tables="fused")), des_ops.fused): a process keeps the rows of
all its tables of one width in one TFRA table. Fused DES on N equals the untouched per-field model
on one process; checkpoints keep their per-field format both ways; ids that do not fit the key
rule stop the step with the field's name."""
import contextlib
import re

import numpy as np
import pytest
import tensorflow as tf
from helpers import random_batches, small_spec

import des
import models
from des.runtime import state
from des.jobs.verify import compare, run_in_process_world, train_and_snapshot
from des_ops.comm import LocalCommunicator
from des_ops.fused import ID_BITS, FusedTable, fused_tables as layers_fused
from models.layers import table_name
from models.spec import FeatureSpec, Field

TOL = 2e-6        # as tests/test_equivalence_sim.py: float32 summation order
SPEC = small_spec(4, dim=3)
BATCHES = random_batches(SPEC, 16, 32, seed=4)
PROBE = random_batches(SPEC, 1, 16, seed=99)[0][0]
MIXED = FeatureSpec((Field("u", "categorical", 3, 30), Field("tags", "multi", 3, 40, max_len=4),
                     Field("terms", "multi", 3, 60, max_len=5, weighted=True),
                     Field("ad", "categorical", 3, 20)))
MIXED_BATCHES = random_batches(MIXED, 12, 32, seed=5)


def build(name, spec=SPEC):
    return lambda: models.build(name, spec, seed=3, hidden=(8, 4))


def fused_tables(model) -> list[FusedTable]:
    return [l for l in des.distributed(model).layer.owned if isinstance(l, FusedTable)]


@pytest.mark.parametrize("name,optimizer,sizes,join", [
    ("deepfm", "adam", (1, 5), False), ("wdl", "ftrl+adam", (3,), False), ("fm", "adagrad", (2,), False),
    ("lr", "ftrl", (5,), False), ("deepfm", "adam", (2, 5), True), ("wdl", "ftrl", (3,), True),
    ("fm", "sgd", (2,), True)])
def test_fused_des_equals_the_per_field_single_process(name, optimizer, sizes, join):
    """Fused DES on N (N = 5: one rank owns no field) == the untouched per-field model on one process;
    N = 2 and 3 with other models and optimizers (the sweep of all models x optimizers runs per-field).
    ``join``: each field's linear weight in its embedding's row (one table per rank), every
    element-wise optimizer exact."""
    if optimizer == "ftrl+adam":
        opt, lr = (lambda: models.make_optimizer("adam", 0.01, linear="ftrl", linear_learning_rate=0.05)), None
    else:
        opt, lr = optimizer, {"adam": 0.01, "adagrad": 0.05, "ftrl": 0.05, "sgd": 0.1}[optimizer]
    work = lambda m: train_and_snapshot(m, opt, lr, BATCHES, PROBE)  # noqa: E731
    ref = work(build(name)())
    assert np.ptp(ref["predictions"][:, 0]) > 1e-3
    for n in sizes:
        runs = run_in_process_world(n, build(name), lambda m: (work(m), owns_and_fused(m)), tables="joined" if join else "fused")
        widths = 1 if join else 1 + (name != "lr")     # the linear part's width-1 tables, the embeddings
        assert [c for _, c in runs] == [(owns, widths * owns) for owns, _ in (c for _, c in runs)]
        diff = compare(ref, [r for r, _ in runs])
        print(f"{name} {optimizer} fused N={n}: {diff}")
        assert max(diff.values()) < TOL, (n, diff)
    if 5 in sizes:
        assert (False, 0) in [c for _, c in runs]      # the idle rank: no field, no fused table


def owns_and_fused(model) -> tuple[bool, int]:
    return bool(des.distributed(model).plan.fields_of(des.distributed(model).layer.comm.rank)), len(fused_tables(model))


def test_multi_valued_weighted_fields_fused():
    make = build("deepfm", MIXED)
    work = lambda m: train_and_snapshot(m, "adagrad", 0.05, MIXED_BATCHES, MIXED_BATCHES[0][0])  # noqa: E731
    ref = work(make())
    for n in (1, 2):
        diff = compare(ref, run_in_process_world(n, make, work, tables="fused"))
        assert max(diff.values()) < TOL, (n, diff)


def test_same_bits_run_after_run():
    work = lambda m: train_and_snapshot(m, "adam", 0.01, BATCHES[:6], PROBE)  # noqa: E731
    a, b = (run_in_process_world(2, build("deepfm"), work, tables="fused") for _ in range(2))
    for x, y in zip(a, b):                     # every rank's predictions, table rows, owned blocks and weights
        assert x["tables"] and x["weights"] and sorted(x) == sorted(y)
        for part in ("predictions", "tables", "owned", "weights"):
            tf.nest.assert_same_structure(x[part], y[part])            # the same tables, keys and weights
            for u, v in zip(tf.nest.flatten(x[part]), tf.nest.flatten(y[part])):
                np.testing.assert_array_equal(np.asarray(u), np.asarray(v), err_msg=part)


def test_user_tfra_embeddings_fuse_when_asked():
    """A user's own TFRA de.keras.layers.Embedding tables: kept as declared with tables="per-field",
    fused by default (tables="auto", not compiled) or when asked, and either way equal to the untouched model
    (keyed rows)."""
    from tensorflow_recommenders_addons import dynamic_embedding as de

    def make():
        ins = {f: tf.keras.Input((), dtype=tf.int64, name=f) for f in SPEC.names()}
        embs = [de.keras.layers.Embedding(3, initializer=tf.keras.initializers.RandomUniform(-0.05, 0.05),
                                          name=table_name(f"user_{f}"))(ins[f])     # TFRA shares same-named tables
                for f in SPEC.names()]
        h = tf.keras.layers.Dense(4, activation="relu", kernel_initializer=tf.keras.initializers.GlorotUniform(1))(
            tf.keras.layers.Concatenate()(embs))
        return tf.keras.Model(ins, tf.keras.layers.Dense(1, activation="sigmoid",
                                                         kernel_initializer=tf.keras.initializers.GlorotUniform(2))(h))

    plain = make()
    des.make_keyed(plain, seed=0)
    work = lambda m: train_and_snapshot(m, "adagrad", 0.05, BATCHES[:8], PROBE)  # noqa: E731
    ref = work(plain)
    kept = des.transform(make(), des.Options(tables="per-field"), comm=LocalCommunicator())[0]
    assert fused_tables(kept) == []
    assert len(fused_tables(des.transform(make(), comm=LocalCommunicator())[0])) >= 1    # the default fuses them
    runs = run_in_process_world(2, make, lambda m: (work(m), len(fused_tables(m))), tables="fused")
    assert [c for _, c in runs] == [1, 1]
    diff = compare(ref, [r for r, _ in runs])
    assert max(diff.values()) < TOL, diff


def _trained(fuse: bool, steps: int = 4, join: bool = False):
    model, _ = des.transform(build("deepfm")(), des.Options(tables=(("joined" if join else "fused") if fuse else "per-field")), comm=LocalCommunicator())
    opt = models.make_optimizer("adam", 0.01)
    model.compile(opt, "binary_crossentropy")
    for x, y in BATCHES[:steps]:
        model.train_on_batch(x, y)
    return model, opt


@pytest.mark.parametrize("direction", ["per-field into fused", "fused into per-field", "per-field into joined",
                                       "joined into per-field", "fused into joined"])
def test_checkpoint_rows_and_slots_cross_between_fused_and_per_field(direction, tmp_path):
    """A checkpoint written by one layout restores into the other, row by row (values and Adam's
    slots), and both then train on identically. Joined rows: a field's embedding and linear weight
    (and their Adam slots) are written column by column into one row each."""
    from des.runtime import checkpoint
    layout = {"per-field": (False, False), "fused": (True, False), "joined": (True, True)}
    src_layout, dst_layout = direction.split(" into ")
    src, src_opt = _trained(*layout[src_layout][:1], join=layout[src_layout][1])
    checkpoint.save(str(tmp_path / "ck"), src, src_opt, des.distributed(src).plan, 0, 1)
    dst, dst_opt = _trained(layout[dst_layout][0], steps=1, join=layout[dst_layout][1])   # other rows and slots
    checkpoint.restore(str(tmp_path / "ck"), dst, dst_opt, 0, 1)
    a, b = state.export_rows(src, src_opt), state.export_rows(dst, dst_opt)
    assert sorted(a) == sorted(b)
    tables = [k for k in a if k[0] == "table"]
    assert len(tables) == 8 and min(len(a[k]["keys"]) for k in tables) >= 5, {k: len(a[k]["keys"]) for k in tables}
    for k in a:
        order_a, order_b = (np.argsort(a[k]["keys"]), np.argsort(b[k]["keys"])) if k[0] == "table" else (..., ...)
        for part in a[k]:
            np.testing.assert_array_equal(np.asarray(a[k][part])[order_a], np.asarray(b[k][part])[order_b],
                                          err_msg=f"{k} {part}")
    for x, y in BATCHES[4:7]:
        src.train_on_batch(x, y)
        dst.train_on_batch(x, y)
    np.testing.assert_allclose(src.predict_on_batch(PROBE), dst.predict_on_batch(PROBE), rtol=0, atol=1e-6)


def test_a_restore_exports_each_fused_table_once_not_once_per_field(tmp_path, monkeypatch):
    """Restoring a joined model (4 fields: 8 members in one TFRA table, Adam's 2 slots) reads the
    keys each table holds by one export of the rows and one of each slot, not one per member (24);
    the rows and slots restored are those saved (row by row: the test above)."""
    from tensorflow_recommenders_addons import dynamic_embedding as de

    from des.runtime import checkpoint
    src, src_opt = _trained(True, join=True)
    checkpoint.save(str(tmp_path / "ck"), src, src_opt, des.distributed(src).plan, 0, 1)
    dst, dst_opt = _trained(True, steps=1, join=True)
    tables = fused_tables(dst)
    assert len(tables) == 1 and len(tables[0].member_names) == 8
    calls = []
    export = de.Variable.export
    monkeypatch.setattr(de.Variable, "export", lambda self, *a, **k: calls.append(self.name) or export(self, *a, **k))
    checkpoint.restore(str(tmp_path / "ck"), dst, dst_opt, 0, 1)
    assert len(calls) == 3 == len(set(calls)), calls                  # the rows, Adam's m and v
    a, b = state.export_rows(src, src_opt), state.export_rows(dst, dst_opt)
    for k in a:
        order_a, order_b = (np.argsort(a[k]["keys"]), np.argsort(b[k]["keys"])) if k[0] == "table" else (..., ...)
        for part in a[k]:
            np.testing.assert_array_equal(np.asarray(a[k][part])[order_a], np.asarray(b[k][part])[order_b])


def _expected_after_loads(table, params, rows: bool, ops) -> dict:
    """What ``params`` holds after ``table.load_member`` of each (member, ids, values) of ``ops``, as
    its docstring says, key by key: a slot's first member decides its keys; a key new to the slot
    starts as a lookup would; a member's columns of a key it lacks start again."""
    keys, values = (x.numpy() for x in params.export())
    held = {int(k): v.copy() for k, v in zip(keys, values)}

    def start(key: int) -> np.ndarray:
        if rows:
            return table.new_rows(tf.constant([key], tf.int64)).numpy()[0]
        return params.lookup(tf.constant([np.iinfo(np.int64).min], tf.int64)).numpy()[0]
    for member, ids, vals in ops:
        cols, slot = table._columns(member), int(table._slot[member])
        mine = {int(k) for k in table.pack(member, ids)}
        for key in [k for k in held if k >> ID_BITS == slot and k not in mine]:
            if table._start[member] == 0:
                del held[key]
            else:
                held[key][cols] = start(key)[cols]
        for key, v in zip(table.pack(member, ids), vals):
            held.setdefault(int(key), start(int(key)).copy())[cols] = v
    return held


def test_member_loads_within_loading_and_one_by_one_write_what_each_load_says():
    """Within ``FusedTable.loading`` a slot's member loads become one write at its end (a restore:
    one upsert per slot, not a lookup and an upsert per member); outside it each load writes at
    once. Both leave the rows and Adam's slots as the loads, applied one at a time key by key, say:
    members of a joined slot with different keys, a second member loaded before its first, a slot
    that already holds rows, a member emptied."""
    rng = np.random.default_rng(0)
    ops = []
    for member in [1, 0, 3, 2, 2, 5, 6]:
        ids = rng.choice(60, size=int(rng.integers(0, 14)), replace=False).astype(np.int64)
        ops.append((member, ids, rng.normal(size=(len(ids), 1 if member % 2 else 3)).astype(np.float32)))
    for deferred in (True, False):
        model, opt = _trained(True, steps=2, join=True)
        table = fused_tables(model)[0]
        assert len(table.member_names) == 8 and list(table._width) == [3, 1] * 4
        every = [(table.params, True)] + [(s.params, False) for s in state.optimizer_slots(opt, table.shadow).values()]
        assert len(every) == 3
        expected = [_expected_after_loads(table, params, rows, ops) for params, rows in every]
        assert any(len(e) > 20 for e in expected)
        with (table.loading() if deferred else contextlib.nullcontext()):
            for params, rows in every:
                for member, ids, vals in ops:
                    table.load_member(member, params, ids, vals, rows=rows)
        for (params, _), want in zip(every, expected):
            keys, values = (x.numpy() for x in params.export())
            assert sorted(int(k) for k in keys) == sorted(want), deferred
            for k, v in zip(keys, values):
                np.testing.assert_array_equal(v, want[int(k)], err_msg=f"deferred={deferred} key {k}")


def test_an_id_outside_the_key_rule_names_the_field():
    model, _ = des.transform(build("lr")(), des.Options(tables="fused"), comm=LocalCommunicator())
    x = {k: np.array(v) for k, v in PROBE.items()}
    x["f2"] = x["f2"].copy()
    x["f2"][2] = 1 << ID_BITS
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?s)outside \[0, 2\*\*55\).*emb1_f2.*36028797018963968"):
        model(x, training=True)



def test_an_id_outside_the_key_rule_in_a_multi_valued_input_names_its_field_and_padding_passes():
    """One check for all of a fused table's inputs (one-id block, multi-valued ones) still names
    the field whose id is bad; the padding id of a multi-valued field is not an error."""
    model, _ = des.transform(build("lr", MIXED)(), des.Options(tables="fused"), comm=LocalCommunicator())
    x = {k: np.array(v) for k, v in MIXED_BATCHES[0][0].items()}
    assert (x["terms"] == -1).any() and (x["tags"] == -1).any()
    model(x, training=True)                                         # padding: no error
    x["terms"] = x["terms"].copy()
    x["terms"][3, 0] = -5
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?s)outside \[0, 2\*\*55\).*emb1_terms.*id:'\n-5\n"):
        model(x, training=True)
    x["terms"][3, 0], x["ad"] = 7, x["ad"].copy()
    x["ad"][5] = 1 << ID_BITS                                        # the last column of the one-id block
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"(?s)outside \[0, 2\*\*55\).*emb1_ad.*36028797018963968"):
        model(x, training=True)

def test_report_names_the_fused_tables():
    _, report = des.transform(build("deepfm")(), des.Options(tables="fused"), comm=LocalCommunicator())
    text = str(report)
    # (TFRA shares same-named tables: a later model in this process gets des_fused3_rank0_1, ...)
    assert re.search(r"fused table des_fused3_rank0(_\d+)?: the rows of 4 table\(s\) of width 3", text), text
    assert re.search(r"fused table des_fused1_linear_rank0(_\d+)?: the rows of 4 table\(s\) of width 1", text), text
    assert "4 tables (FieldEmbedding, width 3" in text and "4 tables (FieldEmbedding, width 1" in text, text  # as declared


def _as_format_2(path: str, high_bits: int) -> None:
    """Rewrite the checkpoint at ``path`` as the previous version wrote it: format 2, with table ids of
    63 bits (``high_bits`` set above bit 55, as 63-bit hashes have)."""
    import glob
    import json
    cfg = glob.glob(f"{path}/state/config.json")[0]
    with open(cfg) as fh:
        config = json.load(fh)
    with open(cfg, "w") as fh:
        json.dump(dict(config, checkpoint_format=2), fh)
    for shard in glob.glob(f"{path}/state/*.npz"):
        npz = dict(np.load(shard, allow_pickle=False))
        index = json.loads(str(npz["index"]))
        for i, (kind, _, field) in enumerate(index):
            if kind == "table" and field == "keys":
                npz[f"a{i}"] = npz[f"a{i}"] | np.int64(high_bits << ID_BITS)
        np.savez(shard, **npz)


def test_a_format_2_checkpoint_restores_with_the_low_55_bits_of_its_ids(tmp_path):
    from des.runtime import checkpoint
    src, opt = _trained(False)
    path = str(tmp_path / "ck")
    checkpoint.save(path, src, opt, des.distributed(src).plan, 0, 1)
    _as_format_2(path, high_bits=0b1011)
    dst, dst_opt = _trained(True, steps=1)
    checkpoint.restore(path, dst, dst_opt, 0, 1)
    a, b = state.snapshot(src)["tables"], state.snapshot(dst)["tables"]
    assert a.keys() == b.keys() and all(a[k].keys() == b[k].keys() for k in a)
    for k in a:
        for i in a[k]:
            np.testing.assert_array_equal(a[k][i], b[k][i])


def test_format_2_ids_that_meet_in_55_bits_stop_the_restore(tmp_path):
    import glob
    import json

    from des.runtime import checkpoint
    src, opt = _trained(False)
    path = str(tmp_path / "ck")
    checkpoint.save(path, src, opt, des.distributed(src).plan, 0, 1)
    shard = glob.glob(f"{path}/state/*.npz")[0]
    npz = dict(np.load(shard, allow_pickle=False))
    index = json.loads(str(npz["index"]))
    i = next(i for i, (kind, _, field) in enumerate(index) if kind == "table" and field == "keys")
    keys = npz[f"a{i}"].copy()
    keys[1] = keys[0] | np.int64(1 << 60)           # another 63-bit id with the same low 55 bits
    npz[f"a{i}"] = keys
    np.savez(shard, **npz)
    _as_format_2(path, high_bits=0)
    dst, dst_opt = _trained(False, steps=1)
    with pytest.raises(checkpoint.CheckpointError, match=r"table .*: 1 pair\(s\) of its 63-bit ids"):
        checkpoint.restore(path, dst, dst_opt, 0, 1)


def test_a_fused_single_process_model_trains_as_the_per_field_one():
    """des.compiler.fusion.fuse_model (des.train --mode single's default): the same function and state keys."""
    from des.compiler.fusion import fuse_model
    work = lambda m: train_and_snapshot(m, "adagrad", 0.05, MIXED_BATCHES, MIXED_BATCHES[0][0])  # noqa: E731
    ref = work(build("wdl", MIXED)())
    fused, lines = fuse_model(build("wdl", MIXED)())
    assert len(lines) == 2 and not any(getattr(l, "des_embedding", False) for l in fused.layers)
    diff = compare(ref, [work(fused)])
    assert max(diff.values()) < TOL, diff


@pytest.mark.parametrize("n,join", [(2, False), (3, False), (2, True), (3, True)])
def test_fused_ps_equals_the_single_process_and_moves_the_per_field_bytes(n, join):
    """des.baselines.ps.rewrite.shard(..., fuse=True): one all-to-all set per width; predictions after every step and
    every row equal the untouched single process's; the bytes measured at the all-to-alls equal
    the per-table formula (des.baselines.ps.rewrite.analytic_bytes) step by step. N = 3: the batch of 2 rows leaves
    one process an empty slice. ``join``: a field's embedding and linear weight are one lookup of
    4-wide rows: its ids travel once (the formula on the untouched model's lookups joined)."""
    from helpers import single_process_predictions, train_ps_counting

    from des.jobs.verify import ps_batches, run_sharded_world, snapshot
    lr = {"adam": 0.01}
    batches, probe = ps_batches()
    expected, ref = single_process_predictions("deepfm", "adam", lr, batches, probe, with_snapshot=True)

    def work(ex):
        preds, model, exact = train_ps_counting(ex, batches, probe, fuse=True, learning_rate=lr["adam"],
                                                join_linear=join)
        return preds, exact, len(layers_fused(model)), snapshot(model)

    runs = run_sharded_world(n, work)
    rows: dict = {}
    for preds, exact, count, snap in runs:
        assert count == (1 if join else 2)             # embeddings (width 3) and the linear part (width 1)
        assert all(m == a for step in exact for m, a in step.values()), exact
        assert sum(step["remote_ids"][0] for step in exact) > 0
        diff = max(float(np.abs(a - b).max()) for a, b in zip(expected, preds))
        assert diff < 1e-6, diff
        for key, part in snap["tables"].items():
            rows.setdefault(key, {}).update(part)
    assert rows.keys() == ref["tables"].keys()
    for key, part in ref["tables"].items():
        assert rows[key].keys() == part.keys(), key      # every row lives on exactly its owner
        assert max(float(np.abs(rows[key][i] - v).max()) for i, v in part.items()) < 1e-6


def test_a_stack_or_concat_of_the_fused_outputs_in_table_order_reads_the_block_and_gives_the_same_bits(monkeypatch):
    """DeepFM on one-id fields: the FM's tf.stack and the MLP's Concatenate of all 3 fields' rows, in
    the fused table's order, read its [B, 3, dim] block (des.compiler.fusion.read_block); training gives what
    the same fused model without it and the per-field model give, within float32 summation order
    (measured: 7.5e-8 after 3 Adam steps; the same bits run after run). Negative: a Concatenate of
    some of the rows stays, and of two of all of them in two orders only the table's order reads
    the block (which order that is follows the graph's), with the same predictions."""
    from des.compiler import fusion
    from des.compiler.fusion import fuse_model
    from models.layers import FieldEmbedding
    spec = small_spec(n_fields=3, dim=4)
    batches = random_batches(spec, steps=3, batch=32)
    work = lambda m: train_and_snapshot(m, "adam", 0.01, batches, batches[0][0])  # noqa: E731
    ref = work(models.deepfm(spec, hidden=(8,), seed=3))
    fused, _ = fuse_model(models.deepfm(spec, hidden=(8,), seed=3))
    kinds = [type(l).__name__ for l in fused.layers]
    assert "Concatenate" not in kinds and not any(l.name.startswith("tf.stack") for l in fused.layers)
    assert fused.get_layer("embed_concat").__class__.__name__ == "Reshape"
    with_block = work(fused)
    with monkeypatch.context() as m:
        m.setattr(fusion, "read_block", lambda *args: {})
        unstacked, _ = fuse_model(models.deepfm(spec, hidden=(8,), seed=3))
    assert "Concatenate" in [type(l).__name__ for l in unstacked.layers]
    for other in (work(unstacked), ref):
        diff = compare(with_block, [other])
        assert max(diff.values()) < TOL, diff
    fused_again, _ = fuse_model(models.deepfm(spec, hidden=(8,), seed=3))
    assert max(compare(with_block, [work(fused_again)]).values()) == 0.0

    names = [f.name for f in spec.sparse()]
    x = {f: tf.keras.Input((), dtype=tf.int64, name=f) for f in names}
    rows = [FieldEmbedding(f, 4)(x[f]) for f in names]
    some = tf.keras.layers.Concatenate(name="some")(rows[:2])
    ordered = tf.keras.layers.Concatenate(name="ordered")(rows)
    reordered = tf.keras.layers.Concatenate(name="reordered")([rows[1], rows[0], rows[2]])
    out = tf.keras.layers.Add()([tf.keras.layers.Dense(1)(h) for h in (some, ordered, reordered)])
    plain = tf.keras.Model(x, out)
    expected = plain.predict(batches[0][0], verbose=0)
    fused, _ = fuse_model(plain)
    kinds = sorted(type(fused.get_layer(n)).__name__ for n in ("ordered", "reordered"))
    assert type(fused.get_layer("some")).__name__ == "Concatenate" and kinds == ["Concatenate", "Reshape"]
    np.testing.assert_array_equal(fused.predict(batches[0][0], verbose=0), expected)


def test_joined_lookups_halve_the_ps_ids_and_a_linear_optimizer_refuses_a_joined_table():
    """The PS's formula on joined rows: one (ids, width 3 + 1) lookup per field instead of two. A
    model whose linear part has its own optimizer cannot train joined rows: LinearAndRestOptimizer
    says so at the first step instead of updating the linear weights with the embeddings' optimizer."""
    from des.baselines.ps.rewrite import table_inputs
    plain = build("deepfm")()
    per_field, joined = table_inputs(plain), table_inputs(plain, join_linear=True)
    assert sorted(per_field) == sorted([(f, None, 3) for f in SPEC.names()] + [(f, None, 1) for f in SPEC.names()])
    assert sorted(joined) == sorted((f, None, 4) for f in SPEC.names())
    model, _ = des.transform(build("deepfm")(), des.Options(tables="joined"), comm=LocalCommunicator())
    model.compile(models.make_optimizer("adam", 0.01, linear="ftrl"), "binary_crossentropy")
    with pytest.raises(ValueError, match="linear weights and embeddings in one row"):
        model.train_on_batch(*BATCHES[0])


def test_the_cli_joins_rows_by_default_only_with_one_optimizer():
    from des.jobs.config import RunConfig
    assert RunConfig.parse(["--data", "x"]).join_linear
    assert not RunConfig.parse(["--data", "x", "--linear-optimizer", "ftrl"]).join_linear
    assert not RunConfig.parse(["--data", "x", "--tables", "fused"]).join_linear
    assert not RunConfig.parse(["--data", "x", "--mode", "cache"]).join_linear
    for bad in (["--tables", "joined", "--linear-optimizer", "ftrl"], ["--tables", "joined", "--mode", "cache"]):
        with pytest.raises(SystemExit):
            RunConfig.parse(["--data", "x", *bad])

"""A table that holds several fields in one key space - ids [B, P] read straight into one Keras or
TFRA table (TFRA's one-table style), or a TFRA table read through ids + offsets - is split by key
stripe (des.graph.fields.FieldAnalysis.stripe_positions, rewrite_rules.field_rows, des_ops.stripes):
process r of N holds the keys k mod N == r, looks them up for the whole batch (zeros elsewhere) and
the sum over processes is the lookup. In the simulated world: equal to the untouched model on one
process under both tails, every key held by its stripe's process only, rows by samples once per
distinct id (bytes counted in numpy), checkpoints that resume on another N and on one process,
saves and exports that serve, processes whose stripe no id reaches, and the tables that must not
be split so. Under mpirun: tests/test_mpi.py (test_one_table_split_by_key_stripe_under_mpirun)."""
import itertools

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

import des
from des.graph.fields import FieldAnalysis
from des.graph.ir import Graph
from des.jobs.verify import _on_every_rank, compare, copy_state, fit_and_snapshot, run_in_process_world
from des.runtime import checkpoint
from des_ops.comm import InProcessWorld
from des_ops.stripes import StripeEmbedding
from gallery import V, sliced_batches
from helpers import (adam_world, check_rows_saved_by_distinct_ids, fit_counting_rows, save_three_ways, served,
                     trained, untouched_adam, within)

L = tf.keras.layers
P, K = 4, 4
_names = itertools.count()


def one_table(kind: str = "keras", offsets: bool = False, stacked: bool = False, linear: bool = False):
    """A user's one-table DeepFM: ids [B, P] (``stacked``: a tf.stack of P one-id inputs f0 .. f3;
    plus ``offsets``: P key ranges of V) into ONE table of width K (a Keras Embedding or a TFRA
    dynamic one), FM by TF ops and an MLP over the flattened rows; beside it a per-field 1-wide table
    of another input ("user"), which a field owner keeps. ``linear`` (TFRA): the linear weights in a
    second, 1-wide TFRA table read with the same ids (TFRA's one-table style), summed into the logit."""
    if stacked:
        inputs = [tf.keras.Input(shape=(), dtype=tf.int64, name=f"f{f}") for f in range(P)]
        ids = tf.stack(inputs, axis=1)
    else:
        ids = inputs = tf.keras.Input(shape=(P,), dtype=tf.int64, name="ids")
    user = tf.keras.Input(shape=(), dtype=tf.int64, name="user")
    keys = ids + tf.constant(np.arange(P) * V, tf.int64) if offsets else ids
    if kind == "keras":
        e = L.Embedding(P * V if offsets else V, K, name=f"big{next(_names)}")(keys)
    else:            # TFRA shares tables by name: a fresh name per build
        e = de.keras.layers.Embedding(K, initializer=tf.keras.initializers.RandomNormal(0, 0.1),
                                      name=f"big{next(_names)}")(keys)
    s = tf.reduce_sum(e, axis=1)
    fm = 0.5 * tf.reduce_sum(s * s - tf.reduce_sum(e * e, axis=1), axis=1, keepdims=True)
    terms = [L.Dense(8, activation="relu")(L.Flatten()(e)), fm, L.Flatten()(L.Embedding(V, 1)(user))]
    if linear:
        w = de.keras.layers.Embedding(1, initializer=tf.keras.initializers.RandomNormal(0, 0.1),
                                      name=f"lin{next(_names)}")(keys)
        terms.append(tf.reduce_sum(w, axis=1))
    return tf.keras.Model([*inputs, user] if stacked else [ids, user],
                          tf.sigmoid(L.Dense(1)(L.Concatenate()(terms))))


def _setup(kind: str, offsets: bool = False, steps: int = 5, batch: int = 31, stacked: bool = False,
           linear: bool = False):
    build = lambda: one_table(kind, offsets, stacked, linear)  # noqa: E731
    tf.keras.utils.set_random_seed(0)
    base = build()
    if kind == "tfra":
        des.make_keyed(base, seed=0)         # new rows from (table, key, seed), as DES makes them
    batches, probe = sliced_batches(base, steps * batch + 2, batch)
    reference = build()
    copy_state(base, reference)
    if kind == "tfra":
        des.make_keyed(reference, seed=0)
    return build, base, batches, probe, reference


def _big_key(snap: dict) -> str:
    return next(k for k, rows in snap["tables"].items() if len(rows) > 1 and len(next(iter(rows.values()))) == K)


def _fit(batches, probe):
    return lambda m: fit_and_snapshot(m, batches, probe, optimizer="adam", learning_rate=0.02)


def test_which_tables_are_split_by_key_stripe():
    """stripe_positions: ids [B, P] straight into a Keras or TFRA table, or ids + offsets into a TFRA
    one, give P; a table called twice, a regularized one, one id a sample, do not."""
    def table_of(model):
        g = Graph(model)
        return FieldAnalysis(g), next(n for n in g.nodes if n.kind == "table" and n.attrs["dim"] == K)
    for kind, offsets in (("keras", False), ("tfra", False), ("tfra", True)):
        fa, n = table_of(one_table(kind, offsets))
        assert fa.stripe_positions(n) == P, (kind, offsets)
        assert fa.stripe_keys(n) == [f"ids[{f}]" + (f"+{f * V}" if offsets else "") for f in range(P)]
    fa, n = table_of(one_table("tfra", offsets=True, stacked=True))
    assert fa.stripe_positions(n) == P and fa.stripe_keys(n) == [f"f{f}+{f * V}" for f in range(P)]
    ids = tf.keras.Input(shape=(P,), dtype=tf.int64, name="ids")
    table = L.Embedding(V, K)
    twice = tf.keras.Model(ids, L.Dense(1)(L.Flatten()(L.Add()([table(ids), table(ids + 1)]))))
    assert "is called more than once" in table_of(twice)[0].stripe_positions(table_of(twice)[1])
    reg = tf.keras.Model(ids, L.Dense(1)(L.Flatten()(L.Embedding(V, K, embeddings_regularizer="l2")(ids))))
    assert "regularizer" in table_of(reg)[0].stripe_positions(table_of(reg)[1])
    one = tf.keras.Input(shape=(1,), dtype=tf.int64, name="one")
    single = tf.keras.Model(one, L.Dense(1)(L.Flatten()(L.Embedding(V, K)(one))))
    assert "fixed number (> 1)" in table_of(single)[0].stripe_positions(table_of(single)[1])


@pytest.mark.parametrize("kind,offsets,stacked", [("keras", False, False), ("tfra", False, False),
                                                  ("tfra", True, False), ("tfra", False, True)])
def test_one_table_of_several_fields_is_split_by_key_stripe_and_equals_one_process(kind, offsets, stacked):
    """At N = 3 under the replicated tail (the rows are the same floats, x + 0 = x; the last Dense,
    split by field rows for the "user" table, adds its bias gradient in another order: measured
    <= 6e-8) and the data-parallel tail with rows by samples (its dense gradients summed in another order),
    6 Adam steps of 31 and a last of 2 (processes with no sample): the predictions, every row and
    weight equal one process's; each process holds only its stripe's keys (k mod 3 == rank), none
    the whole table, and every key is held once (verify.compare)."""
    build, base, batches, probe, reference = _setup(kind, offsets, stacked=stacked)
    ref = _fit(batches, probe)(reference)
    big = _big_key(ref)
    for tail in ("replicated", "data_parallel"):
        kw = {"tail": tail} if tail == "replicated" else {"tail": tail, "field_rows": "samples"}
        ranks = run_in_process_world(3, build, _fit(batches, probe), init_from=base, **kw)
        diff = compare(ref, ranks)
        within(f"{kind} one table {tail} N=3 predictions", diff["predictions"], 1e-6)
        within(f"{kind} one table {tail} N=3 rows and weights", max(diff["tables"], diff["owned"], diff["weights"]),
               1e-6)
        held = [sorted(r["tables"][big]) for r in ranks]
        assert sorted(k for h in held for k in h) == sorted(ref["tables"][big]), tail
        for r, keys in enumerate(held):
            assert keys and all(k % 3 == r for k in keys), (tail, r, keys)


def test_a_tfra_one_table_and_its_linear_table_share_one_joined_table_a_stripe():
    """TFRA's one-table style with the linear weights in a second 1-wide TFRA table read with the same
    ids: with joined tables each process keeps its stripe of both in ONE fused table (rows [K
    embedding | 1 weight], des_fused5_joined_stripe...), looked up once a step behind one stripe
    mask; the TFRA tables themselves train no more. At N = 3 under both tails, 6 Adam steps: equal to
    one process (predictions, rows and weights within 1e-6), each process holding its stripe's keys
    of both tables only."""
    build, base, batches, probe, reference = _setup("tfra", linear=True)
    ref = _fit(batches, probe)(reference)
    striped = [k for k, rows in ref["tables"].items()
               if len(rows) > 1 and all(len(np.ravel(v)) in (1, K) for v in rows.values()) and len(rows) != V]
    assert len(striped) == 2, sorted(ref["tables"])

    def work(m):
        first = des.distributed(m).layer
        return _fit(batches, probe)(m), [layer.name for layer in first.owned], first.picks_stripe_rows
    for tail in ("replicated", "data_parallel"):
        kw = {"tail": tail} if tail == "replicated" else {"tail": tail, "field_rows": "samples"}
        out = run_in_process_world(3, build, work, init_from=base, tables="joined", **kw)
        ranks = [snap for snap, _, _ in out]
        for r, (_, owned, picks) in enumerate(out):
            assert sum(name.startswith(f"des_fused{K + 1}_joined_stripe") for name in owned) == 1, (tail, r, owned)
            assert not any(name.startswith(("big", "lin")) for name in owned), (tail, r, owned)
            # by samples each process looks up only the keys of its stripe it sends, the owner of
            # "user" too (that table's rows come out of the whole batch's lookup)
            assert picks == (tail == "data_parallel"), (tail, r)
        diff = compare(ref, ranks)
        within(f"joined stripes {tail} N=3 predictions", diff["predictions"], 1e-6)
        within(f"joined stripes {tail} N=3 rows and weights", max(diff["tables"], diff["owned"], diff["weights"]),
               1e-6)
        for key in striped:
            held = [sorted(snap["tables"][key]) for snap in ranks]
            assert sorted(k for h in held for k in h) == sorted(ref["tables"][key]), (tail, key)
            assert all(keys and all(k % 3 == r for k in keys) for r, keys in enumerate(held)), (tail, key)


def test_stripe_rows_travel_once_per_distinct_id_of_each_slice():
    """By samples each process sends a slice, for each position, its own keys' distinct rows once and
    one row of zeros for the other keys (key ``ids[f]@r/N``): at N = 3 the bytes handed to the
    collectives are smaller than with ``distinct_rows=False`` by exactly what numpy counts per slice
    and position (des_ops.rows.distinct_rows), forward under "step" and back under "tail"; both equal
    one process; the report names the keys and gives each stripe's bytes."""
    build, base, batches, probe, reference = _setup("keras")
    n = 3
    runs = {d: run_in_process_world(n, build, lambda m: fit_counting_rows(m, batches, probe, n), init_from=base,
                                    tail="data_parallel", field_rows="samples", distinct_rows=d) for d in (True, False)}
    for r in range(n):
        assert {b.key for b in runs[True][r][2][1]} >= {f"ids[{f}]@1/{n}" for f in range(P)}, runs[True][r][2]
        check_rows_saved_by_distinct_ids(runs, batches, probe, r)
    ref = fit_and_snapshot(reference, batches, probe, optimizer="adam", learning_rate=0.02)
    for d in (True, False):
        diff = compare(ref, [s for s, _, _ in runs[d]])
        within(f"stripes by samples distinct={d} N=3 predictions", diff["predictions"], 1e-6)
    x = {k: np.asarray(v) for k, v in batches[0][0].items()}
    _, report = des.transform(build(), des.Options(tail="data_parallel", field_rows="samples"),
                              comm=InProcessWorld(n).communicator(0), sample=x)
    text = str(report)
    assert f"split by key stripe over {n} processes" in text, text
    assert "ids%1 (rank 1; " in text and "its keys' rows once per distinct id of each position: " in text, text


@pytest.mark.parametrize("kind", ["keras", "tfra-joined"])
def test_processes_whose_stripe_no_id_reaches_take_part_and_nothing_hangs(kind):
    """N = 4 with every id a multiple of 4 (ids * 4 into a table of 4 V rows; "tfra-joined": a TFRA
    table and a 1-wide TFRA table on ids that are multiples of 4, joined in one table a stripe): processes 1-3 look
    up nothing, send empty blocks and still join every collective; equal to one process under both
    tails, each process holding its own stripe's rows (a TFRA stripe: none on processes 1-3, every
    key the one process made on process 0)."""
    tfra = kind == "tfra-joined"

    def build():
        ids = tf.keras.Input(shape=(P,), dtype=tf.int64, name="ids")
        if not tfra:
            e = L.Embedding(4 * V, K)(ids * 4)
            return tf.keras.Model(ids, L.Dense(1, activation="sigmoid")(L.Dense(8, activation="relu")(L.Flatten()(e))))
        init = tf.keras.initializers.RandomNormal(0, 0.1)
        e = de.keras.layers.Embedding(K, initializer=init, name=f"big{next(_names)}")(ids)   # fed ids * 4
        w = de.keras.layers.Embedding(1, initializer=init, name=f"lin{next(_names)}")(ids)
        s = tf.reduce_sum(e, axis=1)            # TFRA's one-table style, as one_table(linear=True)
        fm = 0.5 * tf.reduce_sum(s * s - tf.reduce_sum(e * e, axis=1), axis=1, keepdims=True)
        terms = [L.Dense(8, activation="relu")(L.Flatten()(e)), fm, tf.reduce_sum(w, axis=1)]
        return tf.keras.Model(ids, L.Dense(1, activation="sigmoid")(L.Concatenate()(terms)))
    tf.keras.utils.set_random_seed(0)
    base = build()
    if tfra:
        des.make_keyed(base, seed=0)
    batches, probe = sliced_batches(base, 3 * 16 + 1, 16, seed=2, probe_rows=8, probe_seed=9)
    if tfra:        # a dynamic table reads the ids as keys: multiples of 4 only
        batches = [({"ids": x["ids"] * 4}, y) for x, y in batches]
        probe = {"ids": probe["ids"] * 4}
    reference = build()
    copy_state(base, reference)
    if tfra:
        des.make_keyed(reference, seed=0)
    ref = _fit(batches, probe)(reference)
    for kw in ({"tail": "replicated"}, {"tail": "data_parallel", "field_rows": "samples"}):
        if tfra:
            kw["tables"] = "joined"
        out = run_in_process_world(4, build, lambda m: (_fit(batches, probe)(m), des.distributed(m).layer),
                                   init_from=base, **kw)
        ranks = [snap for snap, _ in out]
        for r, (_, first) in enumerate(out):
            names = [layer.name for layer in first.owned]
            assert sum(name.startswith(f"des_fused{K + 1}_joined_stripe") for name in names) == int(tfra), (r, names)
            # by samples a process looks up its keys of each slice's distinct ids only, not the whole
            # batch's; the Keras model computes its ids (ids * 4): no input to pick its rows by
            assert first.picks_stripe_rows == (tfra and kw["tail"] == "data_parallel"), (kw, r)
        diff = compare(ref, ranks)
        within(f"{kind} empty stripes {kw['tail']} N=4 predictions", diff["predictions"], 1e-6)
        if tfra:
            within(f"{kind} empty stripes {kw['tail']} N=4 rows and weights",
                   max(diff["tables"], diff["owned"], diff["weights"]), 1e-6)
            for key in [k for k in ref["tables"] if k.startswith(("big", "lin"))]:
                held = [sorted(snap["tables"][key]) for snap in ranks]
                assert held[0] == sorted(ref["tables"][key]) and not any(held[1:]), (kw, key, held)
            continue
        for r, snap in enumerate(ranks):          # each holds its stripe (rows 1-3 never read: as initialised)
            (keys,) = [sorted(rows) for rows in snap["tables"].values()]
            assert keys == list(range(r, 4 * V, 4)), (kw, r)
            assert r == 0 or all(np.array_equal(snap["tables"][k][key], ref["tables"][k][key])
                                 for k in snap["tables"] for key in keys), (kw, r)


def test_an_id_outside_a_striped_keras_tables_vocabulary_stops_every_process_with_its_name():
    """A Keras table split by key stripe given an id outside [0, V): every process checks every id
    of the batch (not only its stripe's, which it alone looks up) and stops with the table's name,
    under both tails, before any collective: none waits for another (N = 3)."""
    build, base, batches, probe, _ = _setup("keras")
    x, y = batches[0]
    ids = np.array(x["ids"])
    ids[1, 2] = V                       # one id past the table's last row
    bad = [({**x, "ids": ids}, y)]
    for kw in ({"tail": "replicated"}, {"tail": "data_parallel", "field_rows": "samples"}):
        with pytest.raises(RuntimeError, match=r"was given an id outside \[0, ") as e:
            run_in_process_world(3, build, _fit(bad, probe), init_from=base, **kw)
        assert "simulated rank" in str(e.value), kw


@pytest.mark.parametrize("kind", ["tfra", "keras", "tfra-joined"])
def test_a_striped_model_checkpoints_resumes_on_another_n_and_one_process_and_exports(tmp_path, kind):
    """3 processes train 3 of 6 Adam steps of the one-table model (TFRA or Keras; "tfra-joined": with a
    1-wide TFRA table on the same ids, both stripes in one joined table), checkpoint, model.save and
    des.export (every process; rank 0 gathers every stripe's rows for them and keeps its own after);
    the save and the export predict what the DES model does, and the
    checkpoint resumed on 2 processes and in the untouched model on one process ends where the
    uninterrupted one-process model does."""
    joined = kind == "tfra-joined"
    build, base, batches, probe, _ = _setup(kind.split("-")[0], steps=6, batch=32, linear=joined)
    batches = batches[:6]
    options = des.Options(tables="joined") if joined else None
    want = trained(untouched_adam(build, base), batches, probe)
    ckpt = str(tmp_path / "ckpt")         # written by save_three_ways
    w, ms = adam_world(3, build, base, options)

    def held_keys(m) -> list[list[int]]:
        """The keys of each table split by key stripe this process holds (a joined one's through its fused table)."""
        tables = [(layer, source) for layer, source in des.distributed(m).state.tables.values()
                  if getattr(layer, "des_key_stripe", None) or isinstance(layer, StripeEmbedding)]
        return [sorted((layer.keys() if isinstance(layer, StripeEmbedding) else source.export(layer)[0]).tolist())
                for layer, source in tables]

    def first_half(r):
        got = trained(ms[r], batches[:3], probe)
        save_three_ways(ms[r], str(tmp_path))
        owned = [layer.name for layer in des.distributed(ms[r]).layer.owned]
        assert not joined or any(name.startswith(f"des_fused{K + 1}_joined_stripe") for name in owned), owned
        return got, held_keys(ms[r])
    got, held = zip(*_on_every_rank(w, first_half))
    assert all(len(tables) == (2 if joined else 1) for tables in held), held
    assert all(keys and all(k % 3 == r for k in keys) for r, tables in enumerate(held) for keys in tables), held
    again = tf.keras.models.load_model(str(tmp_path / "saved"), compile=False)
    within("stripes: model.save, loaded", float(np.abs(again.predict_on_batch(probe) - got[0]).max()), 1e-6)
    within("stripes: des.export, served", float(np.abs(served(str(tmp_path / "served"), probe) - got[0].reshape(-1)).max()),
           1e-6)

    def second_half(m):
        checkpoint.restore(ckpt, m, m.optimizer)
        return trained(m, batches[3:], probe)
    w2, ms2 = adam_world(2, build, base, options)
    resumed = _on_every_rank(w2, lambda r: second_half(ms2[r]))
    resumed.append(second_half(untouched_adam(build, base)))
    within("stripes: checkpoint of 3 resumed on 2 and on one process", max(float(np.abs(p - want).max())
                                                                           for p in resumed), 2e-6)


def test_the_ps_and_mode_auto_train_a_one_table_model_as_one_process_does():
    """des.Options(mode="ps") and mode="auto" (with a sample batch) on TFRA's one-table style
    (tests/gallery.py tfra_one_table) at N = 2: 4 Adam steps, predictions within 1e-6 of one process
    (measured 6e-8)."""
    from gallery import BUILDERS
    build = BUILDERS["tfra_one_table"]
    tf.keras.utils.set_random_seed(0)
    base = build()
    des.make_keyed(base, seed=0)
    batches, probe = sliced_batches(base, 4 * 31, 31)
    reference = build()
    copy_state(base, reference)
    des.make_keyed(reference, seed=0)
    ref = _fit(batches, probe)(reference)
    sample = {k: np.asarray(v) for k, v in batches[0][0].items()}
    for mode in ("ps", "auto"):
        ranks = run_in_process_world(2, build, _fit(batches, probe), init_from=base, mode=mode, sample=sample)
        within(f"one table, mode {mode}, N=2: predictions",
               max(float(np.abs(r["predictions"] - ref["predictions"]).max()) for r in ranks), 1e-6)

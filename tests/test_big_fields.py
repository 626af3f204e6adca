"""A field too big for one owner (more rows than an even share of all fields' rows, and at least
des.Options.stripe_min_rows) has its tables split by key stripe over every process
(des.compiler.big_tables): process r holds the keys k mod N == r and its field vector ``<field>%r``
(its own keys' rows, zeros elsewhere) enters the FM, linear-sum and field-rows partials like any
owned vector. In the simulated world: which fields are split and why not, equal to the untouched
model on one process under both tails for plain Keras and TFRA tables, DeepCTR (its table
penalties) and TFRS models, each key held by its stripe's process only, a process whose stripe no
id reaches, and a checkpoint, a save and an export. Under mpirun: tests/test_mpi.py (test_a_big_field_split_by_key_stripe_under_mpirun)."""
import itertools

import numpy as np
import pytest
import tensorflow as tf
from tensorflow_recommenders_addons import dynamic_embedding as de

import des
import models
from des.compiler.big_tables import split_big_fields
from des.compiler.keys import state_keys
from des.graph.fields import FieldAnalysis
from des.graph.ir import Graph
from des.jobs.verify import compare, copy_state, fit_and_snapshot, run_in_process_world
from des_ops.comm import InProcessWorld
from gallery import V, sliced_batches
from helpers import adam_world, save_three_ways, served, trained, untouched_adam, within
from models.spec import PAD_ID, FeatureSpec, Field
from rewrite_rules import find_substitutions

L = tf.keras.layers
K = 4
BIG = 30 * V             # f0's rows: more than an even share of all fields' at N = 2, 3 and 4
SIZES = {"f0": BIG, "f1": V, "f2": V}
_names = itertools.count()
# rows and weights after Adam under the data-parallel tail (tests/test_gallery.py's TOL_ADAM_STATE): the tail's
# gradients are summed in another order and Adam amplifies it where gradients are tiny. Measured 3.4e-6 on the
# attention model, the same with f0 whole (stripe_min_rows=None); with SGD 1.2e-7 either way.
ADAM_STATE = 1e-5


def big_field_model(kind: str = "keras", reader: str = "fm", scale: int = 1, in_model: bool = True,
                    penalty: bool = False, capacity: int = 0):
    """Three one-id fields, f0 with BIG rows, each an embedding of width K and a 1-wide weight;
    ``reader`` "fm": FM by TF ops over their stack and the linear sum, "attention": AutoInt-like
    self-attention over the stack (no rule splits it: field rows) and the linear sum, "deepfm": FM
    and a first Dense over the flattened embeddings. ``kind`` "tfra": the width-K tables are TFRA
    dynamic ones. ``scale``: f0's table has ``scale`` times its rows, and with ``in_model`` the
    model multiplies f0's ids by it before the lookup (every key in stripe 0 of ``scale``).
    ``penalty``: the first Dense has an L2 kernel penalty. ``capacity`` (TFRA): f0's table is declared
    with ``init_capacity=capacity``."""
    inputs = [tf.keras.Input(shape=(1,), dtype=tf.int64, name=f) for f in SIZES]
    ids = [inputs[0] * scale, *inputs[1:]] if in_model and scale != 1 else inputs
    if kind == "keras":
        emb = [L.Embedding(scale * n, K, name=f"e_{f}_{next(_names)}")(i) for (f, n), i in zip(SIZES.items(), ids)]
    else:            # TFRA shares tables by name: a fresh name per build
        emb = [de.keras.layers.Embedding(K, initializer=tf.keras.initializers.RandomNormal(0, 0.1),
                                         name=f"e_{f}_{next(_names)}",
                                         **({"init_capacity": capacity} if f == "f0" and capacity else {}))(i)
               for f, i in zip(SIZES, ids)]
    weights = [L.Embedding(scale * n, 1, name=f"w_{f}_{next(_names)}")(i) for (f, n), i in zip(SIZES.items(), ids)]
    stack = L.Concatenate(axis=1)([L.Reshape((1, K))(e) for e in emb])            # [B, 3, K]
    linear = tf.reduce_sum(L.Concatenate(axis=1)(weights), axis=1)               # [B, 1]
    if reader == "attention":
        att = L.MultiHeadAttention(2, K, name=f"att{next(_names)}")(stack, stack)
        top = L.Dense(1)(L.Flatten()(att))
    else:
        s = tf.reduce_sum(stack, axis=1)
        top = 0.5 * tf.reduce_sum(s * s - tf.reduce_sum(stack * stack, axis=1), axis=1, keepdims=True)
        if reader == "deepfm":
            first = L.Dense(8, activation="relu", kernel_regularizer="l2" if penalty else None)
            top = top + L.Dense(1)(first(L.Flatten()(stack)))
    return tf.keras.Model(inputs, tf.sigmoid(top + linear))


SPEC = FeatureSpec(tuple(Field(f, dim=K, cardinality=n) for f, n in SIZES.items()))


def _split(model, n: int, min_rows: int = 0, rows: dict = SIZES):
    g = Graph(model)
    fa = FieldAnalysis(g)
    matches, _ = find_substitutions(g, fa, stripes=n)
    return split_big_fields(g, fa, matches, n, min_rows, rows)


def test_which_fields_are_split_and_why_not():
    """f0 (30 V of 32 V rows) is split at N = 3 when read by FM, the linear sum, attention (field
    rows) or a first Dense: its vectors become f0%0..f0%2, one per process, every other field's
    stay, with a kernel penalty on the Dense too; not below stripe_min_rows, or on one process; the
    small fields never."""
    for reader in ("fm", "attention", "deepfm"):
        matches, notes = _split(big_field_model(reader=reader), 3)
        fields = {v.field for m in matches for v in m.vectors}
        assert fields == {"f0%0", "f0%1", "f0%2", "f1", "f2"}, (reader, fields)
        assert all(v.key_stripe == (int(v.field[-1]), 3) for m in matches for v in m.vectors if "%" in v.field)
        assert len(notes) == 1 and notes[0].startswith(f"field 'f0': {BIG:,} rows") and \
            "split by key stripe over 3 processes" in notes[0], notes
    matches, notes = _split(big_field_model(reader="deepfm", penalty=True), 3)
    assert {v.field for m in matches for v in m.vectors} == {"f0%0", "f0%1", "f0%2", "f1", "f2"}
    assert "counts them once, on the process of stripe 0" in notes[0], notes
    assert _split(big_field_model(), 3, min_rows=BIG + 1)[1] == []
    assert _split(big_field_model(), 1)[1] == []
    assert _split(big_field_model(), 3, min_rows=None)[1] == []


def _setup(kind: str, reader: str, scale: int = 1, steps: int = 5, batch: int = 31, in_model: bool = True):
    """``reader`` "bag": bag_field_model with FM (the bag squared after the sum over processes) and an
    L2 kernel penalty on its first Dense; "deepfm-penalty":
    big_field_model's DeepFM with one."""
    penalty = reader.endswith("-penalty")
    build = lambda: big_field_model(kind, reader.removesuffix("-penalty"), scale, in_model, penalty)  # noqa: E731
    if reader == "bag":
        build = lambda: bag_field_model(kind, "fm", penalty=True)  # noqa: E731
    return (build, *_prepared(build, steps, batch))


def _prepared(build, steps: int = 5, batch: int = 31):
    """(base, batches, probe, reference) of ``build``: a seeded model whose TFRA tables make their
    new rows as DES does, ``steps`` batches of ``batch`` rows and a last of 2, a probe batch, and a
    copy of the model to train on one process."""
    tf.keras.utils.set_random_seed(0)
    base = build()
    des.make_keyed(base, seed=0)
    batches, probe = sliced_batches(base, steps * batch + 2, batch)
    reference = build()
    copy_state(base, reference)
    des.make_keyed(reference, seed=0)
    return base, batches, probe, reference


def _held_by_stripes(ranks: list[dict], ref: dict, table: str, n: int = 3) -> None:
    """Every key of ``table`` that one process holds (``ref``) is held by process k mod n only."""
    held = [sorted(r["tables"].get(table, {})) for r in ranks]
    assert sorted(k for h in held for k in h) == sorted(ref["tables"][table]), table
    for r, keys in enumerate(held):
        assert keys and all(k % n == r for k in keys), (table, r, keys)


def _fit(batches, probe):
    return lambda m: fit_and_snapshot(m, batches, probe, optimizer="adam", learning_rate=0.02)


def _split_tables(ranks: list[dict]) -> list[str]:
    """The tables (snapshot keys) that more than one process holds rows of."""
    return sorted({k for r in ranks for k, rows in r["tables"].items() if rows
                   and sum(bool(q["tables"].get(k)) for q in ranks) > 1})


@pytest.mark.parametrize("kind,reader", [("keras", "fm"), ("tfra", "fm"), ("keras", "attention"),
                                         ("tfra", "attention"), ("keras", "deepfm"), ("tfra", "deepfm"),
                                         ("keras", "deepfm-penalty")])
def test_a_big_field_split_by_key_stripe_equals_one_process(kind, reader):
    """At N = 3 under the replicated tail and the data-parallel tail (field rows by samples, keyed
    ``f0@r/3``; DeepFM, with and without an L2 kernel penalty on its first Dense, also by rows), 6 Adam steps of 31 and a last of 2 (processes with no sample): the predictions,
    every row and weight equal one process's (ADAM_STATE: rows after Adam under the data-parallel tail); f0's two tables, and no other, are held by several
    processes, each process only their keys k mod 3 == rank, every key by one (verify.compare)."""
    build, base, batches, probe, reference = _setup(kind, reader)
    batches = [(x, y) for x, y in batches]
    ref = _fit(batches, probe)(reference)
    tails = [{"tail": "replicated"}, {"tail": "data_parallel", "field_rows": "samples"}]
    if reader.startswith("deepfm"):          # the first Dense by rows: each process's stripe a block of its own
        tails.append({"tail": "data_parallel", "first_dense": "rows"})
    for kw in tails:
        tail = kw["tail"] + ("" if kw.get("first_dense") != "rows" else " first Dense by rows")
        ranks = run_in_process_world(3, build, _fit(batches, probe), init_from=base, spec=SPEC, stripe_min_rows=0,
                                     **kw)
        diff = compare(ref, ranks)
        within(f"{kind} {reader} big field {tail} N=3 predictions", diff["predictions"], 1e-6)
        within(f"{kind} {reader} big field {tail} N=3 rows and weights",
               max(diff["tables"], diff["owned"], diff["weights"]), 1e-6 if kw["tail"] == "replicated" else ADAM_STATE)
        within(f"{kind} {reader} big field {tail} N=3 loss (penalties included)",
               max(abs(r["loss"] - ref["loss"]) for r in ranks), 1e-6)
        split = _split_tables(ranks)
        assert len(split) == 2, (tail, split)              # f0's width-K and 1-wide tables, no other
        for table in split:
            _held_by_stripes(ranks, ref, table)


def test_a_tfra_table_declared_big_by_its_init_capacity_is_split_with_the_defaults():
    """A TFRA table starts empty and a sample batch holds at most its rows of distinct ids, so a
    table sized by sample= alone never reaches stripe_min_rows (1,000,000 by default). One declared
    with TFRA's ``init_capacity`` counts those rows: at N = 3 with des.Options' defaults and sample=,
    f0's TFRA table declared with 2,000,000 is split by key stripe (the report says so) and the
    model trains as one process does (6 Adam steps under both tails; ADAM_STATE: rows after Adam
    under the data-parallel tail); declared with none, f0 keeps one owner."""
    capacity = 2_000_000
    build = lambda: big_field_model("tfra", "fm", capacity=capacity)  # noqa: E731
    base, batches, probe, reference = _prepared(build)
    sample = {k: np.asarray(v) for k, v in batches[0][0].items()}
    for declared in (capacity, 0):
        _, report = des.transform(big_field_model("tfra", "fm", capacity=declared),
                                  comm=InProcessWorld(3).communicator(0), sample=sample)
        text = str(report)
        said = f"field 'f0': {capacity:,} rows, more than an even share" in text and \
            "split by key stripe over 3 processes" in text
        assert said == bool(declared), text
    ref = _fit(batches, probe)(reference)
    for kw in ({"tail": "replicated"}, {"tail": "data_parallel", "field_rows": "samples"}):
        ranks = run_in_process_world(3, build, _fit(batches, probe), init_from=base, sample=sample, **kw)
        diff = compare(ref, ranks)
        within(f"init_capacity big field {kw['tail']} N=3 predictions", diff["predictions"], 1e-6)
        within(f"init_capacity big field {kw['tail']} N=3 rows and weights",
               max(diff["tables"], diff["owned"], diff["weights"]), 1e-6 if kw["tail"] == "replicated" else ADAM_STATE)
        split = _split_tables(ranks)
        assert len(split) == 2, (kw, split)              # f0's TFRA table and its 1-wide weight table
        for table in split:
            _held_by_stripes(ranks, ref, table)


def test_the_report_says_which_fields_are_too_big_and_where_their_rows_go():
    """The report of a split: the field's line (rows, the share, the stripes), each of its tables'
    line, its stripes' owners and exchange; with a first Dense reading it, its shared kernel rows
    (by rows: each process's stripe a block keyed ``f0@r/3``), and with a kernel penalty on that
    Dense, where the shared rows' penalty is counted."""
    n = 3
    x = {k: np.asarray(v) for k, v in sliced_batches(big_field_model(), 64, 64)[0][0][0].items()}
    _, report = des.transform(big_field_model(reader="attention"),
                              des.Options(tail="data_parallel", field_rows="samples", stripe_min_rows=0),
                              comm=InProcessWorld(n).communicator(0), sample=x)
    text = str(report)
    assert "fields too big for one owner:" in text and f"field 'f0': {BIG:,} rows, more than an even share" in text
    assert "split by key stripe over 3 processes (process r holds the keys k mod 3 == r)" in text, text
    assert "f0%1 (rank 1; " in text, text
    _, report = des.transform(big_field_model(reader="deepfm", penalty=True), des.Options(stripe_min_rows=0),
                              comm=InProcessWorld(n).communicator(0))
    assert "the kernel penalty of 'dense" in str(report) and "counts them once, on the process of stripe 0" in \
        str(report), str(report)
    _, report = des.transform(big_field_model(reader="deepfm"), des.Options(stripe_min_rows=0),
                              comm=InProcessWorld(n).communicator(0))
    assert "every process holds its rows of the kernel of 'dense" in str(report), str(report)
    model, report = des.transform(big_field_model(reader="deepfm"),
                                  des.Options(tail="data_parallel", first_dense="rows", stripe_min_rows=0),
                                  comm=InProcessWorld(n).communicator(0))
    (dense,) = [op for op, rows in zip(des.distributed(model).layer.ops, des.distributed(model).layer.by_rows) if rows]
    assert [[b.key for b in bl] for bl in dense.rank_blocks] == [["f1", "f0@0/3"], ["f2", "f0@1/3"], ["f0@2/3"]], \
        dense.rank_blocks                       # its own fields' rows first, then its stripe's, keyed


@pytest.mark.parametrize("kind", ["DeepFM", "DCN"])
def test_deepctr_models_with_their_table_penalties_split_a_big_field_and_equal_one_process(kind):
    """DeepCTR's DeepFM and DCN with their defaults (an L2 penalty l2_reg_embedding=1e-5 on every
    table) and f0's vocabulary 30 V: at N = 3 f0's two tables are split by key stripe, each stripe
    holding its share of the penalty (a sum over rows), and 20 Adam steps of the user's fit equal
    one process: predictions, rows and weights, and the loss, penalty included (measured <= 2.1e-7)."""
    from deepctr import models as dm
    from deepctr.feature_column import SparseFeat
    from gallery import FIELDS, batches_for

    def build():
        cols = [SparseFeat(f, vocabulary_size=30 * V if f == "f0" else V, embedding_dim=K, dtype="int64")
                for f in FIELDS]
        return getattr(dm, kind)(cols, cols, dnn_hidden_units=(8, 4), seed=1)
    tf.keras.utils.set_random_seed(0)
    base = build()
    batches, probe = batches_for(base, 20, 32, seed=4), batches_for(base, 1, 16, seed=99)[0][0]
    reference = build()
    copy_state(base, reference)
    fit = lambda m: fit_and_snapshot(m, batches, probe, optimizer="adam", learning_rate=0.02)  # noqa: E731
    ref = fit(reference)
    _, report = des.transform(build(), des.Options(stripe_min_rows=0), comm=InProcessWorld(3).communicator(0))
    assert len(report.big_fields) == 1 and "split by key stripe over 3 processes" in report.big_fields[0], \
        report.big_fields
    ranks = run_in_process_world(3, build, fit, init_from=base, stripe_min_rows=0)
    diff = compare(ref, ranks)
    within(f"DeepCTR {kind} big field N=3 predictions", diff["predictions"], 1e-6)
    within(f"DeepCTR {kind} big field N=3 rows and weights", max(diff["tables"], diff["owned"], diff["weights"]), 1e-6)
    within(f"DeepCTR {kind} big field N=3 loss", max(abs(r["loss"] - ref["loss"]) for r in ranks), 1e-6)
    assert len(_split_tables(ranks)) == 2


@pytest.mark.parametrize("name", ["tfrs_ranking", "tfrs_dcn"])
def test_tfrs_models_split_their_big_fields_and_equal_one_process(name):
    """TFRS models (tests/subclassed_models.py: a subclassed tfrs.Model whose ids go through
    StringLookup; ranking: a first Dense over the embeddings; DCN: tfrs's Cross, by field rows) with
    des.Options(stripe_min_rows=0) at N = 3: user_id and movie_id are each more than a third of the
    rows, both split by key stripe (after the lookup: the ids' stripe is the keys'), and the user's
    fit equals one process (predictions within 1e-6; measured 3.6e-7 and 1.2e-7)."""
    from subclassed_models import BUILDERS, batches_for, probe_of, sample_of, train

    def build():
        tf.keras.utils.set_random_seed(7)
        return BUILDERS[name]()
    batches, probe = batches_for(name, 20, 32, seed=4), probe_of(name)
    ref = train(name, build(), batches, probe)
    _, report = des.transform(build(), des.Options(stripe_min_rows=0), comm=InProcessWorld(3).communicator(0),
                              sample=sample_of(name, batches))
    assert [line.split(":")[0] for line in report.big_fields] == ["field 'user_id'", "field 'movie_id'"], \
        report.big_fields
    assert all("split by key stripe over 3 processes" in line for line in report.big_fields)
    ranks = run_in_process_world(3, build, lambda m: train(name, m, batches, probe), sample=sample_of(name, batches),
                                 stripe_min_rows=0)
    within(f"{name} big fields N=3 predictions",
           max(float(np.abs(r["predictions"] - ref["predictions"]).max()) for r in ranks), 1e-6)


def test_processes_whose_stripe_no_id_reaches_take_part_and_nothing_hangs():
    """N = 4 with every f0 id a multiple of 4: processes 1-3 look up nothing of f0, send empty or
    zero blocks and still join every collective; equal to one process under both tails. The ids
    come as such from the input (rows by samples keyed ``f0@r/4``), or the model multiplies them by
    4 before its lookup: then their stripe is not the keys', and the rows go once per sample."""
    for where in ("data", "model"):
        build, base, batches, probe, reference = _setup("keras", "attention", scale=4, steps=3, batch=16,
                                                        in_model=where == "model")
        if where == "data":
            batches = [({**x, "f0": x["f0"] * 4}, y) for x, y in batches]
            probe = {**probe, "f0": probe["f0"] * 4}
        ref = _fit(batches, probe)(reference)
        keys = [m.data["stripe_keys"] for m in _split(base, 4)[0] if "stripes" in m.data]
        assert keys and all(k == (["f0"] if where == "data" else [None]) for k in keys), (where, keys)
        tails = ({"tail": "replicated"},) if where == "model" else ()
        for kw in tails + ({"tail": "data_parallel", "field_rows": "samples"},):
            ranks = run_in_process_world(4, build, _fit(batches, probe), init_from=base, stripe_min_rows=0, **kw)
            diff = compare(ref, ranks)
            within(f"empty stripes {kw['tail']} N=4 predictions", diff["predictions"], 1e-6, case=where)
            within(f"empty stripes {kw['tail']} N=4 rows", max(diff["tables"], diff["owned"], diff["weights"]),
                   1e-6 if kw["tail"] == "replicated" else ADAM_STATE, case=where)


@pytest.mark.parametrize("kind,reader", [("tfra", "deepfm"), ("keras", "fm"), ("keras", "bag")])
def test_a_big_field_checkpoints_resumes_on_another_n_and_one_process_and_exports(tmp_path, kind, reader):
    """3 processes train 3 of 6 Adam steps with f0 (bag: "history", a bag of BAG ids, read by FM and
    a first Dense with a kernel penalty) split, checkpoint, model.save and des.export;
    the save and the export predict what the DES model does, and the checkpoint resumed on 2
    processes (f0 split over 2) and in the untouched model on one process ends where the
    uninterrupted one-process model does. DeepFM: f0's first-Dense kernel rows, which every
    process holds, are saved once. The FM model has no weight but its tables (model.save of
    such a DES model failed at N > 1 before 7f30283)."""
    build, base, batches, probe, _ = _setup(kind, reader, steps=6, batch=32)
    batches = batches[:6]
    want = trained(untouched_adam(build, base), batches, probe)
    ckpt = str(tmp_path / "ckpt")
    options, spec, field = des.Options(stripe_min_rows=0), SPEC, "f0"
    if reader == "bag":
        spec, field = BAG_SPEC, "history"
    w, ms = adam_world(3, build, base, options=options, spec=spec)
    from des.jobs.verify import _on_every_rank

    def first_half(r):
        got = trained(ms[r], batches[:3], probe)
        save_three_ways(ms[r], str(tmp_path))
        return got
    got = _on_every_rank(w, first_half)
    owners = des.distributed(ms[0]).plan.owner
    assert sorted(f for f in owners if f.startswith(field)) == [f"{field}%{r}" for r in range(3)], owners
    loaded = tf.keras.models.load_model(str(tmp_path / "saved"), compile=False)
    within(f"{kind} {reader} big field save", np.abs(np.asarray(loaded.predict_on_batch(probe)) - got[0]).max(), 1e-6)
    within(f"{kind} {reader} big field export", np.abs(served(str(tmp_path / "served"), probe) - got[0].ravel()).max(), 1e-6)
    from des.runtime import checkpoint
    w2, ms2 = adam_world(2, build, base, options=options, spec=spec)

    def second_half(r):
        checkpoint.restore(ckpt, ms2[r], ms2[r].optimizer)
        return trained(ms2[r], batches[3:], probe)
    resumed = _on_every_rank(w2, second_half)
    one = untouched_adam(build, base)
    checkpoint.restore(ckpt, one, one.optimizer)
    resumed.append(trained(one, batches[3:], probe))
    within(f"{kind} {reader} big field: checkpoint of 3 resumed on 2 and on one process",
           max(float(np.abs(p - want).max()) for p in resumed), 2e-6)


BAG = 5       # ids a sample of the "history" field
BAG_SPEC = FeatureSpec((Field("history", dim=K, cardinality=BIG), Field("f1", dim=K, cardinality=V),
                        Field("f2", dim=K, cardinality=V)))


def bag_field_model(kind: str = "keras", reader: str = "deep", penalty: bool = False):
    """A field looked up with BAG ids a sample ("history", [B, BAG], a table of BIG rows) mean-pooled
    beside two one-id fields; its 1-wide weights summed over the bag into the linear sum. ``reader``
    "deep": a first Dense over the concatenation (the rules linear in the field vector), "fm": FM
    over the three vectors' stack too, "nfm": NFM's bi-interaction over it. ``kind`` "tfra": the history tables are TFRA ones declared
    with BIG rows (init_capacity). ``penalty``: an L2 kernel penalty on the first Dense."""
    history = tf.keras.Input(shape=(BAG,), dtype=tf.int64, name="history")
    ones = [tf.keras.Input(shape=(1,), dtype=tf.int64, name=f) for f in ("f1", "f2")]
    if kind == "keras":
        e_bag = L.Embedding(BIG, K, name=f"e_hist_{next(_names)}")(history)
        w_bag = L.Embedding(BIG, 1, name=f"w_hist_{next(_names)}")(history)
    else:            # TFRA shares tables by name: a fresh name per build
        e_bag, w_bag = (de.keras.layers.Embedding(d, initializer=tf.keras.initializers.RandomNormal(0, 0.1),
                                                  name=f"{p}_hist_{next(_names)}", init_capacity=BIG)(history)
                        for d, p in ((K, "e"), (1, "w")))
    pooled = tf.reduce_mean(e_bag, axis=1)                                              # [B, K]
    emb = [L.Flatten()(L.Embedding(V, K, name=f"e_{f}_{next(_names)}")(i)) for f, i in zip(("f1", "f2"), ones)]
    weights = [L.Flatten()(L.Embedding(V, 1, name=f"w_{f}_{next(_names)}")(i)) for f, i in zip(("f1", "f2"), ones)]
    linear = tf.reduce_sum(L.Concatenate()([tf.reduce_sum(w_bag, axis=1), *weights]), axis=1, keepdims=True)
    top = L.Dense(1)(L.Dense(8, activation="relu", kernel_regularizer="l2" if penalty else None)(
        L.Concatenate()([pooled, *emb])))
    if reader in ("fm", "nfm"):
        stack = tf.stack([pooled, *emb], axis=1)
        s = tf.reduce_sum(stack, axis=1)
        if reader == "fm":
            top = top + 0.5 * tf.reduce_sum(s * s - tf.reduce_sum(stack * stack, axis=1), axis=1, keepdims=True)
        else:        # NFM's bi-interaction, a [B, K] vector, into a Dense of its own
            top = top + L.Dense(1)(0.5 * (tf.square(s) - tf.reduce_sum(tf.square(stack), axis=1)))
    return tf.keras.Model([history, *ones], tf.sigmoid(top + linear))


@pytest.mark.parametrize("kind", ["keras", "tfra"])
def test_a_big_field_of_several_ids_a_sample_is_split_where_its_readers_allow(kind):
    """A bag of BAG ids a sample into a table too big for one owner. The linear sum and the first
    Dense are linear in the pooled vector, so its stripes (each process its own keys' rows, zeros
    for the others, pooled; all may be non-zero in a sample) sum to it exactly; FM squares it after
    that sum (each process sends its stripe beside its partials), and so does NFM's bi-interaction.
    At N = 3 under the replicated tail and the data-parallel tail with the first Dense by rows (the
    bag's rows go once per sample: no one id decides them), 6 Adam steps of 31 and a last of 2,
    without FM, with it and with the bi-interaction: equal to
    one process, each key of both history tables held by its stripe's process only; the report
    says FM squares it after the sum."""
    matches, notes = _split(bag_field_model(kind, "fm"), 3, rows={"history": BIG, "f1": V, "f2": V})
    fm = next(m for m in matches if m.rule == "fm_interaction")
    assert fm.data["summed"] == ["history"], fm.data
    assert len(notes) == 1 and "split by key stripe" in notes[0] and \
        f"fm_interaction at {fm.root.layer.name!r} squares its {BAG} ids a sample after the sum" in notes[0], notes
    matches, _ = _split(bag_field_model(kind, "nfm"), 3, rows={"history": BIG, "f1": V, "f2": V})
    assert next(m for m in matches if m.rule == "bi_interaction").data["summed"] == ["history"]
    for reader in ("deep", "fm", "nfm"):
        build = lambda: bag_field_model(kind, reader)  # noqa: E731
        base, batches, probe, reference = _prepared(build)
        ref = _fit(batches, probe)(reference)
        history = sorted(k for k, (layer, _) in state_keys(reference).tables.items() if "_hist_" in layer.name)
        assert len(history) == 2, history
        for kw in ({"tail": "replicated"}, {"tail": "data_parallel", "first_dense": "rows"}):
            ranks = run_in_process_world(3, build, _fit(batches, probe), init_from=base, spec=BAG_SPEC,
                                         stripe_min_rows=0, **kw)
            diff = compare(ref, ranks)
            within(f"{kind} {reader} bag field {kw['tail']} N=3 predictions", diff["predictions"], 1e-6)
            # NFM's gradient of a field vector is (sum_f v) - v_f per element, whose sum over fields is added in
            # another order across processes; Adam amplifies that where the difference cancels: TFRA, replicated,
            # rows 1.6e-6 after Adam against 7.5e-9 after SGD (measured), hence ADAM_STATE there as well
            within(f"{kind} {reader} bag field {kw['tail']} N=3 rows and weights",
                   max(diff["tables"], diff["owned"], diff["weights"]),
                   1e-6 if kw["tail"] == "replicated" and reader != "nfm" else ADAM_STATE)
            split = _split_tables(ranks)
            assert split == history, (kw, split)
            for table in split:
                _held_by_stripes(ranks, ref, table)


ZOO_SPEC = FeatureSpec((Field("big", dim=K, cardinality=BIG), Field("a", dim=K, cardinality=V),
                        Field("b", dim=K, cardinality=V)))


def _zoo_split_equals_one_process(spec: FeatureSpec, case: str, runs: list[tuple], pad=None) -> None:
    """The zoo's DeepFM over ``spec`` (field "big" too big for one owner) at N = 3, 6 steps of 31 and a
    last of 2, per (optimizer, des.Options keywords, bound of rows and weights) in ``runs``: equal to
    one process (predictions 1e-6), the big field's two tables split, each key held by its stripe's
    process only. ``pad``: edits the batches first."""
    build = lambda: models.deepfm(spec)  # noqa: E731
    tf.keras.utils.set_random_seed(0)
    base = build()
    batches, probe = sliced_batches(base, 5 * 31 + 2, 31)
    if pad is not None:
        pad(batches)
    refs: dict = {}         # the one-process model of each optimizer, trained once for all its runs' tails
    for optimizer, kw, bound in runs:
        fit = lambda m: fit_and_snapshot(m, batches, probe, optimizer=optimizer, learning_rate=0.02)  # noqa: E731
        if optimizer not in refs:
            reference = build()
            copy_state(base, reference)
            ref = fit(reference)
            big = sorted(k for k, (layer, _) in state_keys(reference).tables.items() if layer.field == "big")
            assert len(big) == 2, big
            refs[optimizer] = ref, big
        ref, big = refs[optimizer]
        ranks = run_in_process_world(3, build, fit, init_from=base, spec=spec, stripe_min_rows=0, **kw)
        diff = compare(ref, ranks)
        within(f"{case}, {optimizer} {kw} N=3 predictions", diff["predictions"], 1e-6)
        within(f"{case}, {optimizer} {kw} N=3 rows and weights", max(diff["tables"], diff["owned"], diff["weights"]),
               bound)
        assert _split_tables(ranks) == big, (kw, big, _split_tables(ranks))
        for table in big:
            _held_by_stripes(ranks, ref, table)


def test_des_trains_zoo_tables_split_by_key_stripe():
    """des.train's own tables (models.layers.FieldEmbedding, dynamic, keyed new rows) are split like
    a TFRA one: the zoo's DeepFM with a field of BIG rows in its spec, at N = 3, 6 steps of 31 and a
    last of 2 (SGD under both tails, Adam under the replicated one), equals one process, each key of
    the field's embedding and linear tables held by its stripe's process only."""
    # Adam's m / (sqrt(v) + eps) amplifies float32 summation order where a gradient is near zero: this model's
    # dense weights differ by 4.5e-7 (replicated) and 7.0e-6 (data-parallel) from one process with the field
    # whole, 5.8e-7 and 9.6e-6 split; after SGD by <= 7.5e-9 either way (measured). Adam: the replicated tail
    _zoo_split_equals_one_process(ZOO_SPEC, "zoo deepfm", [("sgd", {"tail": "replicated"}, 1e-6),
                                                           ("sgd", {"tail": "data_parallel"}, 1e-6),
                                                           ("adam", {"tail": "replicated"}, ADAM_STATE)])


@pytest.mark.parametrize("ids", [1, BAG])
def test_des_trains_weighted_fields_and_bags_split_by_masking_the_others_ids(ids):
    """des.train's table of a weighted field (libsvm / libffm ``idx:val``: [ids, weights] [B, L],
    pooled as sum_l w_l e(id_l) by the table itself), one id a sample or a bag of BAG: each process
    calls it with the ids of other stripes (and some padding) as the padding id, whose row is zero
    (des_ops.stripes.MaskedStripe), so the shares sum to the pooled vector; FM squares a bag's after
    that sum. The zoo's DeepFM at N = 3, SGD under the replicated tail, the data-parallel one and
    that with the first Dense by rows, Adam under the replicated one: equal to one process, each key
    held by its stripe's process only."""
    spec = FeatureSpec((Field("big", kind="multi", dim=K, cardinality=BIG, max_len=ids, weighted=True),
                        *ZOO_SPEC.fields[1:]))
    _, notes = _split(models.deepfm(spec), 3, rows={"big": BIG, "a": V, "b": V})
    assert len(notes) == 1 and "split by key stripe over 3 processes" in notes[0], notes
    assert (ids > 1) == ("fm_interaction at 'fm' squares its" in notes[0]), notes

    def pad(batches):                 # the reader's padding: the last position of every third sample
        for x, _ in batches:
            padded = (np.arange(x["big"].shape[0]) % 3 == 0)[:, None] & (np.arange(ids) == ids - 1)[None, :]
            x["big"] = tf.where(padded, tf.constant(PAD_ID, tf.int64), x["big"])
            x["big_weight"] = tf.where(padded, 0.0, x["big_weight"])
    _zoo_split_equals_one_process(spec, f"zoo deepfm, {ids} weighted id(s) a sample",
                                  [("sgd", {"tail": "replicated"}, 1e-6), ("sgd", {"tail": "data_parallel"}, 1e-6),
                                   ("sgd", {"tail": "data_parallel", "first_dense": "rows"}, 1e-6),
                                   ("adam", {"tail": "replicated"}, ADAM_STATE)], pad)

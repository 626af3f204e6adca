"""The parameter-server baseline on a user's own model (des.baselines.ps.rewrite.shard): every TFRA
Embedding of tests/gallery.py's TFRA DeepFM sharded by key (des.baselines.ps.tables.ShardedKeyedEmbedding,
the rows its keyed table would hold), each simulated process training its slice of every global
batch, equals the untouched model trained on the whole batches on one process (N = 3; batches
of 31 rows and a last one of 2: uneven and empty slices); through des.transform(mode="ps") on TFRA
and Keras Embedding tables (DeepCTR's, L2 penalty included); a table fed by arithmetic on the
inputs is refused with a reason; a mode-ps model saves and exports the model the user gave
des.transform, trained, and its checkpoint resumes on another N; a two-task model (DeepCTR's MMoE)
logs each task's loss of the global batch."""
import numpy as np
import pytest
import tensorflow as tf

import des
from des.baselines.ps.rewrite import shard
from des.baselines.ps.tables import KeyExchange, ShardedKeyedEmbedding, ShardedStaticEmbedding
from des.data.readers import _slice_batch
from des.graph.sources import source_of
from des.jobs.verify import _on_every_rank, copy_state
from des_ops.comm import InProcessWorld
from gallery import BUILDERS, K, batches_for
from helpers import within

ROWS, BATCH = 4 * 31 + 2, 31


def _global_batches(model) -> tuple[list, dict]:
    """(global batches for ``model``: 4 of 31 rows and one of 2, the probe every check predicts)."""
    x, y = batches_for(model, 1, ROWS, seed=4)[0]
    return ([({k: v[i:i + BATCH] for k, v in x.items()}, y[i:i + BATCH]) for i in range(0, ROWS, BATCH)],
            batches_for(model, 1, 16, seed=99)[0][0])


def _fit(model, batches, probe, rank=0, n=1):
    for x, y in batches:
        xs, ys = _slice_batch(x, y, rank, n) if n > 1 else (x, y)
        model.train_on_batch(xs, ys)
    return model.predict_on_batch(probe)


# Adam: its slots are sharded with the rows (SGD has none; the PS with SGD: des.train's Wide & Deep
# under mpirun, tests/test_mpi.py; this model with Adam under mpirun there too)
@pytest.mark.parametrize("optimizer", ["adam"])
def test_a_users_tfra_model_sharded_by_key_equals_one_process(optimizer):
    from tensorflow_recommenders_addons import dynamic_embedding as de
    make = {"adam": lambda: tf.keras.optimizers.legacy.Adam(0.02)}
    tf.keras.utils.set_random_seed(0)
    base = BUILDERS["tfra_deepfm"]()
    des.make_keyed(base, seed=0)
    batches, probe = _global_batches(base)
    reference = BUILDERS["tfra_deepfm"]()
    copy_state(base, reference)
    des.make_keyed(reference, seed=0)
    reference.compile(de.DynamicEmbeddingOptimizer(make[optimizer]()), "binary_crossentropy")
    expected = _fit(reference, batches, probe)
    for n in (3,):          # 10/10/11 rows and 0/1/1: uneven and empty slices
        world = InProcessWorld(n)
        models = []
        for r in range(n):
            m = BUILDERS["tfra_deepfm"]()
            copy_state(base, m)
            ps = shard(m, KeyExchange(world.communicator(r)))
            ps.compile(de.DynamicEmbeddingOptimizer(make[optimizer]()), "binary_crossentropy")
            models.append(ps)
        assert sum(isinstance(l, ShardedKeyedEmbedding) for l in models[0].layers) == 8     # 4 fields x (K, 1)
        out = _on_every_rank(world, lambda r: _fit(models[r], batches, probe, r, n))
        for r, predictions in enumerate(out):
            within("PS on a user's TFRA model: predictions", float(np.abs(predictions - expected).max()), 1e-6,
                   case=f"{optimizer} N={n} rank {r}")
        held = [sum(int(l.params.size()) for l in m.layers if isinstance(l, ShardedKeyedEmbedding)) for m in models]
        whole = sum(int(l.params.size()) for l in reference.layers if hasattr(l, "params"))
        assert sum(held) == whole and max(held) < whole           # every row once, split over the processes


def test_a_table_that_does_not_read_model_inputs_is_refused_with_a_reason():
    with pytest.raises(ValueError, match=r"does not read model inputs directly"):
        shard(BUILDERS["dlrm_offsets"](), KeyExchange(InProcessWorld(1).communicator(0)))


def test_a_tfra_bag_table_is_refused_for_the_ps_with_its_combiner_named():
    """A TFRA SquashedEmbedding sums a sample's rows in its lookup; the PS shards rows, not that sum:
    mode="ps" is refused naming the table (it failed inside the rewrite before)."""
    with pytest.raises(ValueError, match=r"shards a TFRA table's rows, not its combiner: 'bag_f2\w*' is a "
                                         r"SquashedEmbedding \(combiner 'sum'\)"):
        des.transform(BUILDERS["multi_hot_combiner"](), des.Options(mode="ps"), comm=InProcessWorld(1).communicator(0))


def test_a_layer_that_computes_over_the_batch_keeps_a_model_off_the_ps():
    """DIN with its Dice activation holds a BatchNormalization: on a PS each process would normalise its
    slice by the slice's statistics (measured 1.9e-5 off one process at N = 3), so mode="ps" is refused
    naming the layer, and mode="auto" keeps DES and says why."""
    x = {k: np.asarray(v) for k, v in batches_for(BUILDERS["deepctr_din"](), 1, 31, seed=4)[0][0].items()}
    with pytest.raises(ValueError, match=r"each process of a PS trains on its slice of the batch, and "
                                         r"'attention_sequence_pooling_layer\w*' holds 'batch_normalization\w*'"):
        des.transform(BUILDERS["deepctr_din"](), des.Options(mode="ps"), comm=InProcessWorld(1).communicator(0))
    world = InProcessWorld(2)
    reports = [rep for _, rep in _on_every_rank(world, lambda r: des.transform(
        BUILDERS["deepctr_din"](), des.Options(mode="auto"), comm=world.communicator(r), sample=x))]
    assert all(rep.mode == "des" and "as a PS cannot shard this model (each process of a PS" in rep.mode_reason
               for rep in reports), reports[0].mode_reason


def _fit_whole(model, batches, probe):
    """train_on_batch on every global batch (des.transform's contract: each process is handed all of
    it): the logged loss and AUC of each step, then predictions of the probe."""
    logs = [model.train_on_batch(x, y, return_dict=True) for x, y in batches]
    return [(d["loss"], d["auc"]) for d in logs], model.predict_on_batch(probe)


# TFRA tables with Adam, Keras Embedding tables (DeepCTR's DeepFM, an L2 penalty on every row) with
# SGD, both within 1e-6. Measured at N = 3: 6e-8 and 6e-8; DeepCTR's DeepFM with Adam moves 1.5e-6
# (Adam's first steps, m / (sqrt(v) + eps), go by each gradient's sign, and the penalty leaves
# gradients near zero: float32 summation order amplified), DeepCTR's DCN with Adam 6e-8.
@pytest.mark.parametrize("name,optimizer", [("tfra_deepfm", "adam"), ("deepctr_deepfm_defaults", "sgd"),
                                            ("shared_table_deepfm", "sgd")])
def test_des_transform_mode_ps_trains_the_global_batch_like_one_process(name, optimizer, tmp_path):
    """des.Options(mode="ps") through des.transform on a compiled user model (TFRA tables; DeepCTR's
    Keras Embedding tables with their L2 penalty): every simulated
    process is handed the whole global batch, trains on its rows (N = 3: slices of 10/10/11 and
    0/1/1 rows) and reports the whole batch's loss (penalties included) and AUC, step by step, as
    the untouched model on one process does, every process the same bits; every row is held once,
    split over the processes. model.save, save_weights and des.export write the trained model."""
    from tensorflow_recommenders_addons import dynamic_embedding as de

    def build():
        tf.keras.utils.set_random_seed(0)
        m = BUILDERS[name]()
        make = {"adam": lambda: tf.keras.optimizers.legacy.Adam(0.02), "sgd": lambda: tf.keras.optimizers.legacy.SGD(0.5)}
        m.compile(de.DynamicEmbeddingOptimizer(make[optimizer]()), "binary_crossentropy",
                  metrics=[tf.keras.metrics.AUC(name="auc")])
        return m

    base = build()
    batches, probe = _global_batches(base)
    reference = build()
    des.make_keyed(reference, seed=0)
    expected_logs, expected = _fit_whole(reference, batches, probe)
    for n in (3,):
        world = InProcessWorld(n)
        users = [build() for _ in range(n)]
        made = _on_every_rank(world, lambda r: des.transform(users[r], des.Options(mode="ps"),
                                                               comm=world.communicator(r), sample=batches[0][0]))
        models = [m for m, _ in made]
        assert "a parameter server" in str(made[0][1]) and "compiled as the model was" in str(made[0][1])
        joined = name == "tfra_deepfm"
        if joined:     # its TFRA tables in one joined table: a field's embedding and linear weight in one row,
            # one set of all-to-alls a step, not one per table or per width
            fused = [type(l).__name__ for l in models[0].layers if "Fused" in type(l).__name__]
            assert fused == ["ShardedFusedTable"] and f"fused table des_fused{K + 1}_joined" in str(made[0][1]), \
                (fused, str(made[0][1]))
        out = _on_every_rank(world, lambda r: _fit_whole(models[r], batches, probe))
        for r, (logs, predictions) in enumerate(out):
            case = f"{optimizer} N={n} rank {r}"
            within("mode ps: predictions", float(np.abs(predictions - expected).max()), 1e-6, case=case)
            within("mode ps: logged loss per step", float(np.abs(np.subtract(logs, expected_logs)[:, 0]).max()),
                   1e-6, case=case)
            within("mode ps: logged AUC per step", float(np.abs(np.subtract(logs, expected_logs)[:, 1]).max()),
                   1e-6, case=case)
            assert logs == out[0][0] and np.array_equal(predictions, out[0][1]), f"rank {r} differs from rank 0"
        held = [_rows_held(m) for m in models]
        whole = _rows_held(reference) // (2 if joined else 1)    # joined: one row per key for both tables
        assert sum(held) == whole and max(held) < whole, (held, whole)
        _saves_the_trained_model(world, models, probe, out[0][1], name, tmp_path)


def _saves_the_trained_model(world, models, probe, predictions, name, tmp_path):
    """model.save, save_weights and des.export on every process write the model the user gave
    des.transform with every process's trained rows: what it predicts is what the PS model does."""
    def save(r):
        models[r].save(str(tmp_path / "m_tf"))
        models[r].save_weights(str(tmp_path / "w.h5"))
        des.export(models[r], str(tmp_path / "served"))
    _on_every_rank(world, save)
    objects = {}
    if name.startswith("deepctr"):
        from deepctr.layers import custom_objects as objects
    again = tf.keras.models.load_model(str(tmp_path / "m_tf"), custom_objects=objects, compile=False)
    within("mode ps: model.save, loaded", float(np.abs(again.predict_on_batch(probe) - predictions).max()), 1e-6)
    if not name.startswith("tfra"):     # TFRA's tables are not Keras weights: h5 holds no TFRA table
        fresh = BUILDERS[name]()
        fresh.load_weights(str(tmp_path / "w.h5"))
        within("mode ps: save_weights, loaded", float(np.abs(fresh.predict_on_batch(probe) - predictions).max()), 1e-6)
    serve = tf.saved_model.load(str(tmp_path / "served")).signatures["serving_default"]
    served = next(iter(serve(**{k: tf.constant(v) for k, v in probe.items()}).values()))
    within("mode ps: des.export, served", float(np.abs(np.reshape(served, [-1]) - np.reshape(predictions, [-1])).max()),
           1e-6)
    held = [sum(len(source_of(new).export(new)[0]) for new, _ in m.table_pairs) for m in models]
    tables_a_row = 2 if name == "tfra_deepfm" else 1        # joined: a field's embedding and linear weight
    assert held == [tables_a_row * _rows_held(m) for m in models]   # the save left each process's tables as they were


def _rows_held(model) -> int:
    """Table rows in ``model``: TFRA tables' sizes, Keras Embedding and sharded static rows."""
    total = 0
    for layer in model.layers:
        if hasattr(layer, "params"):
            total += int(layer.params.size())
        elif isinstance(layer, tf.keras.layers.Embedding):
            total += int(layer.embeddings.shape[0])
        elif isinstance(layer, ShardedStaticEmbedding):
            total += int(layer.rows.shape[0])
    return total


def test_mode_auto_chooses_as_des_train_does_and_the_processes_must_agree():
    """mode="auto" takes des.jobs.auto.choose's verdict on the sample (few distinct ids: the PS;
    many: DES), says why in the report, needs a sample, and ends at once, naming the ranks, when
    the processes were given different samples."""
    model = BUILDERS["tfra_deepfm"]()
    x = {k: np.asarray(v) for k, v in batches_for(model, 1, 256, seed=0)[0][0].items()}
    few = {k: v % 3 for k, v in x.items()}              # 3 distinct ids per field: a PS moves less
    many = {k: np.arange(len(v), dtype=v.dtype).reshape(v.shape) * 7 + i for i, (k, v) in enumerate(x.items())}
    world = InProcessWorld(2)
    for sample, kind in ((few, "WholeBatchPS"), (many, None)):
        out = _on_every_rank(world, lambda r: des.transform(BUILDERS["tfra_deepfm"](), des.Options(mode="auto"),
                                                              comm=world.communicator(r), sample=sample))
        for m, report in out:
            assert "mode auto: " + ("PS" if kind else "DES") in str(report), str(report)
            assert (type(m).__name__ == "WholeBatchPS") == bool(kind)
    with pytest.raises(ValueError, match="pass sample="):
        des.transform(BUILDERS["tfra_deepfm"](), des.Options(mode="auto"))
    with pytest.raises(Exception, match="rank 1 of 2 disagrees with rank 0 on the mode"):
        _on_every_rank(world, lambda r: des.transform(BUILDERS["tfra_deepfm"](), des.Options(mode="auto"),
                                                        comm=world.communicator(r), sample=(few, many)[r]))


def test_mode_auto_weighs_the_exchange_des_would_use():
    """Few distinct ids: a PS moves fewer bytes than DES's partials, but not than DES's rows
    exchange, which carries no ids. With des.transform's first layer by rows, mode auto weighs
    that exchange (each field's distinct rows of a slice, in and their gradients out, from the
    field's one owner: half of them at N = 2, plus the dense gradients' ring), takes DES and builds
    it by rows; with the first layer by operators it weighs the partials and takes the PS."""
    model = BUILDERS["tfra_deepfm"]()
    x = {k: np.asarray(v) for k, v in batches_for(model, 1, 256, seed=0)[0][0].items()}
    few = {k: v % 3 for k, v in x.items()}
    dim = K + 1                                    # a field's embedding and its linear weight, one row
    rows = np.mean([sum(0.5 * 2 * 4 * dim * len(np.unique(v[lo:hi])) for v in few.values())
                    for lo, hi in ((0, 128), (128, 256))])
    dense = sum(int(np.prod(w.shape)) for layer in model.layers if isinstance(layer, tf.keras.layers.Dense)
                for w in layer.weights)
    expected = rows + 1.0 * 4 * dense              # ring share 2(N-1)/N = 1 at N = 2
    world = InProcessWorld(2)
    for first_layer, kind in (("rows", "DES (its field rows to their samples' processes)"), ("operators", "PS")):
        out = _on_every_rank(world, lambda r: des.transform(
            BUILDERS["tfra_deepfm"](), des.Options(mode="auto", first_layer=first_layer),
            comm=world.communicator(r), sample=few))
        for m, report in out:
            assert f"mode auto: {kind.split()[0]} - " in report.mode_reason, report.mode_reason
            if kind == "PS":
                assert type(m).__name__ == "WholeBatchPS"
                continue
            assert f"DES (its field rows to their samples' processes) would send {expected:,.0f} B/step" \
                in report.mode_reason, (expected, report.mode_reason)
            assert report.first_layer == "rows" and report.tail == "data_parallel"


def test_mode_auto_keeps_des_where_a_ps_cannot_shard_the_model():
    """A DLRM port (one table read through ids + offsets) on data where a PS would move fewer
    bytes: DES, and the report says why."""
    model = BUILDERS["dlrm_offsets"]()
    x = {k: np.asarray(v) % 3 for k, v in batches_for(model, 1, 256, seed=0)[0][0].items()}
    world = InProcessWorld(2)
    out = _on_every_rank(world, lambda r: des.transform(BUILDERS["dlrm_offsets"](), des.Options(mode="auto"),
                                                          comm=world.communicator(r), sample=x))
    for m, report in out:
        assert type(m).__name__ != "WholeBatchPS"
        assert "mode auto: DES, as a PS cannot shard this model (embedding" in str(report), str(report)


def test_the_compiler_alone_refuses_a_mode_it_does_not_run():
    """des.compiler.transform substitutes; handed mode "ps" or "auto" without the facade's choice it
    says where the choice is made rather than silently running DES."""
    from des.compiler import transform as substitute
    for mode in ("ps", "auto"):
        with pytest.raises(ValueError, match=r"des.transform's to weigh"):
            substitute(BUILDERS["tfra_deepfm"](), des.Options(mode=mode))


@pytest.mark.parametrize("name", ["deepctr_deepfm_defaults", "tfra_deepfm"])
def test_a_mode_ps_checkpoint_resumes_on_another_number_of_processes(tmp_path, name):
    """DeepCTR's DeepFM (Keras Embedding tables, L2 penalty) or a TFRA DeepFM with Adam through mode ps:
    des.checkpoint.save on 3 processes after two batches (rows and Adam's slots by key, each
    process its own), des.checkpoint.restore on 2 (each keeps the keys it holds there), the rest
    of the batches: the untouched model trained on one process without a stop, within 2e-6."""
    from tensorflow_recommenders_addons import dynamic_embedding as de

    def build():
        tf.keras.utils.set_random_seed(0)
        m = BUILDERS[name]()
        m.compile(de.DynamicEmbeddingOptimizer(tf.keras.optimizers.legacy.Adam(0.02)), "binary_crossentropy")
        return m

    base = build()
    batches, probe = _global_batches(base)
    reference = build()
    des.make_keyed(reference, seed=0)            # a TFRA table's new rows as des.transform's
    for xb, yb in batches:
        reference.train_on_batch(xb, yb)
    expected = reference.predict_on_batch(probe)

    def run(n, part, restore):
        world = InProcessWorld(n)
        users = [build() for _ in range(n)]

        def work(r):
            m, _ = des.transform(users[r], des.Options(mode="ps"), comm=world.communicator(r), sample=batches[0][0])
            if restore:
                des.checkpoint.restore(str(tmp_path / "ckpt"), m, m.optimizer)
            for xb, yb in part:
                m.train_on_batch(xb, yb)
            if not restore:
                des.checkpoint.save(str(tmp_path / "ckpt"), m, m.optimizer)
            return m.predict_on_batch(probe)
        return _on_every_rank(world, work)
    run(3, batches[:2], restore=False)
    for r, got in enumerate(run(2, batches[2:], restore=True)):
        within("mode ps: resumed from 3 processes on 2", float(np.abs(got - expected).max()), 2e-6, case=f"rank {r}")


def test_a_two_task_model_under_mode_ps_logs_each_tasks_loss_of_the_global_batch():
    """DeepCTR's MMoE (two binary tasks, Keras Embedding tables) through mode ps at N = 3 (slices
    of 10/10/11 and 0/1/1 rows): every process logs the total loss and each task's loss of the
    whole global batch, as the untouched model on one process does, the same bits everywhere, and
    predicts both tasks as it does."""
    from gallery import MULTI_TASK

    def build():
        tf.keras.utils.set_random_seed(0)
        m = MULTI_TASK["deepctr_mmoe"]()
        m.compile(tf.keras.optimizers.legacy.SGD(0.5), ["binary_crossentropy", "binary_crossentropy"])
        return m

    base = build()
    x, y = batches_for(base, 1, ROWS, seed=4)[0]
    y = tf.concat([y, 1.0 - y[::-1]], 1)                 # a second task: another label per sample
    batches = [({k: v[i:i + BATCH] for k, v in x.items()}, [y[i:i + BATCH, :1], y[i:i + BATCH, 1:]])
               for i in range(0, ROWS, BATCH)]
    probe = batches_for(base, 1, 16, seed=99)[0][0]
    reference = build()
    expected_logs = [reference.train_on_batch(xb, yb, return_dict=True) for xb, yb in batches]
    expected = np.asarray(reference.predict_on_batch(probe))
    world = InProcessWorld(3)
    users = [build() for _ in range(3)]

    def work(r):
        m, _ = des.transform(users[r], des.Options(mode="ps"), comm=world.communicator(r), sample=batches[0][0])
        return [m.train_on_batch(xb, yb, return_dict=True) for xb, yb in batches], np.asarray(m.predict_on_batch(probe))
    out = _on_every_rank(world, work)
    assert sorted(expected_logs[0]) == ["buy_loss", "click_loss", "loss"]
    for r, (logs, predictions) in enumerate(out):
        for key in expected_logs[0]:
            within(f"mode ps, two tasks: logged {key} per step",
                   max(abs(d[key] - e[key]) for d, e in zip(logs, expected_logs)), 1e-6, case=f"rank {r}")
        within("mode ps, two tasks: predictions", float(np.abs(predictions - expected).max()), 1e-6, case=f"rank {r}")
        assert logs == out[0][0], f"rank {r} logs other bits than rank 0"

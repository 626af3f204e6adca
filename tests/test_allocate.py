"""--allocate: which process trains which sample of a global batch (des.baselines.allocate).

Any allocation is exact under the synchronous PS (the update sums the whole batch's gradients);
laia moves fewer rows. Exactness runs in the simulated world (N = 2..4, the PS and the cache at
staleness 0 against the untouched single-process model); under a real mpirun: tests/test_mpi.py.
"""
import numpy as np
import pytest
import tensorflow as tf

import models
from des.baselines import allocate
from des.baselines.cache.rewrite import cache
from des.baselines.ps.rewrite import shard
from des.jobs.verify import PS_SPEC, optimizer_factory, ps_batches, run_sharded_world
from helpers import single_process_predictions

LR = {"sgd": 0.2, "adagrad": 0.05, "adam": 0.01, "ftrl": 0.05}
KEYS = [f.name for f in PS_SPEC.sparse()]


def remote_ids(feats: dict, parts: list, n: int) -> int:
    """Distinct ids of each process's samples that another process owns, summed over processes."""
    total = 0
    for w, idx in enumerate(parts):
        for k in KEYS if "u" in feats else list(feats):
            u = np.unique(np.asarray(feats[k])[idx])
            u = u[u != -1]
            total += int(np.sum(u % n != w))
    return total


def test_laia_gives_each_sample_to_the_owner_of_its_keys():
    """4 samples of one key each, keys 2, 3, 4, 5: process 0 owns the even ones. Contiguous
    slices fetch 2 remote keys; laia none."""
    feats = {"k": np.array([2, 3, 4, 5], np.int64)}
    laia = allocate.make("laia", 2, ["k"])(feats, 4)
    assert [p.tolist() for p in laia] == [[0, 2], [1, 3]]
    assert remote_ids(feats, allocate.make("contiguous", 2)(feats, 4), 2) == 2
    assert remote_ids(feats, laia, 2) == 0


def test_laia_puts_samples_that_share_keys_together():
    """Keys 7, 9, 7, 9 (all owned by process 1), chunks of one sample per process: process 0
    takes both samples of one key (1 remote key), not one of each (2)."""
    feats = {"k": np.array([7, 9, 7, 9], np.int64)}
    alloc = allocate.LaiaAllocation(2, ["k"], chunk=2)
    parts = alloc(feats, 4)
    assert sorted(len(p) for p in parts) == [2, 2]
    assert len(np.unique(feats["k"][parts[0]])) == 1


def test_laia_simulates_the_caches_at_staleness_0():
    """Keys 5, 5, 3, 3 (process 1 owns both): process 0 gets the two samples of key 3 and caches
    it, valid with plain SGD (its own update stays in its copy), outdated otherwise. Next batch both
    processes use key 3: process 1 updates it, so process 0's copy is outdated."""
    for sgd in (True, False):
        alloc = allocate.LaiaAllocation(2, ["k"], {"k": 10}, keeps_own_updates=sgd)
        assert [p.tolist() for p in alloc({"k": np.array([5, 5, 3, 3])}, 4)] == [[2, 3], [0, 1]]
        keys, valid = alloc.cached(0, "k")
        assert keys.tolist() == [3] and valid.tolist() == [sgd] and len(alloc.cached(1, "k")[0]) == 0
        parts = alloc({"k": np.array([3, 3, 3, 3])}, 4)
        assert [len(p) for p in parts] == [2, 2]
        assert alloc.cached(0, "k")[1].tolist() == [False]


def test_a_full_cache_keeps_the_new_lines_still_valid_first():
    """One line per process. Process 0 gets samples 2 and 3 and looks up keys 5 and 1 (process 1
    owns both); process 1's samples use key 1 too, so process 0's copy of 1 is outdated. With
    plain SGD process 0 keeps 5, valid (it could hit), and evicts 1, although 1 came first in the
    batch; without SGD no new line is valid and the batch's first key stays."""
    k = np.array([[1, 3], [1, 3], [5, 2], [1, 4]])
    for sgd, kept, evicted in ((True, ([5], [True]), [1]), (False, ([1], [False]), [5])):
        alloc = allocate.LaiaAllocation(2, ["k"], {"k": 1}, keeps_own_updates=sgd)
        assert [p.tolist() for p in alloc({"k": k}, 4)] == [[2, 3], [0, 1]]
        assert tuple(x.tolist() for x in alloc.cached(0, "k")) == kept
        assert alloc.evictions(0)["k"].tolist() == evicted


# the contiguous sizes of ps_batches(steps=6, batch=50)'s batches (50 rows x 6, then 2, then 3) by
# hand: process w gets rows [b w // n, b (w+1) // n), so the remainder falls to the later processes
SIZES = {2: {50: [25, 25], 2: [1, 1], 3: [1, 2]},          # 3 rows: cuts 0, 1, 3
         3: {50: [16, 17, 17], 2: [0, 1, 1], 3: [1, 1, 1]},  # 50 rows: cuts 0, 16, 33, 50; 2 rows: 0, 0, 1, 2
         4: {50: [12, 13, 12, 13], 2: [0, 1, 0, 1], 3: [0, 1, 1, 1]}}   # 50: 0, 12, 25, 37, 50


@pytest.mark.parametrize("kind", allocate.CHOICES)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_every_sample_once_balanced_and_the_same_on_every_process(kind, n):
    batches, _ = ps_batches(steps=6, batch=50)
    a, b = allocate.make(kind, n, KEYS, {k: 10 for k in KEYS}, seed=1), allocate.make(kind, n, KEYS, {k: 10 for k in KEYS}, seed=1)
    for x, y in batches:
        feats = {k: v.numpy() for k, v in x.items()}
        parts = a(feats, len(y))
        assert sorted(np.concatenate(parts).tolist()) == list(range(len(y)))
        assert [len(p) for p in parts] == SIZES[n][len(y)]
        assert [p.tolist() for p in parts] == [p.tolist() for p in b(feats, len(y))]
    assert a.digest() == b.digest() and a.batches == len(batches)


def test_laia_fetches_fewer_remote_ids_than_contiguous_slices():
    from des.jobs.verify import random_batches
    spec_batches = random_batches(PS_SPEC, 10, 256, seed=3)
    n = 4
    laia, cont = allocate.make("laia", n, KEYS), allocate.make("contiguous", n)
    got = {"laia": 0, "contiguous": 0}
    for x, y in spec_batches:
        feats = {k: v.numpy() for k, v in x.items()}
        got["laia"] += remote_ids(feats, laia(feats, len(y)), n)
        got["contiguous"] += remote_ids(feats, cont(feats, len(y)), n)
    print(got)
    assert got["laia"] < 0.9 * got["contiguous"]


def _train_allocated(model, exchange, kind, batches, probe, optimizer, capacity=None, others=False,
                     evictions=False, alloc=None, probe_each_step=True):
    """fit on this process's share (des.baselines.allocate.Share.mine: its rows and, with ``others``, the
    keys the other processes use; with ``evictions``, the keys laia's simulation evicts from its
    cache); predictions on ``probe`` after every step, and the allocation's digest."""
    model.compile(optimizer_factory(optimizer, LR)(), "binary_crossentropy")
    alloc = alloc or allocate.make(kind, exchange.world_size, KEYS, capacity, seed=5,
                                   keeps_own_updates=optimizer == "sgd")
    share = allocate.Share(alloc, exchange.rank, others=others, evictions=evictions)
    x0 = batches[0][0]
    spec = {k: tf.TensorSpec([None, *v.shape[1:]], v.dtype) for k, v in x0.items()}
    spec.update({k: tf.TensorSpec([None], tf.int64) for k in share.extras()})

    def shares():
        for x, y in batches:
            feats = {k: v.numpy() for k, v in x.items()}
            mine, used = share.mine(feats, len(y))
            yield {**{k: v[mine] for k, v in feats.items()}, **used}, y.numpy()[mine]
    ds = tf.data.Dataset.from_generator(shares, output_signature=(spec, tf.TensorSpec([None], tf.float32)))
    preds = []
    probe_after_step = tf.keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda b, logs: preds.append(model.predict_on_batch(probe)))
    if not probe_each_step:       # the owners' rows may lack updates the workers still hold: flush first
        model.fit(ds, epochs=1, verbose=0)
        model.flush()
        return [model.predict_on_batch(probe)], alloc.digest()
    model.fit(ds, epochs=1, verbose=0, callbacks=[probe_after_step])
    return preds, alloc.digest()


def assert_exact(outs: list, expected: list, label: str) -> None:
    """Every rank computed the same allocation and predicted as the single process after every step."""
    assert len({digest for _, digest in outs}) == 1
    for preds, _ in outs:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(expected, preds))
        print(f"{label}: {diff:.1e}")
        assert diff < 1e-6


@pytest.mark.parametrize("n", [4])       # N = 3: under mpirun (tests/test_mpi.py)
def test_ps_with_laia_is_the_single_process_model(n):
    batches, probe = ps_batches()
    expected = single_process_predictions("deepfm", "adam", LR, batches, probe)
    outs = run_sharded_world(n, lambda ex: _train_allocated(
        shard(models.build("deepfm", PS_SPEC, seed=3, hidden=(8, 4)), ex), ex, "laia", batches, probe, "adam"))
    assert_exact(outs, expected, f"ps laia N={n}")


@pytest.mark.parametrize("n,kind,optimizer", [(3, "random", "adagrad")])    # laia: the next test
def test_cache_at_staleness_0_with_an_allocation_is_the_single_process_model(n, kind, optimizer):
    batches, probe = ps_batches()
    expected = single_process_predictions("wdl", optimizer, LR, batches, probe)
    capacity = {k: 6 for k in KEYS}

    def work(ex):
        model = cache(models.build("wdl", PS_SPEC, seed=3, hidden=(8, 4)), ex, staleness=0, capacity=6)
        return _train_allocated(model, ex, kind, batches, probe, optimizer, capacity)
    assert_exact(run_sharded_world(n, work), expected, f"cache s=0 {kind} N={n} {optimizer}")


@pytest.mark.parametrize("n,kind,optimizer", [(2, "contiguous", "adam")])   # laia + SGD: the next two tests
def test_the_on_demand_plan_is_exact_and_asks_only_for_what_it_lacks(n, kind, optimizer):
    """Staleness 0 without queries: every process knows from the allocation which keys the others
    update, so a line is re-read only when it is missing or outdated. Same predictions as the single
    process after every step (4-row caches: evictions every step), and fewer bytes than the
    query protocol (no id + clock for a valid line, no clocks back)."""
    batches, probe = ps_batches()
    expected = single_process_predictions("wdl", optimizer, LR, batches, probe)

    def work(ex, on_demand):
        model = cache(models.build("wdl", PS_SPEC, seed=3, hidden=(8, 4)), ex, staleness=0, capacity=4,
                      on_demand=on_demand)
        preds, digest = _train_allocated(model, ex, kind, batches, probe, optimizer, {k: 4 for k in KEYS},
                                         others=on_demand)
        return preds, model.cache_counters()
    runs = {od: run_sharded_world(n, lambda ex, od=od: work(ex, od)) for od in (False, True)}
    for preds, _ in runs[True]:
        diff = max(float(np.abs(a - b).max()) for a, b in zip(expected, preds))
        print(f"on-demand {kind} N={n} {optimizer}: {diff:.1e}")
        assert diff < 1e-6
    total = {od: {k: sum(c[k] for _, c in runs[od]) for k in ("query_bytes", "clock_bytes", "fetch_bytes",
                                                               "push_bytes", "analytic_bytes", "fetched", "hits")}
             for od in runs}
    print(total)
    assert total[True]["clock_bytes"] == 0 and total[True]["query_bytes"] < total[False]["query_bytes"]
    assert total[True]["fetched"] == total[False]["fetched"]          # the same rows move
    sent = lambda t: t["query_bytes"] + t["clock_bytes"] + t["fetch_bytes"] + t["push_bytes"]  # noqa: E731
    assert sent(total[True]) == total[True]["analytic_bytes"] and sent(total[True]) < sent(total[False])


@pytest.mark.parametrize("n,optimizer,on_demand", [(2, "sgd", True), (2, "ftrl+adam", False)])
def test_the_simulated_caches_are_the_real_caches(n, optimizer, on_demand):
    """One set of lines: laia's simulation decides the cache's evictions (Share(evictions=True)),
    so after training every process's real cache of every table holds exactly the keys its
    simulated cache holds, valid where the simulation says so (on-demand: clock >= 0), no line
    left by the cache's own LRU rule, evictions happened (4-row caches), and the model is still
    the single process's after every step (the cache at staleness 0 with laia is exact)."""
    batches, probe = ps_batches()
    expected = single_process_predictions("deepfm", optimizer, LR, batches, probe)
    capacity = {k: 4 for k in KEYS}

    def work(ex):
        model = cache(models.build("deepfm", PS_SPEC, seed=3, hidden=(8, 4)), ex, staleness=0, capacity=4,
                      on_demand=on_demand)
        alloc = allocate.make("laia", ex.world_size, KEYS, capacity, keeps_own_updates=optimizer == "sgd")
        preds, digest = _train_allocated(model, ex, "laia", batches, probe, optimizer, others=on_demand,
                                         evictions=True, alloc=alloc)
        mismatch, lines = [], 0
        for layer, ids in model.cached_tables():
            keys, values = layer.lines.table.export()
            keys, clock = keys.numpy(), layer.lines.parts(values)[1].numpy()
            order = np.argsort(keys)
            sim_keys, sim_valid = alloc.cached(ex.rank, ids)
            lines += len(keys)
            if keys[order].tolist() != sim_keys.tolist():
                mismatch.append((layer.name, keys[order].tolist(), sim_keys.tolist()))
            elif on_demand and (clock[order] >= 0).tolist() != sim_valid.tolist():
                mismatch.append((layer.name, "valid", (clock[order] >= 0).tolist(), sim_valid.tolist()))
        return preds, digest, mismatch, lines, model.cache_counters()
    outs = run_sharded_world(n, work)
    assert_exact([o[:2] for o in outs], expected, f"laia-planned cache N={n} {optimizer}")
    for preds, digest, mismatch, lines, counters in outs:
        print(f"lines {lines}, evicted {counters['evicted']}, unplanned {counters['evicted_unplanned']}")
        assert mismatch == [] and lines > 0
        assert counters["evicted"] > 0 and counters["evicted_unplanned"] == 0


@pytest.mark.parametrize("n,kind", [(2, "laia")])
def test_plan_pushes_are_exact_and_push_fewer_rows(n, kind):
    """Herald's plan pushes (on-demand, plain SGD): an update stays in its worker's line until
    another process reads the key (pushed at the start of that step, applied by the owner before
    any read), or the line is evicted (4-row caches) or flushed. After training and a flush the
    model is the single process's, with fewer rows pushed than the eager on-demand plan."""
    batches, probe = ps_batches()
    expected = single_process_predictions("wdl", "sgd", LR, batches, probe)[-1:]

    def work(ex, plan):
        model = cache(models.build("wdl", PS_SPEC, seed=3, hidden=(8, 4)), ex, staleness=0, capacity=4,
                      on_demand=True, plan_pushes=plan)
        preds, digest = _train_allocated(model, ex, kind, batches, probe, "sgd", {k: 4 for k in KEYS},
                                         others=True, evictions=kind == "laia", probe_each_step=False)
        return preds, digest, model.cache_counters()
    runs = {plan: run_sharded_world(n, lambda ex, plan=plan: work(ex, plan)) for plan in (False, True)}
    assert_exact([o[:2] for o in runs[True]], expected, f"plan pushes {kind} N={n}")
    pushed = {plan: sum(o[2]["pushed"] for o in runs[plan]) for plan in runs}
    fetched = {plan: sum(o[2]["fetched"] for o in runs[plan]) for plan in runs}
    print(f"rows pushed: eager {pushed[False]}, plan {pushed[True]}; fetched {fetched}")
    assert 0 < pushed[True] < pushed[False]
    for _, _, c in runs[True]:
        assert c["push_bytes"] + c["query_bytes"] + c["fetch_bytes"] == c["analytic_bytes"]


def test_without_the_plan_the_cache_evicts_by_its_own_rule():
    """The negative: the same run without ``evictions`` leaves the choice to the cache's LRU."""
    batches, probe = ps_batches()

    def work(ex):
        model = cache(models.build("lr", PS_SPEC, seed=3), ex, staleness=0, capacity=4)
        _train_allocated(model, ex, "laia", batches, probe, "adagrad", {k: 4 for k in KEYS})
        return model.cache_counters()
    for counters in run_sharded_world(2, work):
        assert counters["evicted_unplanned"] == counters["evicted"] > 0


def _plain_sizes(batch: int, n: int) -> list:
    """The contiguous slices' sizes: process w gets rows [batch w // n, batch (w+1) // n)."""
    return [batch * (w + 1) // n - batch * w // n for w in range(n)]


def _plain_assign(score: list, pref: list, room: list) -> list:
    """Samples -> process in rounds: every unassigned sample asks the process with room it scores
    highest (equal scores: the lower ``pref``); a process asked by more samples than its room keeps
    the highest-scored (equal: the earlier sample) and is full; the rest ask again. -1: no room."""
    room, owner = list(room), [-1] * len(score)
    while True:
        pending = [i for i in range(len(score)) if owner[i] < 0]
        open_ = [w for w in range(len(room)) if room[w] > 0]
        if not pending or not open_:
            return owner
        asks = {}
        for i in pending:
            best = max(open_, key=lambda w: (score[i][w], -pref[w]))
            asks.setdefault(best, []).append(i)
        for w, ask in asks.items():
            for i in sorted(ask, key=lambda i: -score[i][w])[:room[w]]:     # sorted is stable
                owner[i] = w
                room[w] -= 1


def _reference_laia(batches: list, n: int, inputs: list, chunk: int) -> list:
    """laia written plainly (PS, no cache), with nothing of des.baselines.allocate: per sample its (input, key)
    ids; sample i scores for w the ids w owns (key mod n) or took with a sample given to it earlier
    in the batch, one per occurrence; equal scores go by a preference rotating with the batch
    (batch b prefers process b mod n, then the next); a chunk first gives each process at most its
    fair share of the chunk (ceil(chunk / n)), then whatever room is left of its contiguous size."""
    out = []
    for b, (feats, batch) in enumerate(batches):
        ids = [[(t, int(k)) for t, name in enumerate(inputs) for k in np.ravel(feats[name][i]) if k != -1]
               for i in range(batch)]
        held = [set() for _ in range(n)]
        quota = _plain_sizes(batch, n)
        owner = [-1] * batch
        pref = [(w - b) % n for w in range(n)]
        for lo in range(0, batch, chunk):
            hi = min(batch, lo + chunk)
            score = [[sum(1 for t, k in ids[i] if k % n == w or (t, k) in held[w]) for w in range(n)]
                     for i in range(lo, hi)]
            fair = (hi - lo + n - 1) // n
            got = _plain_assign(score, pref, [min(q, fair) for q in quota])
            left = [j for j, w in enumerate(got) if w < 0]
            if left:
                again = _plain_assign([score[j] for j in left], pref, [quota[w] - got.count(w) for w in range(n)])
                for j, w in zip(left, again):
                    got[j] = w
            for j, w in enumerate(got):
                assert w >= 0
                quota[w] -= 1
                owner[lo + j] = w
                held[w].update(ids[lo + j])
        out.append([[i for i in range(batch) if owner[i] == w] for w in range(n)])
    return out


@pytest.mark.parametrize("n,chunk", [(2, 0), (3, 7), (4, 16)])
def test_vectorised_laia_is_the_plain_definition(n, chunk):
    """The numpy laia (one tokenisation over all inputs, a chunk's scores in one gather) gives
    the allocation of the plain per-sample, per-id loops, batch after batch (multi-valued inputs
    with pads, batches of 2 and 3 rows)."""
    batches = [({k: v.numpy() for k, v in x.items()}, len(y)) for x, y in ps_batches(steps=4, batch=40)[0]]
    alloc = allocate.LaiaAllocation(n, KEYS, chunk=chunk)
    got = [[p.tolist() for p in alloc(f, b)] for f, b in batches]
    assert got == _reference_laia(batches, n, KEYS, chunk or 32 * n)


def test_tokens_match_a_plain_tokeniser():
    """A hand-made batch: input a one id per sample, b up to 3 with pads (-1), keys shared between
    the inputs (a 5 and b 5 are different tokens). Tokens sample by sample, inputs in order, pads
    dropped; equal tokens exactly for equal (input, key)."""
    feats = {"a": np.array([5, 7, 5, 9]), "b": np.array([[5, -1, 3], [-1, -1, -1], [3, 3, 8], [2**62, -1, -1]])}
    alloc = allocate.LaiaAllocation(2, ["a", "b"])
    starts, token, keys, which, code = alloc._tokens(feats, 4, ("a", "b"))
    plain = [[(t, int(k)) for t, name in enumerate("ab") for k in np.ravel(feats[name][i]) if k != -1]
             for i in range(4)]
    assert np.diff(starts).tolist() == [len(p) for p in plain]
    flat = [pair for p in plain for pair in p]
    assert [(int(which[t]), int(keys[t])) for t in token] == flat
    assert len(keys) == len(set(flat)) == 7 and sorted(set(token.tolist())) == list(range(7))
    assert (code == allocate._token_key(keys, which)).all()


def test_group_numbers_values_by_first_appearance():
    """_group numbers equal values alike and different values apart, in the order they first
    appear, and points at each value's first element (values that agree in their low or high
    bits included, where a weak hash would collide)."""
    rng = np.random.default_rng(1)
    pool = np.concatenate([rng.integers(0, 2**63, 200).astype(np.uint64),
                           np.arange(50, dtype=np.uint64) << np.uint64(58), np.arange(50, dtype=np.uint64)])
    code = rng.choice(pool, 5000)
    ids, first = allocate._group(code)
    _, ref_first = np.unique(code, return_index=True)
    assert ids.dtype == np.int32 and len(first) == len(ref_first)
    assert (code[first][ids] == code).all()                          # same id: same value
    assert first.tolist() == sorted(ref_first.tolist())               # each value's first element, in order
    assert ids[first].tolist() == list(range(len(first)))             # numbered by first appearance
    assert [x.tolist() for x in allocate._group(np.zeros(0, np.uint64))] == [[], []]


def test_top_k_scores_the_inputs_with_the_most_distinct_ids():
    """Input a has 1 distinct id, b 4, c 3: top_k=2 reads b and c, chosen on the first batch and
    kept. k = every input allocates as no top_k; with only b scored, samples go to b's owners."""
    feats = {"a": np.array([1, 1, 1, 1]), "b": np.array([2, 3, 4, 5]), "c": np.array([7, 7, 9, 11])}
    alloc = allocate.make("laia", 2, ["a", "b", "c"], top_k=2)
    alloc(feats, 4)
    assert alloc.fields == ("b", "c")
    alloc({"a": np.array([1, 2, 3, 4]), "b": np.array([2, 2, 2, 2]), "c": np.array([7, 7, 7, 7])}, 4)
    assert alloc.fields == ("b", "c")
    only_b = allocate.make("laia", 2, ["a", "b", "c"], top_k=1)
    assert [p.tolist() for p in only_b(feats, 4)] == [[0, 2], [1, 3]]
    assert only_b.fields == ("b",) and only_b.inputs == ("a", "b", "c")
    with pytest.raises(ValueError):
        allocate.make("laia", 2, ["a"], top_k=0)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_top_k_is_balanced_the_same_on_every_process_and_k_all_is_laia(k):
    """Every sample once, exactly the contiguous sizes, the same on two instances (with a cache);
    k = all 4 inputs gives the allocation of laia without top_k."""
    batches, _ = ps_batches(steps=6, batch=50)
    cap = {key: 10 for key in KEYS}
    a, b = (allocate.make("laia", 3, KEYS, cap, top_k=k) for _ in range(2))
    full = allocate.make("laia", 3, KEYS, cap)
    for x, y in batches:
        feats = {key: v.numpy() for key, v in x.items()}
        parts = a(feats, len(y))
        assert sorted(np.concatenate(parts).tolist()) == list(range(len(y)))
        assert [len(p) for p in parts] == SIZES[3][len(y)]
        assert [p.tolist() for p in parts] == [p.tolist() for p in b(feats, len(y))]
        full(feats, len(y))
    assert a.digest() == b.digest() and len(a.fields) == k
    assert (a.digest() == full.digest()) == (k == len(KEYS))


@pytest.mark.parametrize("top_k", [None, 2])
def test_the_key_lists_the_plan_reads_are_the_other_processes_keys(top_k):
    """Share(others=True): for every input, the distinct keys of the samples given to the other
    processes - from laia's tokens for the inputs it scores (``used_by_others``), by a sort for
    the rest - on every rank, batch after batch (multi-valued inputs with pads, 4-row caches)."""
    batches, _ = ps_batches(steps=4, batch=40)
    alloc, twin = (allocate.make("laia", 3, KEYS, {key: 4 for key in KEYS}, top_k=top_k) for _ in range(2))
    share = allocate.Share(twin, 1, others=True)
    for x, y in batches:
        feats = {key: v.numpy() for key, v in x.items()}
        parts = alloc(feats, len(y))
        _, lists = share.mine(feats, len(y))          # the same allocation on another instance
        for rank in range(3):
            known = alloc.used_by_others(rank)
            assert sorted(known) == sorted(alloc.fields)
            rest = np.concatenate([p for r, p in enumerate(parts) if r != rank])
            for key in KEYS:
                ids = np.unique(feats[key][rest])
                ids = ids[ids != -1]
                if key in known:
                    assert np.array_equal(np.sort(known[key]), ids), key
                if rank == 1:
                    assert np.array_equal(np.sort(lists[key + allocate.OTHERS]), ids), key
    assert twin.digest() == alloc.digest()

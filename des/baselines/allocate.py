"""Which process trains which sample of a global batch (``--allocate``), for the data-parallel
modes (``ps``, ``cache``): the input-scheduling seam between the reader and the trainer.

A synchronous PS step applies the sum of the gradients of the whole global batch, so WHICH process
handles WHICH sample does not change the update: every allocation is exact. It changes what moves:
a process fetches the rows of the keys its samples use that it neither owns (key mod N) nor holds
in a valid cache line, once per distinct key.

    contiguous  rows [b*r//N, b*(r+1)//N) of a batch of b rows (the default, the readers' ``shard=``)
    random      a seeded permutation of the batch, cut into the same sizes
    laia        Herald's locality-aware input allocation, online (below)

laia scores sample i for process w by how many of its ids w holds: keys w owns, keys with a
valid line in w's simulated cache (``capacity`` rows per input, LRU over the keys w looked up,
a line outdated once another process used its key - staleness 0; no cache for the PS mode) and
keys of samples already given to w in this batch (so samples sharing keys go together and a
key is fetched by fewer processes). It takes the samples in chunks; within a chunk the samples
ask in rounds, each for its best-scored process not yet tried, and a process keeps the
best-scored askers up to its fair share of the chunk and rejects the rest (``_assign``; not a
global greedy over all pairs), so that over the batch each process gets exactly its contiguous
size (the batch stays balanced). Ties go by a preference that rotates every batch; it never
looks past the current batch. Every process runs the same allocator on the same global
batches in the same order, so all compute the same allocation with no collective
(``digest`` lets a test compare them).

It is numpy throughout: a batch's ids are tokenised for all inputs at once (one token per
distinct (input, key), numbered by a hash table - pandas.factorize - per block of inputs, exact),
and a chunk's scores are one gather of a [token, process] table and one ``reduceat``.
``top_k`` (``make(..., top_k=k)``) scores only the k inputs with the most distinct ids in the
first batch (chosen once, the same on every process): faster, a little less locality. A simulated
cache is kept grouped by input, most recently used first (within one batch, the lines still
valid first: only they can hit), so LRU is a cut per input with no sort of its lines; the key
lists the cache's on-demand plan reads (``used_by_others``) come from the same tokens.

    >>> alloc = make("laia", world_size=2, keys=["C1", "C2"])     # process w owns keys k % 2 == w
    >>> ids = {"C1": np.array([2, 4, 3, 5, 2, 3]), "C2": np.array([10, 11, 10, 13, 10, 11])}
    >>> [part.tolist() for part in alloc(ids, batch=6)]           # samples 0 and 4: all keys even
    [[0, 1, 4], [2, 3, 5]]
    >>> other = make("laia", world_size=2, keys=["C1", "C2"])     # what another process computes
    >>> [part.tolist() for part in other(ids, batch=6)], other.digest() == alloc.digest()
    ([[0, 1, 4], [2, 3, 5]], True)
    >>> ds = ds.map(Share(alloc, rank).take)      # doctest: +SKIP

``alloc(...)``: the indices for rank 0, 1; ``Share(alloc, rank).take`` is the tf.data map that
keeps this process's samples of each global batch.

The simulated caches ARE the cache's line sets: ``Share(..., evictions=True)`` hands the train
step, per input, the keys the simulation evicts from this process's cache after this batch
(feature ``<input>@evict``), and the cache (des.baselines.cache.tables) evicts exactly those instead of
choosing by its own LRU. Both insert the same keys (the remote keys a process looks up), so the
real lines are the simulated ones, key for key (a cache that starts empty while the simulation
is warm - a resumed epoch - holds a subset). Validity follows the same rule on both sides
(outdated once another process updates the row). Correctness never depends on any of this: it
is what makes the score, and Herald's plan, see the caches as they are. With ``top_k`` only the
k scored inputs are simulated; the caches of the others evict by their own LRU rule.
"""
from __future__ import annotations

import hashlib
import time
from typing import Sequence

import numpy as np
import tensorflow as tf

PAD_ID = -1  # models.spec.PAD_ID (kept local: this module imports nothing of the project)
CHOICES = ("contiguous", "random", "laia")


def sizes(batch: int, world_size: int) -> np.ndarray:
    """Samples per process: the contiguous slices' sizes (differ by at most one)."""
    r = np.arange(world_size + 1)
    return np.diff(batch * r // world_size)


def split(rows: np.ndarray, world_size: int) -> list[np.ndarray]:
    """``rows`` cut into consecutive parts of the contiguous ``sizes``."""
    return np.split(rows, np.cumsum(sizes(len(rows), world_size))[:-1])


class Allocator:
    """``alloc(feats, batch)`` -> one int64 index array per process, together a permutation of
    range(batch). Stateful (laia's caches, random's generator): call it on every global batch in
    order. ``inputs``: the feature names it reads."""

    name = "contiguous"
    inputs: tuple[str, ...] = ()

    def __init__(self, world_size: int, keys: Sequence[str] = ()):
        self.world_size = world_size
        self.inputs = tuple(dict.fromkeys(keys))
        self.batches = 0
        self.hashes: list[str] = []     # one per allocated batch
        self.samples, self.seconds = 0, 0.0
        self.cpu_seconds = 0.0          # the calling thread's CPU time: what it costs, whoever else runs
        self.extra_seconds = self.extra_cpu_seconds = 0.0   # Share's time on what it hands besides the rows

    def __call__(self, feats: dict, batch: int) -> list[np.ndarray]:
        start, cpu = time.perf_counter(), time.thread_time()
        parts = self.allocate(feats, batch)
        self.seconds += time.perf_counter() - start
        self.cpu_seconds += time.thread_time() - cpu
        self.samples += batch
        self.batches += 1
        h = hashlib.sha1()
        for p in parts:
            h.update(np.asarray(p, np.int64).tobytes() + b"|")
        self.hashes.append(h.hexdigest())
        return parts

    def allocate(self, feats: dict, batch: int) -> list[np.ndarray]:
        return split(np.arange(batch, dtype=np.int64), self.world_size)

    def used_by_others(self, rank: int) -> dict[str, np.ndarray]:
        """{input: distinct keys the last batch's samples not given to ``rank`` use}, for the inputs
        the allocator already knows them of (here none: ``Share`` finds them)."""
        return {}

    @property
    def samples_per_second(self) -> float:
        """Global-batch samples allocated per second of allocator time (its own speed)."""
        return self.samples / self.seconds if self.seconds else float("inf")

    def digest(self, batches: int | None = None) -> str:
        """A hash of the first ``batches`` allocations (all: None), equal on every process that
        allocated them alike."""
        return hashlib.sha1("".join(self.hashes[:batches]).encode()).hexdigest()[:16]


class RandomAllocation(Allocator):
    name = "random"

    def __init__(self, world_size: int, keys: Sequence[str] = (), seed: int = 0):
        super().__init__(world_size, keys)
        self._rng = np.random.default_rng(seed)

    def allocate(self, feats, batch):
        return [np.sort(p) for p in split(self._rng.permutation(batch).astype(np.int64), self.world_size)]


class LaiaAllocation(Allocator):
    """Locality-aware allocation (see the module docstring). ``keys``: the id inputs of the
    sharded tables; ``capacity``: cached rows per input and process (0 or missing: no cache);
    ``top_k``: score only the k inputs with the most distinct ids in the first batch (None: all;
    ``fields`` names them once chosen; the simulated caches then hold those inputs' keys only)."""

    name = "laia"

    def __init__(self, world_size: int, keys: Sequence[str], capacity: dict[str, int] | None = None,
                 chunk: int = 0, keeps_own_updates: bool = False, top_k: int | None = None):
        super().__init__(world_size, keys)
        if top_k is not None and int(top_k) < 1:
            raise ValueError(f"top_k must be at least 1 or None, got {top_k!r}")
        self.capacity = {k: int((capacity or {}).get(k, 0)) for k in self.inputs}
        self.chunk = chunk or 32 * world_size
        self.keeps_own_updates = keeps_own_updates   # plain SGD: a process's own update keeps its copy valid
        self.top_k = None if top_k is None else int(top_k)
        # the inputs the score reads: all, or (top_k) the k with the most distinct ids of the first batch
        every = self.top_k is None or self.top_k >= len(self.inputs)
        self.fields: tuple[str, ...] | None = self.inputs if every else None
        self._cap = np.array([self.capacity[k] for k in self.inputs], np.int64)
        self._narrow = np.int16 if len(self.inputs) < 1 << 14 else np.int64   # 2 x input number: a radix sort
        # per process: cached (input, key) tokens, their input, valid; grouped by input, most
        # recently used first (_update_caches: the order is the recency)
        empty = (np.zeros(0, np.uint64), np.zeros(0, np.int64), np.zeros(0, bool))
        self.cache = [empty for _ in range(world_size)]
        self.evicted = [(np.zeros(0, np.uint64), np.zeros(0, np.int64)) for _ in range(world_size)]  # last batch's
        self._users = None    # the last batch's (users [token, process], keys, inputs): used_by_others

    def _tokens(self, feats: dict, batch: int, names: Sequence[str]):
        """The id occurrences of ``names``, sample by sample: (starts [batch + 1]: sample i's
        occurrences are [starts[i], starts[i+1]); token of each occurrence, int32, one per
        distinct (input, key), numbered 0..T-1; per token its key, its input (index in
        ``inputs``) and its uint64 code (``_token_key``)). Vectorised over the inputs: they are
        grouped (``_group``) in blocks of consecutive inputs of about ``_BLOCK`` ids, small
        enough for the cache, and the tokens written into one [batch, ids] matrix."""
        cols = [np.asarray(feats[k]).reshape(batch, -1) for k in names]
        index = np.array([self.inputs.index(k) for k in names], np.int64)
        widths = np.array([c.shape[1] for c in cols], np.int64)
        tokmat = np.empty((batch, int(widths.sum())), np.int32)    # -1: a pad
        keys, which, codes = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)], [np.zeros(0, np.uint64)]
        total = i = col = 0
        while i < len(cols):
            j, size = i + 1, batch * widths[i]
            while j < len(cols) and size + batch * widths[j] <= _BLOCK:
                size += batch * widths[j]
                j += 1
            sub = (np.concatenate(cols[i:j], 1) if j > i + 1 else cols[i]).astype(np.int64, copy=False)
            col_input = np.repeat(index[i:j], widths[i:j])
            real = sub != PAD_ID
            at = np.flatnonzero(real)
            code = _token_key(sub, col_input).reshape(-1)[at]
            token, first = _group(code)
            token += total
            block = tokmat[:, col:col + sub.shape[1]]
            block[...] = -1
            block[real] = token
            at = at[first]
            keys.append(sub.reshape(-1)[at])
            which.append(col_input[at % sub.shape[1]])
            codes.append(code[first])
            total, col, i = total + len(first), col + sub.shape[1], j
        real = tokmat >= 0
        starts = np.zeros(batch + 1, np.int64)
        np.cumsum(real.sum(1), out=starts[1:])
        return starts, tokmat[real], np.concatenate(keys), np.concatenate(which), np.concatenate(codes)

    def _choose_fields(self, feats: dict, batch: int) -> tuple[str, ...]:
        """The ``top_k`` inputs with the most distinct ids in this batch (ties: the earlier input),
        in input order: a function of the batch alone, so the same on every process."""
        _, _, _, which, _ = self._tokens(feats, batch, self.inputs)
        distinct = np.bincount(which, minlength=len(self.inputs))
        best = np.lexsort((np.arange(len(self.inputs)), -distinct))[:self.top_k]
        return tuple(self.inputs[i] for i in np.sort(best))

    def allocate(self, feats, batch):
        n = self.world_size
        self._users = None
        if n == 1 or batch == 0 or not self.inputs:
            return super().allocate(feats, batch)
        if self.fields is None:
            self.fields = self._choose_fields(feats, batch)
        starts, token, keys, which, code = self._tokens(feats, batch, self.fields)
        # have[t, w]: process w holds token t (owns its key, a valid cached line, or it is a key of
        # a sample already given to w in this batch); one row per token, so a chunk gathers rows
        have = np.zeros((len(keys), n), bool)
        have[np.arange(len(keys)), np.mod(keys, n)] = True
        lines = self._lines_in_batch(code)
        for w in range(n):
            valid = self.cache[w][2]
            have[lines[w][valid & (lines[w] >= 0)], w] = True
        quota = sizes(batch, n).copy()
        owner = np.full(batch, -1, np.int64)
        rot = self.batches % n
        tie = ((np.arange(n) - rot) % n) * 1e-3           # rotating preference among equal scores
        counts = np.diff(starts)
        flat = have.reshape(-1)
        users = np.zeros((len(keys), n), bool)     # users[t, w]: a sample given to w uses token t
        used_flat = users.reshape(-1)
        for lo in range(0, batch, self.chunk):
            hi = min(batch, lo + self.chunk)
            tok = token[starts[lo]:starts[hi]]
            score = np.zeros((hi - lo, n))
            some = np.flatnonzero(counts[lo:hi])                 # samples with ids (reduceat skips none)
            if len(some):
                held = np.take(have, tok, axis=0).view(np.uint8)  # [ids of the chunk, n]: w holds it
                score[some] = np.add.reduceat(held, starts[lo + some] - starts[lo], axis=0, dtype=np.int32)
            score -= tie[None, :]
            room = np.minimum(quota, -(-(hi - lo) // n))   # at most a fair share of the chunk each
            got = _assign(score, room)
            if (got < 0).any():                              # then, if that left samples over, any room
                rest = np.flatnonzero(got < 0)
                got[rest] = _assign(score[rest], quota - np.bincount(got[got >= 0], minlength=n))
            owner[lo:hi] = got
            quota -= np.bincount(got, minlength=n)
            at = tok.astype(np.intp) * n + np.repeat(got, counts[lo:hi])
            flat[at] = True                                  # w now holds its samples' keys
            used_flat[at] = True
        self._users = (users, keys, which)
        self._update_caches(users, keys, which, code, lines)
        return [np.flatnonzero(owner == w).astype(np.int64) for w in range(n)]

    def _lines_in_batch(self, code: np.ndarray) -> list[np.ndarray]:
        """Per process, per cached line: the token of this batch with its code (-1: none). One hash
        table of the batch's (distinct) codes, probed with every process's lines."""
        if not self._cap.any() or not len(code):
            return [np.full(len(c[0]), -1, np.int64) for c in self.cache]
        import pandas as pd
        index = pd.Index(code)
        return [index.get_indexer(old).astype(np.int64, copy=False) for old, _, _ in self.cache]

    def _update_caches(self, users, keys, which, tok64, lines) -> None:
        """The caches after this batch's step, as the cache at staleness 0 keeps them: each process
        holds the keys it looked up and does not own (LRU, ``capacity`` per input); a copy stays
        valid unless another process used the key (and so updated its row), or the process itself
        did without ``keeps_own_updates``. ``users[t, w]``: process w's samples use token t; ``lines``:
        ``_lines_in_batch``. A cache is kept grouped by input, most recently used first (this
        batch's keys - the still valid ones first, as only they can hit, then by token - then the
        kept lines in their order): LRU is a cut per input, with no sort of the lines."""
        n = self.world_size
        self.evicted = [(np.zeros(0, np.uint64), np.zeros(0, np.int64)) for _ in range(n)]
        if not self._cap.any():
            return
        count = users.view(np.uint8).sum(1, dtype=np.int32)
        cacheable = self._cap[which] > 0
        home = np.mod(keys, n)
        m = len(self.inputs)
        for w in range(n):
            others = count - users[:, w] > 0
            mine = users[:, w] & (home != w) & cacheable
            used = np.flatnonzero(mine)
            fresh = ~others[used] & self.keeps_own_updates        # a new line no other process outdated
            # by input, valid lines first (the only ones that can hit), then token: a radix sort
            new_order = np.argsort((which[used].astype(np.int32) << 1 | ~fresh).astype(self._narrow), kind="stable")
            used, fresh = used[new_order], fresh[new_order]
            old, old_t, old_valid = self.cache[w]
            tok = lines[w]
            here = tok >= 0
            at = np.where(here, tok, 0)
            keep = ~(here & mine[at])                 # a line w used again is renewed (among ``used``)
            valid = old_valid & ~(here & others[at])  # another process updated its row: outdated
            k = np.concatenate([tok64[used], old[keep]])
            t = np.concatenate([which[used], old_t[keep]])
            valid = np.concatenate([fresh, valid[keep]])
            # grouped by input, new lines first: each line's place in its input, without a sort
            new_n = np.bincount(t[:len(used)], minlength=m)
            old_n = np.bincount(t[len(used):], minlength=m)
            place = np.concatenate([np.arange(len(used)) - _starts(new_n)[t[:len(used)]],
                                    np.arange(len(t) - len(used)) - _starts(old_n)[t[len(used):]]
                                    + new_n[t[len(used):]]])
            fits = place < self._cap[t]
            self.evicted[w] = (k[~fits], t[~fits])
            kept = np.minimum(new_n + old_n, self._cap)
            order = np.empty(int(kept.sum()), np.int64)
            order[_starts(kept)[t[fits]] + place[fits]] = np.flatnonzero(fits)
            self.cache[w] = (k[order], t[order], valid[order])

    def used_by_others(self, rank: int) -> dict[str, np.ndarray]:
        """{input: the distinct keys (int64) the samples of the last batch NOT given to ``rank``
        use} for the inputs the allocator read (``fields``), from its tokens: the key lists the
        cache's on-demand plan reads (``Share(others=True)``), without a sort per input."""
        if self._users is None:
            return {}
        users, keys, which = self._users
        rest = np.delete(users, rank, axis=1).any(1)
        k, t = keys[rest], which[rest]
        order = np.argsort(t.astype(self._narrow), kind="stable")
        parts = np.split(k[order], np.cumsum(np.bincount(t, minlength=len(self.inputs)))[:-1])
        return {name: parts[self.inputs.index(name)] for name in self.fields}

    def cached(self, rank: int, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(keys, valid) of process ``rank``'s simulated cache of input ``name``, by key."""
        keys, t, valid = self.cache[rank]
        sel = t == self.inputs.index(name)
        k = np.asarray(self._keys_of(keys[sel], self.inputs.index(name)))
        order = np.argsort(k)
        return k[order], valid[sel][order]

    def evictions(self, rank: int) -> dict[str, np.ndarray]:
        """{input: the keys (int64) process ``rank``'s cache of it evicts after the last batch}
        for every input (empty where nothing goes, or the input is not simulated)."""
        tok, t = self.evicted[rank]
        return {name: np.sort(self._keys_of(tok[t == i], i)) for i, name in enumerate(self.inputs)}

    @staticmethod
    def _keys_of(tok: np.ndarray, t: int) -> np.ndarray:
        with np.errstate(over="ignore"):        # wraps, as _token_key does
            return (tok - np.uint64(t) * _GOLDEN).view(np.int64)


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each group of ``counts`` starts in their concatenation."""
    out = np.zeros(len(counts), np.int64)
    np.cumsum(counts[:-1], out=out[1:])
    return out


def _token_key(keys: np.ndarray, which: np.ndarray) -> np.ndarray:
    """One uint64 per (input, key): key + input * an odd constant, wrapping (a collision could
    only blur a score, never an update)."""
    return np.asarray(keys, np.int64).view(np.uint64) + np.asarray(which, np.uint64) * _GOLDEN


_BLOCK = 1 << 16          # ids grouped at once by LaiaAllocation._tokens


def _group(code: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dense ids of the equal values of ``code`` (uint64): (id of each element, 0..u-1 in the order
    of first appearance, int32; index of each id's first element). A hash table (pandas.factorize),
    linear in the length: several times faster than a sort. Exact, and a function of ``code`` alone,
    so the same on every process."""
    import pandas as pd
    if len(code) == 0:
        return np.zeros(0, np.int32), np.zeros(0, np.int64)
    ids, _ = pd.factorize(code, sort=False)
    new = np.empty(len(ids), bool)
    new[0] = True
    np.greater(ids[1:], np.maximum.accumulate(ids[:-1]), out=new[1:])   # a value seen for the first time
    return ids.astype(np.int32), np.flatnonzero(new)


def _assign(score: np.ndarray, room: np.ndarray) -> np.ndarray:
    """Samples [m] -> process, at most ``room[w]`` to process w, best score first: every sample
    asks for its best process with room; an over-asked process keeps its highest-scored askers
    and is full; the others ask again (at most N rounds, all in numpy). -1: no room left."""
    m, n = score.shape
    room = room.copy()
    owner = np.full(m, -1, np.int64)
    s = np.where(room[None, :] > 0, score, -np.inf)
    pending = np.arange(m)
    while len(pending) and np.isfinite(s[pending]).any():
        best = np.argmax(s[pending], 1)
        for w in np.unique(best):
            ask = pending[best == w]
            if not np.isfinite(s[ask[0], w]):
                continue
            take = ask if len(ask) <= room[w] else ask[np.argsort(-s[ask, w], kind="stable")[:room[w]]]
            owner[take] = w
            room[w] -= len(take)
            if room[w] == 0:
                s[:, w] = -np.inf
        pending = pending[owner[pending] < 0]
    return owner


def make(kind: str, world_size: int, keys: Sequence[str] = (), capacity: dict[str, int] | None = None,
         seed: int = 0, keeps_own_updates: bool = False, top_k: int | None = None) -> Allocator:
    """The allocator named ``kind`` (one of CHOICES). laia: ``capacity`` rows cached per input and
    process (the cache mode's; None: the PS, nothing cached), ``keeps_own_updates`` for plain SGD,
    ``top_k``: score only the k inputs with the most distinct ids of the first batch (None: all)."""
    if kind == "contiguous":
        return Allocator(world_size, keys)
    if kind == "random":
        return RandomAllocation(world_size, keys, seed)
    if kind == "laia":
        return LaiaAllocation(world_size, keys, capacity, keeps_own_updates=keeps_own_updates, top_k=top_k)
    raise ValueError(f"--allocate must be one of {', '.join(CHOICES)}, got {kind!r}")


OTHERS = "@others"   # feature suffix: the distinct keys of an input that OTHER processes' samples use
EVICT = "@evict"     # feature suffix: the keys laia's simulation evicts from this process's cache of an input


class Share:
    """This process's samples of every global batch, for ``tf.data``: ``ds.map(Share(alloc, rank).take)``.
    The allocator runs in the input pipeline (in order: a ``map`` without parallel calls).

    ``others=True`` also hands the train step, for every input the allocator reads, the distinct
    keys the other processes' samples of this batch use (feature ``<input>@others``): what the
    cache's on-demand plan needs to know which of its lines another process updates this step.
    ``evictions=True`` (laia over a cache) also hands it the keys the simulation evicts from this
    process's cache (feature ``<input>@evict``), which the cache then evicts (des.baselines.cache.rewrite)."""

    def __init__(self, allocator: Allocator, rank: int, others: bool = False, evictions: bool = False):
        if evictions and not isinstance(allocator, LaiaAllocation):
            raise ValueError("evictions=True: only laia simulates the caches")
        self.allocator, self.rank, self.others, self.evictions = allocator, rank, others, evictions

    def extras(self) -> list[str]:
        """The features ``take`` adds, in order."""
        names = self.allocator.inputs
        return [k + OTHERS for k in names if self.others] + [k + EVICT for k in names if self.evictions]

    def mine(self, feats: dict, batch: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(this process's row indices of the global batch, {input + OTHERS: the distinct keys the
        other processes' rows use} if ``others``, {input + EVICT: the keys its cache evicts after
        this batch} if ``evictions``)."""
        import pandas as pd
        parts = self.allocator({k: feats[k] for k in self.allocator.inputs}, int(batch))
        start, cpu, extra = time.perf_counter(), time.thread_time(), {}
        if self.others:
            rest = np.concatenate([p for r, p in enumerate(parts) if r != self.rank] + [np.zeros(0, np.int64)])
            known = self.allocator.used_by_others(self.rank)      # laia: from its tokens
            for name in self.allocator.inputs:
                if name in known:
                    extra[name + OTHERS] = known[name]
                    continue
                ids = pd.unique(np.asarray(feats[name], np.int64)[rest].reshape(-1))   # a hash table
                extra[name + OTHERS] = ids[ids != PAD_ID]
        if self.evictions:
            extra.update({k + EVICT: v for k, v in self.allocator.evictions(self.rank).items()})
        self.allocator.extra_seconds += time.perf_counter() - start
        self.allocator.extra_cpu_seconds += time.thread_time() - cpu
        return parts[self.rank], extra

    def _mine(self, batch, *cols):
        idx, extra = self.mine(dict(zip(self.allocator.inputs, cols)), int(batch))
        return (idx, *(extra[k] for k in self.extras()))

    def take(self, feats: dict, label):
        b = tf.shape(label, out_type=tf.int64)[0]
        names, extras = self.allocator.inputs, self.extras()
        out = tf.numpy_function(self._mine, [b] + [feats[k] for k in names], [tf.int64] * (1 + len(extras)),
                                stateful=True)
        idx = tf.ensure_shape(out[0], [None])
        mine = {k: tf.gather(v, idx) for k, v in feats.items()}
        mine.update({k: tf.ensure_shape(v, [None]) for k, v in zip(extras, out[1:])})
        return mine, tf.gather(label, idx)

"""Communicators: the one collectives interface of every mode, behind one protocol.

DES needs one collective, a SUM allreduce (``allreduce_sum``: identity gradient); its
data-parallel tail adds all-gather and reduce-scatter; the parameter server and the cache route
keys with all-to-all (des.baselines.ps.tables.KeyExchange, on a communicator). Backends:
the in-process simulated world and a world of one here; Horovod, mpi4py (allreduce and
broadcast) and the timing-only no-op ones in des_ops.mpi, whose ``default_communicator`` picks one.

    >>> comm = LocalCommunicator()               # des_ops.mpi.default_communicator() without a launcher
    >>> partials = tf.constant([[1.0, 2.0]])
    >>> with tf.GradientTape() as tape:
    ...     tape.watch(partials)
    ...     y = allreduce_sum(comm, partials)        # forward: sum over ranks; backward: identity
    >>> y.numpy(), tape.gradient(y, partials).numpy(), comm.counted()["step"]
    (array([[1., 2.]], dtype=float32), array([[1., 1.]], dtype=float32), {'bytes': 8, 'calls': 1})

Every collective has a NAME fixed by what it is, never by what a process owns or by the op that
feeds it: Horovod matches collectives across ranks by name, and an unnamed ``hvd.allreduce``
takes the name of the op feeding it, which differs on a process that owns no field of an
operator (it builds zeros, not a concat) -- the job then hangs. The in-process world checks
the names too: ranks that submit differently named collectives fail at once, naming them.
Under Horovod a stalled collective ends the job: ``HOROVOD_STALL_CHECK_TIME_SECONDS`` (default
here 20 s) and ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS`` (default here 60 s) unless set.

``allreduce_sum`` is the only differentiable collective in DES. Its gradient is the
identity: every rank computes the same loss on the same batch, so the upstream gradient
is already the same everywhere, and d(sum)/d(addend) = 1. (Horovod's registered gradient
of allreduce is another allreduce, which would multiply it by N.)
"""
from __future__ import annotations

import os
import re
import threading

import numpy as np
import tensorflow as tf

from des_ops.serial_tracing import TraceToken
from des_ops.wire import WIRE_DTYPES, ring_share   # WIRE_DTYPES: the partials' types; float32 is exact


class Communicator:
    """rank, world_size and a raw sum-allreduce of a float32 tensor (no gradient).

    Every collective is counted where it is called, by purpose: ``step`` (the DES allreduce of
    training and predict steps: ``payload_bytes``, ``calls``), ``tail`` (the data-parallel tail's
    all-gathers and its gradient allreduce, des_ops.tail), ``check`` (the replica check),
    ``barrier`` (checkpoint barriers) and ``broadcast`` (rank 0's weights and plan at transform).
    Bytes are those of the tensors handed over; what a process puts on the wire for them depends
    on MPI's algorithm (``ring_bytes`` is the ring model, an analytic figure).
    """
    name = "base"
    rank = 0
    world_size = 1
    broadcasts = True      # broadcast hands every rank the root's array (timing-only ones may not)
    PURPOSES = ("step", "tail", "check", "barrier", "broadcast")
    wire_dtypes = WIRE_DTYPES   # the types ``allreduce`` sums (des.transform's wire_dtype)
    # True when ``allreduce`` blocks a TensorFlow thread until every rank has called it (mpi4py,
    # the simulated world): a step's micro-batch allreduces are then issued one after another, in
    # the same order on every rank (MPI requires it; concurrent blocking calls could take every
    # thread of TensorFlow's pool). Horovod's allreduce is asynchronous and matched by name.
    blocking = False

    def __init__(self) -> None:
        self.bytes = {p: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"des_{p}_bytes")
                      for p in self.PURPOSES}
        self.ncalls = {p: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"des_{p}_calls")
                       for p in self.PURPOSES}
        self.payload_bytes, self.calls = self.bytes["step"], self.ncalls["step"]

    def count(self, purpose: str, nbytes) -> tf.Operation:
        """Add one collective call of ``nbytes`` handed over to the counters of ``purpose``.
        The call is counted once ``nbytes`` (computed from the input) exists: at the end of a
        dataset of unknown length Keras starts one more step whose input never comes, and a
        count with no data dependency would run in it."""
        nbytes = tf.cast(nbytes, tf.int64)
        with tf.control_dependencies([nbytes]):
            return tf.group(self.bytes[purpose].assign_add(nbytes), self.ncalls[purpose].assign_add(1))

    def allreduce_counted(self, x: tf.Tensor, purpose: str) -> tf.Tensor:
        """``allreduce`` of ``x`` (no gradient) named ``des_<purpose>``, counted under ``purpose``."""
        x = tf.convert_to_tensor(x)
        with tf.control_dependencies([self.count(purpose, nbytes(x))]):
            return self.allreduce(x, f"des_{purpose}")

    def counted(self) -> dict[str, dict[str, int]]:
        """Bytes handed over and calls so far, per purpose."""
        return {p: {"bytes": int(self.bytes[p].numpy()), "calls": int(self.ncalls[p].numpy())}
                for p in self.PURPOSES}

    def allreduce(self, x: tf.Tensor, name: str) -> tf.Tensor:  # pragma: no cover - interface
        """Sum of ``x`` over ranks; ``name`` identifies the collective and must be the same on
        every rank for the same call (see the module docstring)."""
        raise NotImplementedError

    def broadcast(self, a: np.ndarray, root: int = 0) -> np.ndarray:  # pragma: no cover - interface
        """Rank ``root``'s array on every rank (eager, outside training steps); same shape everywhere."""
        raise NotImplementedError

    def scatter(self, parts: list[np.ndarray] | None, row_shape: tuple, root: int = 0,
                name: str = "des_scatter") -> np.ndarray:
        """Rank ``root``'s ``parts[r]`` (float32 arrays of rows ``row_shape``; None elsewhere) on
        rank r (eager, outside training steps). Here: one broadcast of every part, each rank keeping
        its own; Horovod: one all-to-all in which only ``root`` sends, each rank receiving its part."""
        sizes = self.broadcast(np.array([len(p) for p in parts] if self.rank == root else [0] * self.world_size,
                                        np.int64), root)
        flat = self.broadcast(np.concatenate(parts).astype(np.float32) if self.rank == root else
                              np.zeros([int(sizes.sum()), *row_shape], np.float32), root)
        at = np.cumsum([0, *sizes])
        return flat[at[self.rank]:at[self.rank + 1]]

    def allgather(self, x: tf.Tensor, name: str) -> tf.Tensor:
        """Every rank's ``x`` (first dimensions may differ) concatenated in rank order (no gradient)."""
        raise NotImplementedError(f"{type(self).__name__} has no all-gather")

    def reducescatter(self, x: tf.Tensor, name: str) -> tf.Tensor:
        """Rows ``shard_rows(B, rank, world_size)`` of the sum of ``x`` over ranks (no gradient)."""
        raise NotImplementedError(f"{type(self).__name__} has no reduce-scatter")

    def alltoall(self, x: tf.Tensor, splits: tf.Tensor, name: str) -> tuple[tf.Tensor, tf.Tensor]:
        """Rows ``splits[d]`` of ``x`` (grouped by destination) go to rank d: returns (the rows
        from every source, in source order; rows per source). No gradient; the parameter server's
        key exchange (des.baselines.ps.tables.KeyExchange) builds its own on it."""
        raise NotImplementedError(f"{type(self).__name__} has no all-to-all")

    def ring_bytes(self, payload: float) -> float:
        """Bytes one process sends (and receives) for a ring allreduce of ``payload`` bytes."""
        n = self.world_size
        return ring_share(n) * payload

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"


class LocalCommunicator(Communicator):
    """World of one process: allreduce is the identity."""
    name = "local"

    def allreduce(self, x, name="des_allreduce"):
        return tf.identity(x)

    def allgather(self, x, name="des_allgather"):
        return tf.identity(x)

    def reducescatter(self, x, name="des_reducescatter"):
        return tf.identity(x)

    def alltoall(self, x, splits, name="des_alltoall"):
        return tf.identity(x), splits

    def broadcast(self, a, root=0):
        return a


def op_name(text: str) -> str:
    """``text`` as a TensorFlow op name (Horovod's collective name): other characters -> '_'."""
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", text).lstrip("_./-") or "des_collective"


STALL_DEFAULTS = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "20", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


class InProcessWorld:
    """N simulated ranks in one process (one thread each) for fast, wide tests.

    >>> world = InProcessWorld(4); comms = [world.communicator(r) for r in range(4)]
    >>> comms[3]
    InProcessCommunicator(rank=3, world_size=4)
    """

    def __init__(self, world_size: int, timeout: float = 300.0):
        _enough_inter_op_threads(world_size)
        self.world_size = world_size
        self._timeout = timeout
        self._published: dict = {}
        self._broadcasts = [0] * world_size
        self._cond = threading.Condition()
        self._sequence: list[dict] = [{} for _ in range(world_size)]
        self._meetings: dict = {}
        self._aborted = False
        self.tracing = TraceToken(timeout)   # one rank traces at a time (des_ops.serial_tracing)

    def communicator(self, rank: int) -> "InProcessCommunicator":
        return InProcessCommunicator(self, rank)

    def allreduce(self, rank: int, a: np.ndarray, name: str = "des_allreduce") -> np.ndarray:
        """Sum over ranks of their n-th allreduce; all must name it alike (Horovod matches by
        name): otherwise every rank raises, naming the ranks and their names."""
        def total(values, r):
            names = [nm for nm, _ in values]
            if len(set(names)) > 1:
                by = {}
                for i, nm in enumerate(names):
                    by.setdefault(nm, []).append(i)
                raise RuntimeError("collective mismatch: " + "; ".join(
                    f"rank(s) {', '.join(map(str, rs))} submitted {nm!r}" for nm, rs in by.items()))
            return _sum([v for _, v in values])
        return self.rendezvous(rank, "allreduce", (name, a), total)

    def rendezvous(self, rank: int, tag: str, value, combine):
        """Meet the other ranks at their call of the same ``tag`` (the n-th call of a tag meets the
        others' n-th, in whatever order the ranks' graphs run their collectives) and return
        ``combine(values of every rank, rank)``."""
        with self.tracing.released(rank):
            return self._meet(rank, tag, value, combine)

    def _meet(self, rank: int, tag: str, value, combine):
        n = self.world_size
        with self._cond:
            seq = self._sequence[rank].get(tag, 0)
            self._sequence[rank][tag] = seq + 1
            slot = self._meetings.setdefault((tag, seq), {"values": [None] * n, "arrived": 0, "left": 0})
            slot["values"][rank] = value
            slot["arrived"] += 1
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: slot["arrived"] == n or self._aborted, timeout=self._timeout):
                raise TimeoutError(f"rank {rank}: collective {tag!r} #{seq}: only {slot['arrived']} of {n} ranks came")
            if self._aborted:
                raise RuntimeError(f"rank {rank}: another simulated rank failed")
            out = combine(slot["values"], rank)
            slot["left"] += 1
            if slot["left"] == n:
                del self._meetings[(tag, seq)]
            return out

    def alltoall(self, rank: int, tag: str, x: np.ndarray, splits: np.ndarray):
        """Rows ``splits[d]`` of ``x`` (grouped by destination) go to rank d: returns (rows from
        every source, in source order; rows per source)."""
        def combine(values, r):
            parts, came = [], []
            for xs, sp in values:
                lo = int(np.sum(sp[:r]))
                parts.append(xs[lo:lo + int(sp[r])])
                came.append(int(sp[r]))
            return np.concatenate(parts, 0), np.asarray(came, splits.dtype)
        return self.rendezvous(rank, tag, (x, np.asarray(splits)), combine)

    def abort(self) -> None:
        """Wake every waiting rank with an error (a rank failed)."""
        with self._cond:
            self._aborted = True
            self._cond.notify_all()
        self.tracing.abort()

    def broadcast(self, rank: int, a: np.ndarray, root: int) -> np.ndarray:
        """The root publishes without waiting (so ranks may transform one after another in one
        thread); the others wait for the root's n-th broadcast."""
        with self.tracing.released(rank), self._cond:
            n = self._broadcasts[rank]
            self._broadcasts[rank] += 1
            if rank == root:
                self._published[n] = np.array(a, copy=True)
                self._cond.notify_all()
                return a
            if not self._cond.wait_for(lambda: n in self._published, timeout=self._timeout):
                raise TimeoutError(f"rank {rank}: no broadcast {n} from rank {root}")
            return self._published[n].copy()


SIMULATED_WORLD_THREADS = 64    # TF inter-op threads the simulated world asks for (tests/conftest.py sets it)


def _enough_inter_op_threads(world_size: int) -> None:
    """Every simulated rank blocks a TF inter-op thread inside each collective it waits in; with
    the default pool (one thread a core) the ranks that wait can hold every thread while the one
    they wait for has none left to run on, and the world stalls until its timeout. Ask for
    SIMULATED_WORLD_THREADS while TF can still take it; once TF has started with fewer, say so
    now rather than time out later."""
    need = max(SIMULATED_WORLD_THREADS, 8 * world_size)
    have = tf.config.threading.get_inter_op_parallelism_threads() or (os.cpu_count() or 1)
    if have >= need:
        return
    try:
        tf.config.threading.set_inter_op_parallelism_threads(need)
    except RuntimeError:
        raise RuntimeError(
            f"the simulated world of {world_size} ranks needs {need} TensorFlow inter-op threads, and TF "
            f"started with {have}: call tf.config.threading.set_inter_op_parallelism_threads({need}) "
            f"before TensorFlow runs anything (each simulated rank blocks a thread in its collectives)") from None


class InProcessCommunicator(Communicator):
    name = "in-process"
    blocking = True

    def __init__(self, world: InProcessWorld, rank: int):
        self.world, self.rank, self.world_size = world, rank, world.world_size
        super().__init__()

    def allreduce(self, x, name="des_allreduce"):
        y = tf.numpy_function(lambda a: self.world.allreduce(self.rank, a, name), [x], x.dtype, stateful=True)
        return tf.ensure_shape(y, x.shape)

    def allgather(self, x, name="des_allgather"):
        y = tf.numpy_function(lambda a: self.world.rendezvous(self.rank, name, a, _concatenate), [x], x.dtype,
                              stateful=True)
        return tf.ensure_shape(y, [None, *x.shape[1:]])

    def reducescatter(self, x, name="des_reducescatter"):
        def rows_of_sum(values, r):
            lo, hi = shard_rows(len(values[0]), r, len(values))
            return _sum(values)[lo:hi]
        y = tf.numpy_function(lambda a: self.world.rendezvous(self.rank, name, a, rows_of_sum), [x], x.dtype,
                              stateful=True)
        return tf.ensure_shape(y, [None, *x.shape[1:]])

    def alltoall(self, x, splits, name="des_alltoall"):
        """Ranks meet by ``name`` (the n-th call of a name meets the others' n-th), not by order:
        a step's all-to-alls of several tables may run in any order on each rank."""
        x = tf.convert_to_tensor(x)
        got, came = tf.numpy_function(lambda a, s: self.world.alltoall(self.rank, name, a, s),
                                      [x, splits], [x.dtype, splits.dtype], stateful=True)
        return tf.ensure_shape(got, [None, *x.shape[1:]]), tf.ensure_shape(came, [self.world_size])

    def broadcast(self, a, root=0):
        self.count("broadcast", np.asarray(a).nbytes)
        return self.world.broadcast(self.rank, a, root)


def _concatenate(values, rank):
    return np.concatenate(values, 0)


def _sum(values):
    """The sum of the ranks' arrays, added in rank order (the same bits on every rank)."""
    out = values[0].copy()
    for v in values[1:]:
        out += v
    return out


def shard_rows(batch, rank: int, world_size: int):
    """Rows [lo, hi) of a batch of ``batch`` rows that ``rank`` holds when a batch is split over
    ``world_size`` processes: B // N rows each, one more for the first B % N ranks (Horovod's
    reducescatter split). ``batch`` may be a tensor.

    >>> [shard_rows(7, r, 3) for r in range(3)], shard_rows(2, 2, 3)
    ([(0, 3), (3, 5), (5, 7)], (2, 2))
    """
    base, extra = batch // world_size, batch % world_size
    if isinstance(batch, tf.Tensor):
        lo = rank * base + tf.minimum(tf.cast(rank, batch.dtype), extra)
        return lo, lo + base + tf.cast(rank < extra, batch.dtype)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + int(rank < extra)


def allreduce_sum(comm: Communicator, x: tf.Tensor, name: str = "des_partials",
                  wire_dtype: str | None = None) -> tf.Tensor:
    """Sum of x over all ranks, with an identity gradient; counts the bytes handed over ("step").
    ``name`` is the collective's identity on every rank (see the module docstring). ``wire_dtype``
    (default: x's type, e.g. "float16"): x is handed over and summed in that type and cast back;
    the gradient stays the identity in x's type, and the count is of what is handed over."""
    wire = x.dtype if wire_dtype is None else tf.as_dtype(wire_dtype)
    count = comm.count("step", tf.cast(tf.size(x), tf.int64) * wire.size)

    @tf.custom_gradient
    def _allreduce(v):
        with tf.control_dependencies([count]):
            if wire == v.dtype:
                y = comm.allreduce(not_folded(comm, v), name)
            else:
                y = tf.cast(comm.allreduce(not_folded(comm, tf.cast(v, wire)), name), v.dtype)

        def grad(dy):
            return tf.identity(dy)
        return y, grad

    return _allreduce(x)


def nbytes(x: tf.Tensor) -> tf.Tensor:
    """Bytes of ``x`` (an int64 scalar tensor): what a collective is handed, for the counters."""
    return tf.cast(tf.size(x), tf.int64) * x.dtype.size


def variable_zero(comm: Communicator, dtype=tf.float32) -> tf.Tensor:
    """0, read from one of ``comm``'s counters: a zero that grappler cannot fold as a constant."""
    return tf.cast(tf.minimum(comm.ncalls["step"].read_value(), 0), dtype)


def not_folded(comm: Communicator, x: tf.Tensor) -> tf.Tensor:
    """``x`` + ``variable_zero``, the input every collective is handed: on a process that owns
    nothing the partials are constant zeros, and grappler would fold Horovod's (stateless)
    collective of constants into its input; that process would then skip the collective while
    the others wait."""
    return x + variable_zero(comm, x.dtype)


class DisagreementError(RuntimeError):
    """Processes of one job disagree on something every process must share (plan, collectives)."""


def agree(comm: Communicator, what: str, text: str) -> None:
    """Raise DisagreementError on every rank whose ``text`` differs from rank 0's, naming this
    rank, rank 0 and both values: a check made before the first collective of a step, so that
    a disagreement ends the job at once instead of hanging it (under mpirun, a rank that raises
    ends the job). Two broadcasts (length, then rank 0's bytes); nothing to compare on a
    timing communicator that never meets the others (``--comm noop``)."""
    if comm.world_size == 1 or not comm.broadcasts:
        return
    mine = np.frombuffer(text.encode(), np.uint8)
    size = int(comm.broadcast(np.array([mine.size], np.int64), 0)[0])
    root = comm.broadcast(mine if comm.rank == 0 else np.zeros(size, np.uint8), 0)
    if comm.rank != 0 and not np.array_equal(root, mine):
        raise DisagreementError(f"rank {comm.rank} of {comm.world_size} disagrees with rank 0 on the {what}: "
                                f"rank 0 has {bytes(root).decode()!r}, rank {comm.rank} has {text!r}")


def under_launcher() -> bool:
    """True when started by mpirun / horovodrun with more than one process."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "HOROVOD_SIZE", "PMIX_SIZE"):
        if int(os.environ.get(var, "1")) > 1:
            return True
    return False


def launcher_rank() -> tuple[int, int]:
    """(rank, world size) that mpirun / horovodrun gave this process (0, 1 without a launcher)."""
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                       ("HOROVOD_RANK", "HOROVOD_SIZE")):
        if size in os.environ:
            return int(os.environ.get(rank, "0")), int(os.environ[size])
    return 0, 1

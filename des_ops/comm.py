"""Communicators: the one collectives interface of every mode, behind one protocol.

DES needs one collective, a SUM allreduce (``allreduce_sum``: identity gradient); its
data-parallel tail adds all-gather and reduce-scatter; the parameter server and the cache route
keys with all-to-all (des.baselines.ps.tables.KeyExchange, on a communicator). Backends:
Horovod, mpi4py (allreduce and broadcast), the in-process simulated world, a world of one, and
the timing-only no-op ones (``NoopCommunicator``).

    >>> comm = default_communicator()            # Horovod under mpirun/horovodrun, else size 1
    >>> comm
    LocalCommunicator(rank=0, world_size=1)
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
import time
import weakref
import zlib

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


class NoopCommunicator(Communicator):
    """This process's rank and world size from the launcher, but no collective of a step moves a
    payload: allreduce and all-to-all return their input. For timing a step's computation
    alone (des.cluster.timemodel); the results are not the model's (nothing is summed or exchanged).
    ``broadcast`` (eager, at transform: rank 0's weights, the plan agreement of ``agree``) is a
    real one when the communicator meets the others at all, and returns the input with
    ``meet="never"`` (``broadcasts`` is then False and ``agree`` has nothing to compare).

    ``meet`` says which calls still meet the other processes with a real Horovod call, so that a
    step waits for the slowest process as in training:

    - ``"never"`` (``--comm noop``);
    - ``"scalars"``: one-element allreduces are real sums (the PS's 4-byte slice sizes:
      ``--mode ps --comm sync``);
    - ``"every"``: those, and every other call meets without its payload (an allreduce of one
      float, an all-to-all of no rows): ``--comm meet``, and DES's ``--comm sync``
      (``SyncCommunicator``).

    >>> NoopCommunicator(meet="every").alltoall(tf.ones([3, 1]), tf.constant([3]), "ids")[1].numpy()  # alone
    array([3], dtype=int32)
    >>> NoopCommunicator(meet="sometimes")
    Traceback (most recent call last):
    ValueError: meet='sometimes': one of never, scalars, every
    """
    name = "noop"
    MEETS = ("never", "scalars", "every")
    meet = "never"

    def __init__(self, rank: int | None = None, world_size: int | None = None, meet: str | None = None) -> None:
        start_horovod_thread()
        env_rank, env_size = launcher_rank()
        self.rank = env_rank if rank is None else rank
        self.world_size = env_size if world_size is None else world_size
        if meet is not None:
            if meet not in self.MEETS:
                raise ValueError(f"meet={meet!r}: one of {', '.join(self.MEETS)}")
            self.meet = meet
        super().__init__()

    def _meets(self, x: tf.Tensor) -> bool:
        return self.world_size > 1 and (self.meet == "every" or
                                        (self.meet == "scalars" and x.shape.num_elements() == 1))

    def allreduce(self, x, name="des_allreduce"):
        if not self._meets(x):
            return tf.identity(x)
        if x.shape.num_elements() == 1:
            import horovod.tensorflow as hvd
            return hvd.allreduce(x, op=hvd.Sum, name=op_name(name))
        # x times exactly 1 computed from the meeting: a data dependency that grappler cannot fold
        # (a control dependency on the allreduce, or x + 0 * it, were optimised away: no wait)
        return x * (1.0 + tf.minimum(tf.abs(tf.reduce_sum(sync_processes(x, name))), 0.0))

    def allgather(self, x, name="des_allgather"):
        # timing only: N copies of this process's rows, the size of the gathered batch
        return self.allreduce(tf.concat([x] * self.world_size, 0), name)

    def reducescatter(self, x, name="des_reducescatter"):
        lo, hi = shard_rows(tf.shape(x)[0], self.rank, self.world_size)
        return self.allreduce(x, name)[lo:hi]

    def alltoall(self, x, splits, name="des_alltoall"):
        x = tf.convert_to_tensor(x)                      # a gradient may come as IndexedSlices
        if self.meet != "every" or self.world_size == 1:
            return tf.identity(x), tf.identity(splits)
        import horovod.tensorflow as hvd
        _, came = hvd.alltoall(x[:0], splits=tf.zeros_like(splits), name=op_name(name))  # no rows; splits meet
        return tf.identity(x), splits + came             # + zeros: a data dependency on the meeting

    @property
    def broadcasts(self) -> bool:
        return self.meet != "never" and self.world_size > 1

    def broadcast(self, a, root=0):
        return horovod_broadcast(self, a, root) if self.broadcasts else a


class SyncCommunicator(NoopCommunicator):
    """A no-op communicator whose every call waits for every process (one float, Horovod)."""
    name = "sync"
    meet = "every"


def sync_processes(x: tf.Tensor, name: str = "des_sync") -> tf.Tensor:
    """A Horovod allreduce of ``x``'s first element: returns when every process has reached it.
    (Of ``x``, not of a constant: grappler would fold an allreduce of constants at trace time.)"""
    import horovod.tensorflow as hvd
    return hvd.allreduce(tf.reshape(x, [-1])[:1], op=hvd.Sum, name=op_name(name + "_sync"))


def horovod_broadcast(comm: Communicator, a: np.ndarray, root: int) -> np.ndarray:
    """Rank ``root``'s array on every rank by one Horovod broadcast, named by ``comm``'s count of
    broadcasts (the same on every rank, as Horovod matches collectives by name)."""
    import horovod.tensorflow as hvd
    comm._broadcasts = getattr(comm, "_broadcasts", 0) + 1
    return hvd.broadcast(tf.constant(a), root_rank=root, name=f"des_broadcast_{comm._broadcasts}").numpy()


def op_name(text: str) -> str:
    """``text`` as a TensorFlow op name (Horovod's collective name): other characters -> '_'."""
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", text).lstrip("_./-") or "des_collective"


STALL_DEFAULTS = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "20", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "60"}


def init_horovod():
    """``hvd.init()`` with DES's stall settings unless the user set them: a collective that some
    rank never submits is reported after 20 s (naming the missing ranks and the collective) and
    ends the job after 60 s, instead of a silent hang. Returns horovod.tensorflow."""
    for k, v in STALL_DEFAULTS.items():
        os.environ.setdefault(k, v)
    import horovod.tensorflow as hvd
    hvd.init()
    return hvd


class HorovodCommunicator(Communicator):
    """Horovod (MPI) allreduce; the default under mpirun / horovodrun."""
    name = "horovod"

    def __init__(self) -> None:
        self.rank, self.world_size = launcher_rank()
        self._started = None
        super().__init__()

    def start(self):
        """horovod.tensorflow, started (``init_horovod``) at this communicator's first collective,
        not at its creation: Horovod's background thread polls every cycle from then on, and
        before the first collective it would take the CPU that building and transforming the
        model needs (both processes of a 2-core machine build at once)."""
        if self._started is None:
            hvd = init_horovod()
            if (hvd.rank(), hvd.size()) != (self.rank, self.world_size):
                raise RuntimeError(f"Horovod's rank {hvd.rank()} of {hvd.size()} is not the launcher's "
                                   f"{self.rank} of {self.world_size}")
            self._started = hvd
        return self._started

    def one_machine(self) -> bool:
        """Whether every process runs on this machine (Horovod's local size is the world's): the
        same answer on every process, as MPI groups them by node."""
        hvd = self.start()
        return hvd.local_size() == hvd.size()

    def allreduce(self, x, name="des_allreduce"):
        hvd = self.start()
        return hvd.allreduce(x, op=hvd.Sum, name=op_name(name))

    def allgather(self, x, name="des_allgather"):
        return self.start().allgather(x, name=op_name(name))

    def reducescatter(self, x, name="des_reducescatter"):
        # Horovod splits dim 0 as shard_rows does (the first B % N ranks one row more); checked
        hvd = self.start()
        y = hvd.reducescatter(x, op=hvd.Sum, name=op_name(name))
        lo, hi = shard_rows(tf.shape(x)[0], self.rank, self.world_size)
        with tf.control_dependencies([tf.debugging.assert_equal(tf.shape(y)[0], hi - lo, message=(
                f"rank {self.rank}: Horovod's reducescatter split the batch unlike des_ops.comm.shard_rows"))]):
            return tf.identity(y)

    def alltoall(self, x, splits, name="des_alltoall"):
        return self.start().alltoall(x, splits=splits, name=op_name(name))

    def scatter(self, parts, row_shape, root=0, name="des_scatter"):
        mine = self.rank == root
        send = np.concatenate(parts).astype(np.float32) if mine else np.zeros([0, *row_shape], np.float32)
        splits = [len(p) for p in parts] if mine else [0] * self.world_size
        self.count("broadcast", send.nbytes)
        got, _ = self.alltoall(tf.constant(send), tf.constant(splits, tf.int32), name)
        return got.numpy()

    def broadcast(self, a, root=0):
        self.count("broadcast", np.asarray(a).nbytes)
        self.start()
        return horovod_broadcast(self, a, root)


def sleeping_wait(request, first: float = 2e-5, longest: float = 5e-4, timeout: float | None = None,
                  what: str = "a collective") -> None:
    """Wait for an MPI request, testing it with sleeps between (``first`` s, doubling up to
    ``longest``). Open MPI's own Wait polls a whole core until the bytes have come (yielding does
    not help under a CPU quota: the poll spends it). 4 emulated hosts at 100 Mbit/s, a 1.1 MB
    allreduce: 65 ms of CPU a call polled, 12 ms slept, the same 150 ms of wall time
    (reports/peer_wide_netbed_100mbit_sleeping.md has the training runs). After ``timeout`` s
    it raises instead of waiting on: some rank never came (as Horovod's stall shutdown)."""
    pause, since = first, time.monotonic()
    while not request.Test():
        if timeout is not None and time.monotonic() - since > timeout:
            raise TimeoutError(f"{what}: waited {timeout:.0f} s; a rank that did not print this line never "
                               f"reached it (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS sets the wait)")
        time.sleep(pause)
        pause = min(2 * pause, longest)


class SleepingMpi:
    """Allreduce and broadcast by mpi4py on a duplicate of COMM_WORLD, waited for sleeping
    (``sleeping_wait``); each allreduce checks that every rank called the same one (``sum``).
    A step's allreduces run in tf.numpy_function and block a TensorFlow thread, so they are
    chained in the order they were traced, the same on every rank (two scoped DES layers of one
    step issued in another order on two ranks would wait for each other)."""

    def __init__(self) -> None:
        from mpi4py import MPI
        self.mpi, self.comm = MPI, MPI.COMM_WORLD.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = float(os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", STALL_DEFAULTS[
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"]))
        self._last_in = weakref.WeakKeyDictionary()       # graph -> its last allreduce

    def sum(self, a: np.ndarray, name: str = "des_allreduce") -> np.ndarray:
        """``a`` summed over ranks. MPI matches collectives by order, not by name; so ``size``
        numbers ride along, rank r's mark of ``name`` in place r, and a rank that met another
        collective (another name) ends the job naming the ranks."""
        a = np.asarray(a)
        mark = zlib.crc32(name.encode()) % (1 << 23) + 1          # exact in float32
        send = np.zeros(a.size + self.size, a.dtype)
        send[:a.size], send[a.size + self.rank] = a.reshape(-1), mark
        out = np.empty_like(send)
        sleeping_wait(self.comm.Iallreduce(send, out, op=self.mpi.SUM), timeout=self.timeout,
                      what=f"rank {self.rank} of {self.size}, allreduce {name!r}")
        others = [r for r, m in enumerate(out[a.size:]) if m != mark]
        if others:
            raise DisagreementError(f"rank {self.rank} of {self.size}: allreduce {name!r} met another collective "
                                    f"on rank(s) {', '.join(map(str, others))} (MPI matches collectives by order)")
        return out[:a.size].reshape(a.shape)

    def allreduce(self, x: tf.Tensor, name: str) -> tf.Tensor:
        if tf.executing_eagerly():
            return tf.constant(self.sum(x.numpy(), name))
        graph = tf.compat.v1.get_default_graph()
        last = self._last_in.get(graph)
        if last is not None:
            with tf.control_dependencies([last]):
                x = tf.identity(x)
        y = tf.ensure_shape(tf.numpy_function(lambda a: self.sum(a, name), [x], x.dtype, stateful=True), x.shape)
        self._last_in[graph] = y
        return y

    def broadcast(self, a: np.ndarray, root: int) -> np.ndarray:
        buf = np.ascontiguousarray(a).copy()
        sleeping_wait(self.comm.Ibcast(buf, root=root), timeout=self.timeout,
                      what=f"rank {self.rank} of {self.size}, broadcast from rank {root}")
        return buf


class Mpi4pyCommunicator(Communicator):
    """DES's allreduce and broadcast by mpi4py, waited for sleeping (``SleepingMpi``); no Horovod,
    no background thread. Allreduce and broadcast only: DES's replicated tail."""
    name = "mpi4py"
    wire_dtypes = ("float32",)      # Open MPI 4.1 fails a numpy float16 Allreduce (MPI_ERR_TYPE)
    blocking = True

    def __init__(self) -> None:
        self._mpi = SleepingMpi()
        self.rank, self.world_size = self._mpi.rank, self._mpi.size
        super().__init__()

    def allreduce(self, x, name="des_allreduce"):
        return self._mpi.allreduce(x, name)

    def broadcast(self, a, root=0):
        self.count("broadcast", np.asarray(a).nbytes)
        return self._mpi.broadcast(a, root)


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


def start_horovod_thread() -> None:
    """Under mpirun, start Horovod (its background thread polls every cycle and takes CPU from the
    step, as in a real run) without calling any collective; alone, nothing."""
    if under_launcher() and "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        init_horovod()


def launcher_rank() -> tuple[int, int]:
    """(rank, world size) that mpirun / horovodrun gave this process (0, 1 without a launcher)."""
    for rank, size in (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE"),
                       ("HOROVOD_RANK", "HOROVOD_SIZE")):
        if size in os.environ:
            return int(os.environ.get(rank, "0")), int(os.environ[size])
    return 0, 1


def default_communicator(kind: str = "auto") -> Communicator:
    """``auto``: Horovod when launched with several processes, else a world of one; ``noop``:
    the launcher's rank and size without collectives (timing only); ``sync``: the same, with
    the processes kept in step by one tiny allreduce per call (timing only); ``meet``: DES's
    only collective is its allreduce, so the same as ``sync``."""
    if kind == "auto":
        kind = "horovod" if under_launcher() else "local"
    return {"horovod": HorovodCommunicator, "mpi4py": Mpi4pyCommunicator,
            "local": LocalCommunicator, "noop": NoopCommunicator, "sync": SyncCommunicator,
            "meet": SyncCommunicator}[kind]()

"""The communicators of a real launch (mpirun / horovodrun): Horovod's, the sleeping mpi4py
one, the settling one that picks either for a step, the timing-only ones, and
``default_communicator``, which picks one. The interface, the
in-process simulated world and the identity-gradient allreduce are des_ops.comm's.

    >>> default_communicator()                   # under mpirun/horovodrun SettlingCommunicator, else a world of one
    LocalCommunicator(rank=0, world_size=1)
    >>> sorted(KINDS)
    ['horovod', 'local', 'meet', 'mpi4py', 'noop', 'settling', 'sync']
"""
from __future__ import annotations

import os
import time
import weakref
import zlib

import numpy as np
import tensorflow as tf

from des_ops.comm import (STALL_DEFAULTS, Communicator, DisagreementError, LocalCommunicator, launcher_rank,
                          op_name, shard_rows, under_launcher)
from des_ops.wire import WIRE_DTYPES


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
    """DES's collectives by mpi4py on a duplicate of COMM_WORLD, each waited for sleeping
    (``sleeping_wait``) and checked: MPI matches collectives by order, not by name, so every call
    carries each rank's mark of its name, and a rank that met another collective (another name)
    ends the job naming the ranks. A step's collectives run in tf.numpy_function and block a
    TensorFlow thread, so they are chained in the order they were traced, the same on every rank
    (two scoped DES layers of one step issued in another order on two ranks would wait for each
    other). All-gather and all-to-all move bytes (any dtype); a sum takes float32/64 or int32/64."""
    SUMMED = (np.float32, np.float64, np.int32, np.int64)     # marks (< 2**23 + 2) are exact in each

    def __init__(self) -> None:
        from mpi4py import MPI
        self.mpi, self.comm = MPI, MPI.COMM_WORLD.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.timeout = float(os.environ.get("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", STALL_DEFAULTS[
            "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"]))
        self._last_in = weakref.WeakKeyDictionary()       # graph -> its last collective

    @staticmethod
    def mark(name: str) -> int:
        return zlib.crc32(name.encode()) % (1 << 23) + 1

    def _wait(self, request, what: str) -> None:
        sleeping_wait(request, timeout=self.timeout, what=f"rank {self.rank} of {self.size}, {what}")

    def _check(self, marks, mark: int, what: str) -> None:
        others = [r for r, m in enumerate(np.asarray(marks).tolist()) if m != mark]
        if others:
            raise DisagreementError(f"rank {self.rank} of {self.size}: {what} met another collective "
                                    f"on rank(s) {', '.join(map(str, others))} (MPI matches collectives by order)")

    def _summable(self, a: np.ndarray, what: str) -> np.ndarray:
        if a.dtype.type not in self.SUMMED:
            raise TypeError(f"{what}: mpi4py sums {', '.join(t.__name__ for t in self.SUMMED)}, not {a.dtype}")
        return a

    def sum(self, a: np.ndarray, name: str = "des_allreduce") -> np.ndarray:
        """``a`` summed over ranks; ``size`` numbers ride along, rank r's mark in place r."""
        what, mark = f"allreduce {name!r}", self.mark(name)
        a = self._summable(np.asarray(a), what)
        send = np.zeros(a.size + self.size, a.dtype)
        send[:a.size], send[a.size + self.rank] = a.reshape(-1), mark
        out = np.empty_like(send)
        self._wait(self.comm.Iallreduce(send, out, op=self.mpi.SUM), what)
        self._check(out[a.size:], mark, what)
        return out[:a.size].reshape(a.shape)

    def sum_shards(self, a: np.ndarray, name: str) -> np.ndarray:
        """Rows ``shard_rows(len(a), rank, size)`` of ``a`` summed over ranks (reduce-scatter);
        each rank's block carries ``size`` numbers more, rank r's mark in place r."""
        what, mark, n = f"reduce-scatter {name!r}", self.mark(name), self.size
        a = self._summable(np.ascontiguousarray(a), what)
        bounds = [shard_rows(len(a), r, n) for r in range(n)]
        marks = np.zeros(n, a.dtype)
        marks[self.rank] = mark
        send = np.concatenate([part for lo, hi in bounds for part in (a[lo:hi].reshape(-1), marks)])
        row = int(np.prod(a.shape[1:], dtype=np.int64))
        counts = [(hi - lo) * row + n for lo, hi in bounds]
        lo, hi = bounds[self.rank]
        out = np.empty(counts[self.rank], a.dtype)
        self._wait(self.comm.Ireduce_scatter(send, out, recvcounts=counts, op=self.mpi.SUM), what)
        self._check(out[-n:], mark, what)
        return out[:-n].reshape([hi - lo, *a.shape[1:]])

    def gather(self, a: np.ndarray, name: str) -> np.ndarray:
        """Every rank's ``a`` (its first dimension may differ) concatenated in rank order: one
        small all-gather of (rows, mark) pairs, then the bytes."""
        what, mark = f"all-gather {name!r}", self.mark(name)
        a = np.ascontiguousarray(a)
        head = np.empty(2 * self.size, np.int64)
        self._wait(self.comm.Iallgather(np.array([len(a), mark], np.int64), head), what)
        self._check(head[1::2], mark, what)
        rows = head[0::2]
        out = np.empty([int(rows.sum()), *a.shape[1:]], a.dtype)
        row_bytes = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
        self._wait(self.comm.Iallgatherv(a.reshape(-1).view(np.uint8),
                                         [out.reshape(-1).view(np.uint8), (rows * row_bytes).tolist()]), what)
        return out

    def exchange(self, a: np.ndarray, splits: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
        """All-to-all: rows ``splits[d]`` of ``a`` (grouped by destination) to rank d; (the rows from
        every source in source order, rows per source). A small all-to-all of (rows, mark) pairs
        first, then the bytes."""
        what, mark = f"all-to-all {name!r}", self.mark(name)
        a, splits = np.ascontiguousarray(a), np.asarray(splits, np.int64).reshape(-1)
        head = np.empty(2 * self.size, np.int64)
        self._wait(self.comm.Ialltoall(np.stack([splits, np.full_like(splits, mark)], 1).reshape(-1), head), what)
        self._check(head[1::2], mark, what)
        got = head[0::2]
        out = np.empty([int(got.sum()), *a.shape[1:]], a.dtype)
        row_bytes = a.dtype.itemsize * int(np.prod(a.shape[1:], dtype=np.int64))
        self._wait(self.comm.Ialltoallv([a.reshape(-1).view(np.uint8), (splits * row_bytes).tolist()],
                                        [out.reshape(-1).view(np.uint8), (got * row_bytes).tolist()]), what)
        return out, got.astype(np.int32)

    def run(self, fn, inputs: list[tf.Tensor], dtypes: list) -> list[tf.Tensor]:
        """``fn`` (numpy in, numpy out) on ``inputs``: at once when eager; in a graph, as a
        tf.numpy_function that waits for the collective traced before it in this graph."""
        if tf.executing_eagerly():
            out = fn(*[np.asarray(x) for x in inputs])
            return [tf.constant(o) for o in (out if isinstance(out, tuple) else (out,))]
        graph = tf.compat.v1.get_default_graph()
        last = self._last_in.get(graph)
        if last is not None:
            with tf.control_dependencies([last]):
                inputs = [tf.identity(inputs[0]), *inputs[1:]]
        out = tf.numpy_function(fn, inputs, dtypes, stateful=True)
        out = list(out) if isinstance(out, (list, tuple)) else [out]
        self._last_in[graph] = out[0]
        return out

    def allreduce(self, x: tf.Tensor, name: str) -> tf.Tensor:
        return tf.ensure_shape(self.run(lambda a: self.sum(a, name), [x], [x.dtype])[0], x.shape)

    def reducescatter(self, x: tf.Tensor, name: str) -> tf.Tensor:
        y = self.run(lambda a: self.sum_shards(a, name), [x], [x.dtype])[0]
        return tf.ensure_shape(y, [None, *x.shape[1:]])

    def allgather(self, x: tf.Tensor, name: str) -> tf.Tensor:
        return tf.ensure_shape(self.run(lambda a: self.gather(a, name), [x], [x.dtype])[0], [None, *x.shape[1:]])

    def alltoall(self, x: tf.Tensor, splits: tf.Tensor, name: str) -> tuple[tf.Tensor, tf.Tensor]:
        rows, got = self.run(lambda a, s: self.exchange(a, s, name), [x, splits], [x.dtype, tf.int32])
        return tf.ensure_shape(rows, [None, *x.shape[1:]]), tf.ensure_shape(got, [self.size])

    def broadcast(self, a: np.ndarray, root: int) -> np.ndarray:
        buf = np.ascontiguousarray(a).copy()
        self._wait(self.comm.Ibcast(buf, root=root), f"broadcast from rank {root}")
        return buf

    def one_machine(self) -> bool:
        """Whether every rank runs on this machine (one shared-memory group): the same everywhere."""
        return self.comm.Split_type(self.mpi.COMM_TYPE_SHARED).Get_size() == self.size


class Mpi4pyCommunicator(Communicator):
    """DES's collectives by mpi4py, waited for sleeping (``SleepingMpi``); no Horovod, no
    background thread: allreduce and broadcast (the replicated tail), reduce-scatter and
    all-gather (the data-parallel tail), all-to-all (rows to their samples' processes)."""
    name = "mpi4py"
    wire_dtypes = ("float32",)      # Open MPI 4.1 fails a numpy float16 Allreduce (MPI_ERR_TYPE)
    blocking = True

    def __init__(self) -> None:
        self._mpi = SleepingMpi()
        self.rank, self.world_size = self._mpi.rank, self._mpi.size
        super().__init__()

    def allreduce(self, x, name="des_allreduce"):
        return self._mpi.allreduce(x, name)

    def reducescatter(self, x, name="des_reducescatter"):
        return self._mpi.reducescatter(x, name)

    def allgather(self, x, name="des_allgather"):
        return self._mpi.allgather(x, name)

    def alltoall(self, x, splits, name="des_alltoall"):
        return self._mpi.alltoall(tf.convert_to_tensor(x), splits, name)

    def broadcast(self, a, root=0):
        self.count("broadcast", np.asarray(a).nbytes)
        return self._mpi.broadcast(a, root)

    def one_machine(self) -> bool:
        return self._mpi.one_machine()


class SettlingCommunicator(Communicator):
    """The default under a launcher: DES's collectives by mpi4py, each wait sleeping
    (``Mpi4pyCommunicator``: Horovod never starts, and no thread polls a core), unless
    des.transform settles (``settle``) on a step that Horovod runs faster: the data-parallel
    tail with partials (reduce-scattered, and the first Dense by rows beside them: by mpi4py,
    chained, 9% fewer samples/s, reports/peer_user_netbed_mpi4py.md), or a 16-bit wire (Open
    MPI has no float16 sum). The replicated tail by mpi4py, the wide preset's DeepFM on 4 hosts at
    100 Mbit/s: 1.98x TFRA's samples/s against Horovod's 1.79x, 0.18 CPU s a step against 0.32
    (reports/peer_wide_netbed_100mbit_sleeping.md). The first layer by rows (no partials: one
    all-to-all of rows each way and the tail's gradient sum) by mpi4py, a user's DeepFM there:
    as many samples/s as by Horovod or more, and a third to a half less CPU a step
    (reports/peer_user_netbed_rows_comm.md). Collectives before the choice (the plan's agreement,
    the link's timing) go by mpi4py; both communicators count into this one's counters."""
    wire_dtypes = WIRE_DTYPES

    def __init__(self) -> None:
        super().__init__()
        self.inner: Communicator = self._adopt(Mpi4pyCommunicator())
        self.rank, self.world_size = self.inner.rank, self.inner.world_size
        self.traced = False            # a collective was put in a graph: the choice is final

    def _adopt(self, comm: Communicator) -> Communicator:
        """``comm``, counting into this communicator's counters."""
        comm.bytes, comm.ncalls = self.bytes, self.ncalls
        comm.payload_bytes, comm.calls = self.payload_bytes, self.calls
        return comm

    def settle(self, tail: str, wire_dtype: str = "float32", first_layer: str = "operators") -> str:
        """mpi4py in float32 for the replicated tail or the first layer by rows (``first_layer="rows"``:
        no partials), else (the data-parallel tail with partials, a 16-bit wire, ``tail="ps"``: the
        parameter server) Horovod; the communicator's name. Once Horovod, Horovod (a transform of two
        towers, one of them on Horovod)."""
        sleeping = wire_dtype == "float32" and (tail == "replicated" or first_layer == "rows")
        if not sleeping and self.inner.name != "horovod":
            if self.traced:
                raise RuntimeError("des.transform: this communicator's collectives are already in a traced step "
                                   "by mpi4py; pass comm=des_ops.HorovodCommunicator() to every des.transform")
            self.inner = self._adopt(HorovodCommunicator())
        return self.inner.name

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def blocking(self) -> bool:
        return self.inner.blocking

    def _graph(self) -> Communicator:
        self.traced = self.traced or not tf.executing_eagerly()
        return self.inner

    def allreduce(self, x, name="des_allreduce"):
        return self._graph().allreduce(x, name)

    def reducescatter(self, x, name="des_reducescatter"):
        return self._graph().reducescatter(x, name)

    def allgather(self, x, name="des_allgather"):
        return self._graph().allgather(x, name)

    def alltoall(self, x, splits, name="des_alltoall"):
        return self._graph().alltoall(x, splits, name)

    def scatter(self, parts, row_shape, root=0, name="des_scatter"):
        return self.inner.scatter(parts, row_shape, root, name)

    def broadcast(self, a, root=0):
        return self.inner.broadcast(a, root)

    def one_machine(self) -> bool:
        return self.inner.one_machine()


def start_horovod_thread() -> None:
    """Under mpirun, start Horovod (its background thread polls every cycle and takes CPU from the
    step, as in a real run) without calling any collective; alone, nothing."""
    if under_launcher() and "OMPI_COMM_WORLD_LOCAL_RANK" in os.environ:
        init_horovod()


def default_communicator(kind: str = "auto", launched: str = "settling") -> Communicator:
    """``auto``: ``launched`` when launched with several processes (``settling``: mpi4py or
    Horovod, as des.transform settles; the parameter server and the cache ask for ``horovod``),
    else a world of one; ``noop``:
    the launcher's rank and size without collectives (timing only); ``sync``: the same, with
    the processes kept in step by one tiny allreduce per call (timing only); ``meet``: DES's
    only collective is its allreduce, so the same as ``sync``."""
    if kind == "auto":
        kind = launched if under_launcher() else "local"
    return KINDS[kind]()


KINDS = {"settling": SettlingCommunicator, "horovod": HorovodCommunicator, "mpi4py": Mpi4pyCommunicator,
         "local": LocalCommunicator, "noop": NoopCommunicator, "sync": SyncCommunicator, "meet": SyncCommunicator}

"""The parameter-server baseline's tables: one field's rows sharded by key over all processes.

Mesh PS (every process is worker and server), the design of TFRA's HvdAllToAllEmbedding,
built on Horovod's all-to-all: per lookup a process

  1. deduplicates its ids (padding dropped) and sorts them by owner ``key mod N``,
  2. sends them to their owners (``alltoall``), each owner deduplicates what it received
     (two processes may ask for the same key) and reads or inserts the rows in its table,
  3. gets the rows back (``alltoall``); in backward the gradient rows travel the reverse way
     (Horovod's registered gradient of alltoall) and the owner's optimizer applies them.

Rows are initialised by ``key_init`` of (field, key, seed), as in FieldEmbedding, so a PS
model starts from exactly the weights of the single-process model.

    >>> import numpy as np
    >>> from models.layers import FieldEmbedding
    >>> ids = tf.constant([12345, 7], tf.int64)
    >>> exchange = KeyExchange()                          # under mpirun: all processes; else a world of one
    >>> emb = ShardedFieldEmbedding("C1", 8, exchange, seed=0)
    >>> rows = emb(ids)                                   # [B, 8], this process's slice
    >>> rows.shape, bool(np.array_equal(rows, FieldEmbedding("C1", 8, seed=0)(ids)))   # the same initial rows
    (TensorShape([2, 8]), True)

Bytes are measured where the collective is called (``KeyExchange.alltoall``): per destination
process, the size of the segment of the tensor handed to all-to-all (``sent[kind]``) and of the
segment that came back from each source (``received[kind]``), self-sends kept apart (they stay
in the process). The lookup counters (``ids_bytes``, ``rows_bytes``, ``grad_bytes``) are the
remote parts of those for THIS process's lookups: ids out (8 B each), rows in (4*dim B) and, in
backward, gradient rows out (4*dim B) - what ``des.baselines.ps.rewrite.analytic_bytes`` computes from the ids.
"""
from __future__ import annotations

import re

import numpy as np
import tensorflow as tf

from des.data.hashing import ID_MASK
from des.graph.sources import TableSource, register
from des_ops.comm import WIRE_DTYPES, Communicator
from des_ops.mpi import default_communicator
from des_ops.fused import FUSED_CLASS, FusedTable
from models.layers import FieldEmbedding
from models.spec import PAD_ID


class KeyExchange:
    """Routes keys to their owner (key mod world_size) and rows back; counts bytes and keys."""

    COUNTERS = ("ids_bytes", "rows_bytes", "grad_bytes", "dense_bytes", "control_bytes", "metrics_bytes",
                "barrier_bytes",
                "unique_ids", "remote_ids")
    # what travels by all-to-all: PS ids / rows / gradient rows; cache queries / clocks / rows / pushes
    KINDS = ("ids", "rows", "grads", "query", "clock", "fetch", "push")

    def __init__(self, comm: Communicator | None = None, wire_dtype: str = "float32"):
        """``comm`` (des_ops.comm) carries the all-to-alls and allreduces; default: Horovod under
        mpirun, else a world of one; des.transform's default (des_ops.mpi.SettlingCommunicator)
        is settled on Horovod. In a simulated world: ``KeyExchange(world.communicator(r))``;
        for timing the computation alone: ``KeyExchange(NoopCommunicator(meet=...))``.
        ``wire_dtype``: the type rows and gradient rows travel in ("float16": half the bytes, the
        rows rounded to 16 bits on the way; ids, dense gradients and tables stay as they are)."""
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype={wire_dtype!r}: one of {', '.join(WIRE_DTYPES)}")
        self.wire_dtype = tf.as_dtype(wire_dtype)
        self.comm = default_communicator(launched="horovod") if comm is None else comm
        if hasattr(self.comm, "settle"):        # des.transform's default communicator: exchanges by Horovod
            self.comm.settle("ps")
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        self.counters = {n: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"ps_{n}")
                         for n in self.COUNTERS}
        vector = lambda name: tf.Variable(tf.zeros([self.world_size], tf.int64), trainable=False, name=name)  # noqa: E731
        self.sent = {k: vector(f"a2a_sent_{k}") for k in self.KINDS}
        self.received = {k: vector(f"a2a_received_{k}") for k in self.KINDS}

    def owner(self, keys: tf.Tensor) -> tf.Tensor:
        return tf.cast(tf.math.floormod(keys, self.world_size), tf.int32)

    def _add(self, name: str, value) -> tf.Operation:
        return self.counters[name].assign_add(tf.cast(value, tf.int64))

    def lookup(self, local_rows, uniq: tf.Tensor, dim: int, tag: str = "", ids_of=None, counts=None) -> tf.Tensor:
        """Rows [n, dim] of distinct keys ``uniq`` [n]; ``local_rows(keys)`` reads the owner's table.
        ``tag`` names the table alike on every process (the in-process world meets by name).
        ``ids_of(keys)``: the ids whose owner (id mod N) holds a key (a fused table's keys pack them).
        ``counts`` [n] (a row policy's occurrences): sent with the keys; the owner calls
        ``local_rows(keys, counts)`` with each key's sum over the processes."""
        n = tf.size(uniq)
        if self.world_size == 1:
            with tf.control_dependencies([self._add("unique_ids", n)]):
                return local_rows(tf.identity(uniq)) if counts is None else local_rows(tf.identity(uniq), counts)
        owner = self.owner(uniq if ids_of is None else ids_of(uniq))
        order = tf.argsort(owner, stable=True)
        splits = tf.math.bincount(owner, minlength=self.world_size, maxlength=self.world_size, dtype=tf.int32)
        remote = n - splits[self.rank]
        count = tf.group(self._add("unique_ids", n), self._add("remote_ids", remote))
        with tf.control_dependencies([count]):
            received, received_splits = self.alltoall(tf.gather(uniq, order), splits, "ids", add_sent="ids_bytes",
                                                          tag=tag)
        keys, where = tf.unique(received)                 # the same key may come from several processes
        if counts is None:
            held = local_rows(keys)
        else:
            got, _ = self.alltoall(tf.gather(tf.cast(counts, tf.int64), order), splits, "ids",
                                   add_sent="control_bytes", tag=f"{tag}/counts")
            held = local_rows(keys, tf.math.unsorted_segment_sum(got, where, tf.size(keys)))
        rows = tf.reshape(tf.gather(held, where), [-1, dim])
        # in wire_dtype both ways: the cast's gradient casts the gradient rows before they travel
        back, _ = self.alltoall(tf.cast(rows, self.wire_dtype), received_splits, "rows", add_received="rows_bytes",
                                grad_kind="grads", grad_add_sent="grad_bytes", tag=tag)
        return tf.gather(tf.cast(back, rows.dtype), tf.math.invert_permutation(order))

    def alltoall(self, x: tf.Tensor, splits: tf.Tensor, kind: str, add_sent=None, add_received=None,
                 grad_kind: str | None = None, grad_add_sent=None, tag: str = ""):
        """Horovod all-to-all of ``x`` (rows grouped by destination, ``splits[d]`` rows to process d):
        returns (rows from every source, rows per source). Counts, per process, the bytes of the
        segments handed over (``sent[kind]``) and received (``received[kind]``); ``add_sent`` /
        ``add_received`` (a counter's name or an int64 variable) also get the remote (not self) part. With
        ``grad_kind`` the backward pass is one all-to-all of the gradient rows back to the sources,
        counted the same way (Horovod's own gradient, made countable).

            >>> rows, per_source = exchange.alltoall(values, splits, "rows", grad_kind="grads")  # doctest: +SKIP

        In a simulated world of 2, each process sends one row to process 0 and two to process 1:

            >>> from des.jobs.verify import run_sharded_world
            >>> def work(exchange):
            ...     values, splits = tf.fill([3, 1], float(exchange.rank)), tf.constant([1, 2])
            ...     rows, per_source = exchange.alltoall(values, splits, "rows", grad_kind="grads")
            ...     return rows.numpy()[:, 0].tolist(), per_source.numpy().tolist()
            >>> run_sharded_world(2, work)
            [([0.0, 1.0], [1, 1]), ([0.0, 0.0, 1.0, 1.0], [2, 2])]
        """
        if self.world_size == 1:
            return tf.identity(x), splits
        row_bytes = x.dtype.size * tf.reduce_prod(tf.shape(x, out_type=tf.int64)[1:])   # rank known at run time

        def counted(result, out_splits, in_splits, name, scalar_sent, scalar_received):
            sent = tf.cast(out_splits, tf.int64) * row_bytes
            came = tf.cast(in_splits, tf.int64) * row_bytes
            ops = [self.sent[name].assign_add(sent), self.received[name].assign_add(came)]
            for scalar, per_process in ((scalar_sent, sent), (scalar_received, came)):
                if scalar is not None:
                    var = self.counters[scalar] if isinstance(scalar, str) else scalar
                    ops.append(var.assign_add(tf.reduce_sum(per_process) - per_process[self.rank]))
            with tf.control_dependencies(ops):
                return tf.identity(result)

        if grad_kind is None:
            got, in_splits = self._alltoall(x, splits, f"{tag}/{kind}")
            return counted(got, splits, in_splits, kind, add_sent, add_received), in_splits

        per_source = []

        @tf.custom_gradient
        def differentiable(v):
            got, in_splits = self._alltoall(v, splits, f"{tag}/{kind}")
            per_source.append(in_splits)

            def grad(dy):
                back, back_splits = self._alltoall(dy, in_splits, f"{tag}/{grad_kind}")
                return counted(back, in_splits, back_splits, grad_kind, grad_add_sent, None)
            return got, grad

        got = differentiable(x)
        return counted(got, splits, per_source[0], kind, add_sent, add_received), per_source[0]

    def sum_across(self, x: tf.Tensor, counter: str = "dense_bytes") -> tf.Tensor:
        """Sum over processes (no gradient); adds the bytes handed over to ``counter``."""
        if self.world_size == 1:
            return tf.identity(x)
        with tf.control_dependencies([self._add(counter, tf.size(x) * x.dtype.size)]):
            return self.comm.allreduce(x, f"ps_{counter}")

    def _alltoall(self, x, splits, name: str):
        """Every collective is named by what it moves, alike on every rank (Horovod matches by name)."""
        return self.comm.alltoall(x, splits, f"ps_{name}")

    def snapshot(self) -> dict:
        """The scalar counters, and ``sent``/``received`` bytes per process per all-to-all kind."""
        out: dict = {n: int(v.numpy()) for n, v in self.counters.items()}
        out["sent"] = {k: v.numpy().tolist() for k, v in self.sent.items()}
        out["received"] = {k: v.numpy().tolist() for k, v in self.received.items()}
        return out


class ShardedFieldEmbedding(FieldEmbedding):
    """FieldEmbedding whose rows live with their owner process (see the module docstring)."""

    des_state_class = "FieldEmbedding"   # its rows are keyed as the unsharded table's (checkpoints)

    def __init__(self, field: str, dim: int, exchange: KeyExchange, seed: int = 0,
                 init_scale: float = 0.05, name: str | None = None, linear: bool = False, **kwargs):
        super().__init__(field, dim, seed, init_scale, name=name or f"ps{dim}_{field}", linear=linear, **kwargs)
        self.exchange = exchange

    @property
    def tag(self) -> str:
        """The table's name alike on every process (layer names get suffixes in a process that
        built several models, e.g. the simulated world)."""
        return f"{self.field}:{self.dim}:{'linear' if self.linear else 'rows'}"

    def distinct_rows(self, uniq, training, multi_valued, counts=None):
        """The rows of the distinct ids from their owners (padding: zero rows, never a key)."""
        return owners_rows(self, uniq, training, counts=counts)


class ShardedKeyedEmbedding(ShardedFieldEmbedding):
    """A user's TFRA ``de.keras.layers.Embedding`` (keyed: its new rows from (table, key, seed),
    des.graph.sources) sharded by key: the rows the keyed table would hold, ids of any shape ->
    ids.shape + [dim] as TFRA returns them (no pooling). ``key``: the table's name alike on every
    process (des.graph.ir.Graph.layer_key)."""

    des_rows_in_ids_shape = True       # fused (ShardedFusedTable): its rows in the ids' shape, not pooled

    def __init__(self, keyed, exchange: KeyExchange, key: str, **kwargs):
        super().__init__(key, int(keyed.embedding_size), exchange, init_scale=keyed.des_scale,
                         name="ps_" + re.sub(r"[^A-Za-z0-9_.]", "_", key), **kwargs)
        self.salt = keyed.des_salt                 # the keyed table's: the same start rows
        if getattr(keyed.shadow, "des_linear_part", False):
            self.shadow.des_linear_part = True

    @property
    def tag(self) -> str:
        return f"{self.field}:{self.dim}"

    @tf.autograph.experimental.do_not_convert
    def call(self, inputs, training=None):
        ids = tf.convert_to_tensor(inputs, tf.int64)
        uniq, idx, counts = self.unique_keys(tf.reshape(ids, [-1]), training)
        rows = self.distinct_rows(uniq, training, multi_valued=False, counts=counts)
        return tf.reshape(tf.gather(rows, idx), tf.concat([tf.shape(ids), [self.dim]], 0))

    def compute_output_shape(self, input_shape):
        return tf.TensorShape(input_shape).concatenate([self.dim])


def owners_rows(table, uniq: tf.Tensor, training, ids_of=None, counts=None) -> tf.Tensor:
    """Rows [n, dim] of the distinct keys ``uniq`` of a sharded ``table`` (a FieldEmbedding with
    ``exchange`` and ``tag``), read from their owners' tables; PAD_ID gives a zero row, never a key.
    ``ids_of``: see KeyExchange.lookup. ``counts``: the keys' occurrences in this process's slice,
    for a row policy: they travel with the keys and the owner counts their sum."""
    real = tf.where(uniq != PAD_ID)
    found = table.exchange.lookup(lambda k, c=None: FieldEmbedding.rows(table, k, training, counts=c),
                                  tf.gather_nd(uniq, real), table.dim, tag=table.tag, ids_of=ids_of,
                                  counts=None if counts is None else tf.gather_nd(counts, real))
    return tf.scatter_nd(real, found, tf.stack([tf.size(uniq, tf.int64), table.dim]))


class ShardedFusedTable(FusedTable):
    """The rows of several ShardedFieldEmbedding tables of one width in one TFRA table per process:
    one set of all-to-alls per width and step instead of one per table. A row still lives with the
    owner of its id (id mod N), as in the tables it fuses, so checkpoints and bytes are theirs."""

    def __init__(self, members: list, calls: list[int], dim: int, name: str, linear: bool = False, **layout):
        super().__init__(members, calls, dim, name, linear, **layout)
        self.exchange = members[0].exchange
        self.tag = f"fused{dim}:{'linear' if linear else 'joined' if len(self.blocks) > 1 else 'rows'}"

    @staticmethod
    def ids_of(keys: tf.Tensor) -> tf.Tensor:
        """The ids packed in fused keys (their owner is id mod N)."""
        return tf.bitwise.bitwise_and(keys, tf.constant(ID_MASK, tf.int64))

    def distinct_rows(self, uniq, training, multi_valued, counts=None):
        return owners_rows(self, uniq, training, ids_of=self.ids_of, counts=counts)


FUSED_CLASS[ShardedFieldEmbedding] = ShardedFusedTable
FUSED_CLASS[ShardedKeyedEmbedding] = ShardedFusedTable


class ShardedStaticEmbedding(tf.keras.layers.Layer):
    """A user's Keras ``Embedding`` (a static [V, K] variable) sharded by key: process r holds rows
    k = r, r + N, r + 2N, ... (k mod N = r, as every PS table) as one [ceil((V - r) / N), K]
    variable, taken from the table's rows (the same on every process, des.compiler.keys.sync_from_root);
    ids of any shape -> ids.shape + [K], each distinct id's row from its owner by the exchange.
    The table's ``embeddings_regularizer`` applies to the rows a process holds (summed over
    processes: the table's), ``mask_zero`` as Keras does. ``key``: the table's name alike on every
    process (des.graph.ir.Graph.layer_key).

        >>> exchange = KeyExchange()                      # a world of one here
        >>> table = tf.keras.layers.Embedding(10, 4)
        >>> ids = tf.constant([[3, 7], [3, 0]])
        >>> sharded = ShardedStaticEmbedding(table, exchange, "t")
        >>> bool(tf.reduce_all(sharded(ids) == table(ids))), sharded.rows.shape
        (True, TensorShape([10, 4]))
    """

    des_sharded_by_key = True        # its rows' gradients stay with their owner (PSModel sums the others)
    des_state_class = "Embedding"    # its rows are keyed as the unsharded table's (checkpoints)

    def __init__(self, embedding: tf.keras.layers.Embedding, exchange: KeyExchange, key: str, **kwargs):
        super().__init__(name="ps_" + re.sub(r"[^A-Za-z0-9_.]", "_", key), **kwargs)
        if not embedding.built:
            embedding.build(None)
        self.exchange, self.tag = exchange, key
        self.vocabulary, self.dim = (int(d) for d in embedding.embeddings.shape)
        self.mask_zero = bool(embedding.mask_zero)
        held = embedding.embeddings.numpy()[exchange.rank::exchange.world_size]
        # named after the table: optimizer slots are matched to their variables by name
        self.rows = self.add_weight(f"{self.name}_rows", shape=held.shape, initializer=tf.keras.initializers.Constant(held),
                                    regularizer=embedding.embeddings_regularizer, trainable=embedding.trainable,
                                    dtype=embedding.embeddings.dtype)

    def call(self, inputs):
        ids = tf.cast(inputs, tf.int64)
        uniq, idx = tf.unique(tf.reshape(ids, [-1]), out_idx=tf.int64)
        n = self.exchange.world_size
        rows = self.exchange.lookup(lambda keys: tf.gather(self.rows, keys // n), uniq, self.dim, tag=self.tag)
        return tf.reshape(tf.gather(rows, idx), tf.concat([tf.shape(ids), [self.dim]], 0))

    def compute_mask(self, inputs, mask=None):
        return tf.not_equal(inputs, 0) if self.mask_zero else None

    def compute_output_shape(self, input_shape):
        return tf.TensorShape(input_shape).concatenate([self.dim])


@register
class _ShardedStatic(TableSource):
    """A ShardedStaticEmbedding as a table of des.graph.sources: keys rank, rank + N, ... held in
    one static variable, so that checkpoints save and restore its rows by key on any N."""
    name = "sharded Keras Embedding"
    dynamic = False

    def claims(self, layer):
        return isinstance(layer, ShardedStaticEmbedding)

    def field(self, layer):
        return None

    def rows(self, layer):
        return float(layer.rows.shape[0])

    def export(self, layer):
        """(keys, rows) this process holds: keys rank, rank + N, ..."""
        ex = layer.exchange
        return np.arange(ex.rank, layer.vocabulary, ex.world_size), layer.rows.numpy()

    def load(self, layer, keys, values):
        held = layer.rows.numpy()
        held[np.asarray(keys) // layer.exchange.world_size] = values
        layer.rows.assign(held)

    def trainable(self, layer):
        return layer.rows

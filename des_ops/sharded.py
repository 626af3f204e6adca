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

    >>> exchange = KeyExchange.horovod()
    >>> emb = ShardedFieldEmbedding("C1", 8, exchange, seed=0)
    >>> rows = emb(ids)                                   # [B, 8], this process's slice

Bytes are counted from the tensors handed to all-to-all, for the ids THIS process asks
other processes for (its own shard is not sent): ids out (8 B each), rows back (4*dim B)
and, in backward, gradient rows out (4*dim B).
"""
from __future__ import annotations

import tensorflow as tf

from des.data.spec import PAD_ID
from models.layers import FieldEmbedding, pool


class KeyExchange:
    """Routes keys to their owner (key mod world_size) and rows back; counts bytes and keys."""

    COUNTERS = ("ids_bytes", "rows_bytes", "grad_bytes", "dense_bytes", "control_bytes",
                "unique_ids", "remote_ids")

    def __init__(self, rank: int, world_size: int, hvd=None):
        self.rank, self.world_size, self._hvd = rank, world_size, hvd
        self.counters = {n: tf.Variable(0, dtype=tf.int64, trainable=False, name=f"ps_{n}")
                         for n in self.COUNTERS}

    @classmethod
    def horovod(cls) -> "KeyExchange":
        import horovod.tensorflow as hvd
        hvd.init()
        return cls(hvd.rank(), hvd.size(), hvd)

    @classmethod
    def local(cls) -> "KeyExchange":
        return cls(0, 1, None)

    def owner(self, keys: tf.Tensor) -> tf.Tensor:
        return tf.cast(tf.math.floormod(keys, self.world_size), tf.int32)

    def _add(self, name: str, value) -> tf.Operation:
        return self.counters[name].assign_add(tf.cast(value, tf.int64))

    def lookup(self, local_rows, uniq: tf.Tensor, dim: int) -> tf.Tensor:
        """Rows [n, dim] of distinct keys ``uniq`` [n]; ``local_rows(keys)`` reads the owner's table."""
        n = tf.size(uniq)
        if self.world_size == 1:
            with tf.control_dependencies([self._add("unique_ids", n)]):
                return local_rows(tf.identity(uniq))
        owner = self.owner(uniq)
        order = tf.argsort(owner, stable=True)
        splits = tf.math.bincount(owner, minlength=self.world_size, maxlength=self.world_size, dtype=tf.int32)
        remote = n - splits[self.rank]
        count = tf.group(self._add("unique_ids", n), self._add("remote_ids", remote),
                         self._add("ids_bytes", 8 * remote), self._add("rows_bytes", 4 * dim * remote))
        with tf.control_dependencies([count]):
            received, received_splits = self._hvd.alltoall(tf.gather(uniq, order), splits=splits)
        keys, where = tf.unique(received)                 # the same key may come from several processes
        rows = tf.gather(local_rows(keys), where)
        back, _ = self._hvd.alltoall(rows, splits=received_splits)
        back = self._count_gradient(back, remote, dim)
        return tf.gather(back, tf.math.invert_permutation(order))

    def _count_gradient(self, x: tf.Tensor, remote: tf.Tensor, dim: int) -> tf.Tensor:
        @tf.custom_gradient
        def counted(v):
            def grad(dy):
                with tf.control_dependencies([self._add("grad_bytes", 4 * dim * remote)]):
                    return tf.identity(dy)
            return tf.identity(v), grad
        return counted(x)

    def allreduce_sum(self, x: tf.Tensor, counter: str | None = "dense_bytes") -> tf.Tensor:
        """Sum over processes (no gradient); counts the bytes handed over."""
        if self.world_size == 1:
            return tf.identity(x)
        deps = [self._add(counter, tf.size(x) * x.dtype.size)] if counter else []
        with tf.control_dependencies(deps):
            return self._hvd.allreduce(x, op=self._hvd.Sum)

    def snapshot(self) -> dict[str, int]:
        return {n: int(v.numpy()) for n, v in self.counters.items()}


class ShardedFieldEmbedding(FieldEmbedding):
    """FieldEmbedding whose rows live with their owner process (see the module docstring)."""

    des_state_class = "FieldEmbedding"   # its rows are keyed as the unsharded table's (checkpoints)

    def __init__(self, field: str, dim: int, exchange: KeyExchange, seed: int = 0,
                 init_scale: float = 0.05, name: str | None = None, linear: bool = False, **kwargs):
        super().__init__(field, dim, seed, init_scale, name=name or f"ps{dim}_{field}", linear=linear, **kwargs)
        self.exchange = exchange

    def call(self, inputs, training=None):
        ids, weights = (inputs[0], inputs[1]) if isinstance(inputs, (list, tuple)) else (inputs, None)
        ids = tf.convert_to_tensor(ids, tf.int64)
        uniq, idx = tf.unique(tf.reshape(ids, [-1]))
        real = tf.where(uniq != PAD_ID)
        found = self.exchange.lookup(lambda k: FieldEmbedding.rows(self, k, training),
                                     tf.gather_nd(uniq, real), self.dim)
        rows = tf.scatter_nd(real, found, tf.stack([tf.size(uniq, tf.int64), self.dim]))
        return pool(tf.gather(rows, idx), ids, weights, self.dim)

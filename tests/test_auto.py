"""plan="auto" (des.jobs.auto): DES or the PS, whichever moves fewer bytes, from hand-computed cases.
Under mpirun (--mode auto on the wide preset picks DES and equals one process): tests/test_columnar.py."""
import numpy as np

import models
from des.jobs.auto import choose, traffic
from des.data import FeatureSpec, Field

SPEC = FeatureSpec((Field("a", "categorical", 4), Field("b", "categorical", 4)))


def _batch(a, b):
    return {"a": np.array(a, np.int64), "b": np.array(b, np.int64)}


def test_lr_bytes_by_hand_and_the_choice_flips_with_locality():
    """LR on 2 fields, B=4, N=2. DES: one float per sample, ring 2(N-1)/N = 1: 4*4 = 16 B.
    PS, rank r reads rows [2r, 2r+2); a table's row of id k lives on k mod 2; a remote distinct id
    costs 8 (key) + 4 (row) + 4 (gradient) = 16 B; the bias (1 float) is allreduced: 4 B; the
    loss weight: 4 B.
    - ids all remote (rank 0 reads odd ids, rank 1 even): rank 0 has 2 + 1 remote distinct ids,
      rank 1 has 1 + 2: 48 + 8 = 56 B each -> DES (16 < 56);
    - ids all local: 0 + 8 = 8 B -> PS (8 < 16)."""
    model = models.build("lr", SPEC, seed=0)
    remote = _batch([1, 3, 2, 2], [5, 5, 4, 6])
    t = traffic(model, remote, 2)
    assert t["des_bytes"] == 16 and t["des_payload"] == 16
    assert t["ps_alltoall"] == 48 and t["ps_dense_payload"] == 4 and t["ps_bytes"] == 56
    c = choose(model, remote, 2)
    assert (c.mode, c.des_bytes, c.ps_bytes) == ("des", 16, 56)
    assert "plan auto: DES" in str(c) and "lr_sum" in str(c)
    local = _batch([2, 4, 1, 3], [6, 6, 5, 7])
    c = choose(model, local, 2)
    assert (c.mode, c.des_bytes, c.ps_bytes) == ("ps", 16, 8)
    assert "plan auto: PS" in str(c)


def test_deepfm_des_floats_by_hand_and_one_process_is_des():
    """DeepFM, dim 4, hidden (8,): partials 1 (linear) + 4 + 1 (FM S, Q) + 8 (first Dense) = 14
    floats per sample; at N=4, B=8: 2*3/4 * 4 * 8 * 14 = 672 B. One process: DES, nothing moves."""
    model = models.build("deepfm", SPEC, seed=0, hidden=(8,))
    batch = _batch(np.arange(8), np.arange(8) + 100)
    t = traffic(model, batch, 4)
    assert t["des_payload"] == 4 * 8 * 14 and t["des_bytes"] == 672
    one = choose(model, batch, 1)
    assert one.mode == "des" and one.des_bytes == 0 and one.ps_bytes == 0


def test_the_ps_looks_up_one_fused_table_per_width_and_each_table_that_cannot_fuse():
    """What the projection's PS pays 3 all-to-alls for (des.jobs.projection): its tables as --mode ps
    fuses them. DeepFM on 2 fields: 4 tables (2 rows of width 4, 2 linear weights) -> 1 lookup of
    joined rows (the PS's default with one optimizer), 2 lookups without (one per width).
    By hand: fields a, b (width 4) fuse into 1; c (width 4, frozen) cannot fuse: 1; d
    (width 2) is a group of its own: 1 -> 3 lookups of 4 tables; 3 all-to-alls per lookup."""
    from des.cluster.timemodel import ps_traffic
    from models.layers import FieldEmbedding
    model = models.build("deepfm", SPEC, seed=0, hidden=(8,))
    t = traffic(model, _batch(np.arange(8), np.arange(8) + 100), 2)
    assert (t["tables"], t["ps_lookups"]) == (4, 1)
    assert traffic(model, _batch(np.arange(8), np.arange(8) + 100), 2, join_linear=False)["ps_lookups"] == 2
    tf = __import__("tensorflow")
    x = {f: tf.keras.Input((), dtype=tf.int64, name=f) for f in "abcd"}
    embs = [FieldEmbedding("a", 4)(x["a"]), FieldEmbedding("b", 4)(x["b"]),
            FieldEmbedding("c", 4, trainable=False)(x["c"])]
    deep = tf.keras.layers.Concatenate()(embs + [FieldEmbedding("d", 2)(x["d"])])
    hand = tf.keras.Model(x, tf.keras.layers.Dense(1, activation="sigmoid")(deep))
    t = traffic(hand, {f: np.arange(4) for f in "abcd"}, 2)
    assert (t["tables"], t["ps_lookups"]) == (4, 3)
    assert len(ps_traffic(t["ps_lookups"], 600.0, 600.0, 40.0)["alltoall"]) == 9

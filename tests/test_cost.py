"""The cost model's per-operator estimates against the exact byte formulas on the same ids."""
import numpy as np
import pytest

import des
import models
from des.baselines.ps.rewrite import analytic_bytes, dense_parameters, table_inputs
from des.cost import estimate, unique_ids_per_slice
from des.verify import random_batches, small_spec
from des_ops.comm import InProcessWorld
from models.spec import FeatureSpec, Field

SMALL_VOCAB = small_spec(6, dim=4)                                   # 10..60 values per field
BIG_VOCAB = FeatureSpec(tuple(Field(f"f{i}", "categorical", 4, 10**6) for i in range(26)))


@pytest.mark.parametrize("spec, name, hidden, winner", [
    (BIG_VOCAB, "lr", None, "DES"), (SMALL_VOCAB, "lr", None, "PS"),
    (BIG_VOCAB, "dnn", (2,), "DES"), (SMALL_VOCAB, "dnn", (256,), "PS")])
def test_ps_estimate_matches_the_exact_formula_and_the_verdict(spec, name, hidden, winner):
    """Few distinct ids (small vocabularies) or a wide first layer: a PS moves less."""
    n, batch = 4, 2048
    x, _ = random_batches(spec, 1, batch, seed=3)[0]
    x = {k: v.numpy() for k, v in x.items()}
    uniq = unique_ids_per_slice(x, spec, n)

    def exact_ps(model):          # mean over processes of the formula with the true remote ids
        tables = table_inputs(model)
        return np.mean([analytic_bytes({k: v[batch * r // n: batch * (r + 1) // n] for k, v in x.items()},
                                       tables, r, n, 0)["alltoall_bytes"] for r in range(n)])

    build = lambda: models.build(name, spec, seed=1, hidden=hidden or (8,))
    _, report = des.transform(build(), comm=InProcessWorld(n).communicator(0))
    costs = estimate(report, batch, uniq)
    assert len(costs) == 1
    c = costs[0]
    plain = build()
    dense = 0 if name == "lr" else sum(int(np.prod(w.shape)) for w in plain.get_layer("dnn_0").weights)
    expected = exact_ps(plain) + 2 * (n - 1) / n * 4 * dense
    assert abs(c.ps_bytes - expected) / expected < 0.05, (c.ps_bytes, expected)
    assert c.des_bytes == 2 * (n - 1) / n * 4 * batch * report.floats_per_sample
    assert c.verdict.startswith("DES moves" if winner == "DES" else "a PS would move"), c


HAND_SPEC = FeatureSpec((Field("f0", "categorical", 4, 10), Field("f1", "categorical", 4, 20)))
HAND_IDS = {"f0": np.array([[1], [2], [3], [3]]), "f1": np.array([[5], [5], [5], [-1]])}


def test_unique_ids_per_slice_by_hand():
    # N=2, B=4: f0 slices {1,2} and {3} -> mean 1.5; f1 {5} and {5} (padding dropped) -> 1.0
    assert unique_ids_per_slice(HAND_IDS, HAND_SPEC, 2) == {"f0": 1.5, "f1": 1.0}


@pytest.mark.parametrize("name, des_bytes, ps_bytes, verdict", [
    # lr: one float per sample; rows of width 1: u * 1/2 * (8 B key + 4 B row + 4 B gradient row)
    #   DES 2*(2-1)/2 * 4 B * 4 samples * 1 = 16;  PS 1.5/2*16 + 1.0/2*16 = 20
    ("lr", 16.0, 20.0, "DES moves 1.2x fewer bytes"),
    # dnn (hidden 3): partial of 3 floats; rows of width 4 -> u/2 * 40; plus the allreduce of
    #   the Dense kernel 8x3 and bias 3 (27 floats) a PS makes: 1 * 4 * 27 = 108
    #   DES 1 * 4 * 4 * 3 = 48;  PS 1.5/2*40 + 1.0/2*40 + 108 = 158
    ("dnn", 48.0, 158.0, "DES moves 3.3x fewer bytes")])
def test_cost_estimate_equals_hand_computed_bytes(name, des_bytes, ps_bytes, verdict):
    model = models.build(name, HAND_SPEC, seed=1, hidden=(3,))
    _, report = des.transform(model, comm=InProcessWorld(2).communicator(0))
    [c] = estimate(report, 4, unique_ids_per_slice(HAND_IDS, HAND_SPEC, 2))
    assert (c.des_bytes, c.ps_bytes, c.verdict) == (des_bytes, ps_bytes, verdict)

"""A new rewrite rule is one unit: its pattern, its sub-operator (the partial math) and its
registration, in one file - this test file is that file for a toy rule, the mean of 1-wide field
vectors (Keras ``Average``):

    mean_f w_f = sum_p a_p,  a_p = (sum_{f owned by p} w_f) / F

Nothing else in the project changes: des.transform substitutes it and the DES model on 2 and 3
simulated processes trains exactly as the untouched model; the pattern does not fire on vectors
wider than 1; the cost model prices it from the match alone.
"""
import numpy as np
import pytest
import tensorflow as tf

import des
from des.jobs.verify import compare, run_in_process_world, train_and_snapshot
from des_ops.comm import LocalCommunicator
from des_ops.partials import linear_partial
from des_ops.suboperators import SubOperator
from helpers import random_batches, small_spec
from models.layers import Bias, FieldEmbedding
from models.zoo import inputs_for
from rewrite_rules import RULES, Match, Rejection, Rule, check_vectors, register

SPEC = small_spec(4, dim=3)


class MeanSubOp(SubOperator):
    """(sum of the owned 1-wide vectors) / F: partial [B, 1]; the allreduce's sum is the mean."""
    width = 1

    def __init__(self, fields, *, count: int, **kwargs):
        super().__init__(fields, **kwargs)
        self.count = count

    def partial(self, vectors, batch):
        return linear_partial(vectors, batch) / self.count


class MeanRule(Rule):
    name = "toy_mean"

    def match(self, graph, fields, node):
        if node.kind != "layer:Average":
            return None
        vectors = [fields.vector(t) for t in node.operands]
        if any(v is None or v.width != 1 for v in vectors):
            return None
        why = check_vectors(graph, vectors)
        return Rejection(self.name, node, why) if why else Match(self.name, node, vectors, {node.index})

    def sub_operator(self, match, owned, name):
        return MeanSubOp([v.field for v in owned], count=len(match.vectors), source=match.root.layer.name,
                         name=name)


@pytest.fixture
def toy_rule():
    register(MeanRule, priority=5)
    yield
    RULES[:] = [r for r in RULES if r.name != "toy_mean"]


def mean_model(dim: int = 1, seed: int = 0):
    x = inputs_for(SPEC)
    w = [FieldEmbedding(f.name, dim, seed=seed)(x[f.name]) for f in SPEC]
    mean = tf.keras.layers.Average()(w)
    if dim > 1:
        mean = tf.keras.layers.Dense(1)(tf.keras.layers.Flatten()(mean))
    return tf.keras.Model(x, tf.keras.layers.Activation("sigmoid")(Bias()(mean)))


def test_without_the_rule_its_tables_go_by_field_rows():
    model = mean_model()
    _, report = des.transform(model, comm=LocalCommunicator())
    assert [m.rule for m in report.substitutions] == ["field_rows"] * len(SPEC)
    assert report.floats_per_sample == len(SPEC)      # each field's 1-wide vector, not one partial


def test_a_rule_in_one_file_is_substituted_and_exact(toy_rule):
    batches = random_batches(SPEC, 8, 32, seed=1)
    probe = random_batches(SPEC, 1, 16, seed=9)[0][0]
    _, report = des.transform(mean_model(), comm=LocalCommunicator())
    assert [m.rule for m in report.substitutions] == ["toy_mean"] and report.floats_per_sample == 1
    work = lambda m: train_and_snapshot(m, "sgd", 0.5, batches, probe)  # noqa: E731
    ref = work(mean_model())
    assert np.ptp(ref["predictions"][:, 0]) > 1e-4
    for n in (2, 3):
        diff = compare(ref, run_in_process_world(n, mean_model, work))
        print(f"toy_mean N={n}: {diff}")
        assert max(diff.values()) < 1e-6
    report.estimate_costs(32, {f.name: 10.0 for f in SPEC})
    cost = report.costs[0]
    assert cost.des_bytes == 0.0 and cost.ps_bytes == 0.0       # one process: nothing moves


def test_the_toy_pattern_does_not_fire_on_wider_vectors(toy_rule):
    from des.compiler import find_substitutions
    from des.graph.ir import Graph
    matches, _ = find_substitutions(Graph(mean_model(dim=3)))
    assert "toy_mean" not in [m.rule for m in matches]

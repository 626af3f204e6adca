"""Fused tables for a whole model: ``fuse_model`` puts the fusable tables of an untouched model
(des.train --mode single's default, the parameter server's slices) into one TFRA table per width
(des_ops.fused.FusedTable), keeping the model's function, state keys and checkpoints.
"""
from __future__ import annotations

import tensorflow as tf

from des.compiler.keys import StateKeys, keep_state_keys
from des.graph.ir import Graph, replay
from des_ops.fused import fuse_nodes


def fuse_model(model: tf.keras.Model, join_linear: bool = False) -> tuple[tf.keras.Model, list[str]]:
    """``model`` (functional, untouched) with its fusable tables in one TFRA table per width: the same
    function, the same state keys and checkpoints (des.runtime.state), one lookup and update per width.
    ``join_linear``: a field's linear weight sits in its embedding's row (des_ops.fused; one optimizer
    must train both parts).

        >>> import models
        >>> from des.data import FeatureSpec, Field
        >>> spec = FeatureSpec((Field("C1", dim=4), Field("C2", dim=4)))
        >>> fused, lines = fuse_model(models.deepfm(spec, hidden=(8,)))
        >>> [line.split(":")[0].split("_model")[0] for line in lines]   # then the model's name, as Keras numbers it
        ['fused table des_fused4', 'fused table des_fused1_linear']
        >>> _, lines = fuse_model(models.deepfm(spec, hidden=(8,)), join_linear=True)
        >>> [line.split(":")[0].split("_model")[0] for line in lines]
        ['fused table des_fused5_joined']

    Returns (the new model, one report line per fused table); the model itself if nothing fuses.
    Its tables' inputs must be the model's inputs."""
    graph = Graph(model)
    keys = StateKeys.of_model(model)            # per table, before the rows move
    nodes = [n for n in graph.nodes if n.kind == "table" and
             all(graph.input_name(t) is not None for t in n.tensor_operands())]
    fused, lines = fuse_nodes(graph, nodes, "model", join_linear)
    if not fused:
        return model, lines
    inputs = {t: graph.tensors[t] for t in graph.input_ids}
    given = {}
    for table, members in fused:
        args = [tf.nest.map_structure(lambda x: inputs.get(id(x), x), m.call_args[0]) for m in members]
        wanted = table.block_inputs(args)
        outs, blocks = table(args, with_block=True) if any(wanted) else (table(args), [None] * len(wanted))
        given.update({m.output: (lambda look, o=o: o) for m, o in zip(members, outs)})
        for ks, block in zip(wanted, blocks):
            if ks:
                given.update(read_block(graph, [members[k].output for k in ks], block))
    cls = type(model) if type(model).__name__ not in ("Functional", "Sequential") else tf.keras.Model
    new = replay(graph, {m.index for _, members in fused for m in members}, given, cls=cls, suffix="fused")
    keep_state_keys(new, keys)
    return new, lines


def read_block(graph, outputs: list[int], block) -> dict[int, object]:
    """Stacks and concatenations of exactly a fused table's one-hot outputs ``outputs`` (in that
    order), read from its [B, S, dim] ``block`` instead: ``tf.stack(axis=1)`` is the block itself and
    ``Concatenate`` of the [B, dim] rows is the block reshaped to [B, S * dim] - the same values
    without splitting the block into S tensors and joining them again (forward and backward).
    Returns replay's ``given`` for their outputs."""
    given = {}
    for n in graph.nodes:
        if n.operands != outputs or n.attrs.get("axis") != 1 or len(n.outputs) != 1:
            continue
        if n.kind == "stack":
            given[n.output] = lambda look: block
        elif n.kind == "concat":
            width = int(block.shape[1]) * int(block.shape[2])
            reshape = tf.keras.layers.Reshape((width,), name=n.layer.name)
            given[n.output] = lambda look, reshape=reshape: reshape(block)
    return given

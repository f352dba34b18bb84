"""Sequence parallelism (Strategy(sequence_parallel=True)) in one process: its collectives per
block, the streams split along the sequence, its dropout streams and its clear errors. Parity
on gloo and the plan: tests/multiprocess/passes/tp/test_sequence_parallel.py."""

import pytest
import torch

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from graphpar.runtime.single_stage import loss_only
from graphpar.ir import SequenceShard, record
from graphpar.runtime import collectives, ops
from graphpar.passes.tp.rules import DivisibilityError
from tests import helpers
from tests.targets import sp_targets, tp_targets


def _block_collectives(strategy, layers=2):
    """Collective nodes of the training program, per transformer block."""
    x, y = helpers.token_batch(batch=2)
    result = lower_rank(helpers.tiny_gpt(n_layer=layers), strategy, (x,), rank=0, world_size=strategy.world_size,
                        loss_fn=helpers.lm_loss, example_target=y)
    per_block = {}
    for node in loss_only(result.gm, 1).graph.nodes:   # a mean loss: one loss output
        if node.op == "call_function" and node.target in collectives.COLLECTIVES:
            path = record(node).module_path
            block = ".".join(path.split(".")[:2]) if path.startswith("blocks.") else "outside"
            counts = per_block.setdefault(block, {})
            counts[node.target.__name__] = counts.get(node.target.__name__, 0) + 1
    return per_block


def test_collectives_per_block():
    sp = _block_collectives(gp.Strategy(tp=2, sequence_parallel=True))
    tp = _block_collectives(gp.Strategy(tp=2))
    for block in ("blocks.0", "blocks.1"):
        # TP: one forward all-reduce after attention and one after the MLP (reduce_from), their
        # backward conjugates where the block's two regions start (copy_to)
        assert tp[block] == {"copy_to": 2, "reduce_from": 2}
        # SP: each all-reduce becomes a reduce-scatter (backward: all-gather) and each copy_to
        # an all-gather (backward: reduce-scatter); the copy_to left are the backward
        # all-reduces of the weights that see 1/tp of the sequence: ln_1 and ln_2 weight and
        # bias, and the biases of the two row layers
        assert sp[block] == {"gather_to": 2, "reduce_scatter": 2, "copy_to": 6}
    # outside the blocks: the vocab-parallel embedding's reduction becomes a reduce-scatter,
    # the position embeddings are split (scatter_to), the LM head's input gathered, ln_f's
    # weight and bias all-reduced in backward
    assert sp["outside"] == {"vocab_parallel_embedding": 1, "reduce_scatter": 1, "scatter_to": 1, "copy_to": 2,
                             "gather_to": 1, "parallel_cross_entropy": 1}
    assert tp["outside"] == {"vocab_parallel_embedding": 1, "reduce_from": 1, "copy_to": 1,
                             "parallel_cross_entropy": 1}


def test_stream_between_regions_is_split_along_the_sequence():
    x, y = helpers.token_batch(batch=2)
    result = lower_rank(helpers.tiny_gpt(), gp.Strategy(tp=2, sequence_parallel=True), (x,), rank=0, world_size=2,
                        loss_fn=helpers.lm_loss, example_target=y)
    nodes = {n.name: n for n in result.gm.graph.nodes}
    norm = nodes["layer_norm"]
    assert record(norm).spec == SequenceShard(1) and record(norm).value.shape == (2, 8, 32)
    weight, bias = norm.args[2:4]
    assert weight.target is collectives.copy_to and weight.args[0].target == "blocks.0.ln_1.weight"
    assert bias.target is collectives.copy_to and bias.args[0].target == "blocks.0.ln_1.bias"
    (reader,) = [u for u in norm.users if u.target is collectives.gather_to]
    assert record(reader).value.shape == (2, 16, 32)   # the attention sees the whole sequence


def test_gpt2_flattened_stream_is_split_per_sequence():
    """Conv1D runs on [b*s, h]: split per sequence (b blocks), not along the flat dim."""
    x, y = helpers.token_batch(batch=2)
    model, loss_fn = tp_targets.build("hf_gpt2", 2)
    result = lower_rank(model, gp.Strategy(tp=2, sequence_parallel=True), (x,), rank=0, world_size=2,
                        loss_fn=loss_fn, example_target=y)
    scatters = [n for n in result.gm.graph.nodes if n.target is collectives.reduce_scatter]
    flat = [n for n in scatters if len(record(n).value.shape) == 2]
    assert flat and all(record(n).spec == SequenceShard(0, (16, 16)) and n.args[3] == 2 for n in flat)


def test_sequence_length_tp_does_not_divide_is_a_clear_error():
    x, y = helpers.token_batch(batch=2, seq=14)
    with pytest.raises(DivisibilityError, match=r"tp=4\): tp does not divide the sequence length 14 \(dim 1 of "
                                                r"input_0\).*Fix: use a sequence length divisible by 4 \(such as "
                                                r"12 or 16\), or sequence_parallel=False"):
        lower_rank(helpers.tiny_gpt(), gp.Strategy(tp=4, sequence_parallel=True), (x,), rank=0, world_size=4,
                   loss_fn=helpers.lm_loss, example_target=y)


def test_a_model_without_a_sequence_is_a_clear_error():
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8))
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"sequence_parallel=True, tp=2\): no tensor-parallel layer output has "
                                         r"a \[batch, sequence, \.\.\.\].*Fix: use sequence_parallel=False"):
        lower_rank(mlp, gp.Strategy(tp=2, sequence_parallel=True), (x,), rank=0, world_size=2,
                   loss_fn=torch.nn.functional.mse_loss, example_target=torch.randn(4, 8))


def test_dropout_streams_in_the_sequence_region():
    x, y = helpers.token_batch(batch=2)
    streams = {}
    for masks in ("local", "tp_invariant"):
        result = lower_rank(sp_targets.dropout_gpt(), gp.Strategy(tp=2, sequence_parallel=True), (x,), rank=0,
                            world_size=2, loss_fn=helpers.lm_loss, example_target=y, dropout_masks=masks)
        streams[masks] = {n.args[2:] for n in result.gm.graph.nodes if n.target is ops.dropout}
    assert streams == {"local": {("tp_local", None)}, "tp_invariant": {("global", 1)}}

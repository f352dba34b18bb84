"""The split calls of graphpar/runtime/split_backward.py on their own: outside a collecting
forward they are their op, gradients bit for bit; inside one, backward leaves exactly the
weight gradients to WeightGradients.run, which accumulates each parameter once."""
import pytest
import torch
import torch.nn.functional as F

from graphpar.runtime import split_backward as split
from tests import helpers

aten = torch.ops.aten


def _params():
    torch.manual_seed(0)
    return {"w": torch.nn.Parameter(torch.randn(5, 4)), "b": torch.nn.Parameter(torch.randn(5)),
            "table": torch.nn.Parameter(torch.randn(7, 4)), "conv1d": torch.nn.Parameter(torch.randn(5, 3)),
            "mm": torch.nn.Parameter(torch.randn(4, 3)), "input": torch.randn(3, 2, 4, requires_grad=True)}


IDS = torch.randint(0, 7, (3, 2), generator=torch.Generator().manual_seed(1))


def _loss(p, ops):
    """Every op once; the table twice (an embedding and a tied LM head); the bias also through
    a slice (not a parameter there: an input, whose gradient is backward's)."""
    x = ops["embedding"](IDS, p["table"]) + p["input"]                       # (3, 2, 4)
    h = ops["linear"](x, p["w"], p["b"])                                      # (3, 2, 5)
    flat = ops["addmm"](p["b"][:3], h.reshape(6, 5), p["conv1d"])             # (6, 3)
    rows = ops["aten_embedding"](p["table"], IDS.reshape(6))                  # (6, 4)
    head = ops["aten_linear"](rows, p["table"])                               # (6, 7), the tied use
    return flat.pow(2).sum() + ops["mm"](rows, p["mm"]).sum() + head.tanh().sum()


EAGER = {"embedding": F.embedding, "linear": F.linear, "addmm": aten.addmm.default,
         "aten_embedding": aten.embedding.default, "aten_linear": aten.linear.default, "mm": aten.mm.default}
SPLIT = {name: getattr(split, name) for name in EAGER}


def _grads(p):
    return {name: (t.grad.clone() if t.grad is not None else None) for name, t in p.items()}


def test_outside_a_collecting_forward_a_split_call_is_its_op_bit_for_bit():
    eager, ours = _params(), _params()
    _loss(eager, EAGER).backward()
    _loss(ours, SPLIT).backward()
    for name, grad in _grads(eager).items():
        assert torch.equal(_grads(ours)[name], grad), name
    with torch.no_grad():
        assert torch.equal(_loss(ours, SPLIT), _loss(eager, EAGER))


def test_backward_leaves_the_weight_gradients_to_backward_weight():
    eager, ours = _params(), _params()
    _loss(eager, EAGER).backward()
    expected = _grads(eager)
    fired = []
    for name, t in ours.items():
        if name != "input":
            t.register_post_accumulate_grad_hook(lambda t, name=name: fired.append((name, t.grad is not None)))
    queue = split.WeightGradients()
    with queue.collecting(0, 3):
        loss = _loss(ours, SPLIT)
    loss.backward()
    assert queue.pending() == [(0, 3)]
    # backward: the input's gradient, whole and bit for bit (the same formulas); the weights
    # read only by split calls nothing; the bias its share through the slice
    assert torch.equal(ours["input"].grad, expected["input"])
    assert [name for name, grad in _grads(ours).items() if grad is None] == ["w", "table", "conv1d", "mm"]
    torch.testing.assert_close(ours["b"].grad[3:], torch.zeros(2), atol=0, rtol=0)
    fired.clear()
    queue.run(0, 3)
    assert queue.pending() == []
    # each parameter's hook runs once, with its whole gradient (the tied table's two uses summed)
    assert sorted(fired) == [("b", True), ("conv1d", True), ("mm", True), ("table", True), ("w", True)]
    for name, grad in _grads(ours).items():
        # the same products, summed in another order (a parameter's uses are added up here
        # before its .grad, by autograd in eager): float32 rounding, relative ~1e-7
        torch.testing.assert_close(grad, expected[name], atol=1e-5, rtol=1e-6, msg=name)


def test_the_queued_output_gradient_goes_through_the_saved_tensor_hooks():
    params = _params()
    queue = split.WeightGradients()
    saved = helpers.SavedBytes(list(params.values()))
    with saved.counting():
        with queue.collecting(1, 0):
            out = split.linear(torch.randn(8, 4), params["w"], params["b"])
        held_after_forward = saved.held()   # the input the weight gradient needs: 8 x 4 floats
        out.backward(torch.ones(8, 5))
        assert saved.held() == held_after_forward + 8 * 5 * 4   # and the output gradient
        queue.run(1, 0)
        assert saved.held() == 0
    assert held_after_forward == 8 * 4 * 4


def test_evaluation_and_frozen_weights_run_the_op_alone():
    params = _params()
    with torch.no_grad():
        assert split.linear(torch.randn(2, 4), params["w"]).grad_fn is None
    frozen = torch.nn.Parameter(torch.randn(5, 4), requires_grad=False)
    x = torch.randn(2, 4, requires_grad=True)
    queue = split.WeightGradients()
    with queue.collecting(0, 0):
        out = split.linear(x, frozen)
    assert type(out.grad_fn).__name__ != "BackwardCFunction"   # no split: nothing to defer
    out.sum().backward()
    assert queue.pending() == []


def test_split_parameters_names_what_backward_weight_accumulates():
    gm = torch.fx.symbolic_trace(_Tiny())
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in split.SPLIT_OF:
            node.target = split.SPLIT_OF[node.target]
    gm.recompile()
    assert {id(p) for p in split.split_parameters(gm)} == {id(gm.fc.weight), id(gm.fc.bias), id(gm.emb.weight)}


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)
        self.fc = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, ids):
        return self.norm(F.linear(F.embedding(ids, self.emb.weight), self.fc.weight, self.fc.bias))


@pytest.mark.parametrize("name", sorted(SPLIT))
def test_every_split_call_is_importable_by_generated_code(name):
    fn = SPLIT[name]
    assert fn.__module__ == "graphpar.runtime.split_backward" and getattr(split, fn.__qualname__) is fn

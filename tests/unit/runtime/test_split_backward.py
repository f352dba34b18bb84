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


def _eager_and_split(call_eager, call_split, inputs, steps=3):
    """`steps` microbatches through the eager op and through the split call (each microbatch's
    weight gradients run as backward_weight): (eager tensors, split tensors, B's input gradients
    of the first microbatch, eager and split, before any weight gradient ran)."""
    eager = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    ours = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
    eager = [torch.nn.Parameter(t) if isinstance(s, torch.nn.Parameter) else t for t, s in zip(eager, inputs)]
    ours = [torch.nn.Parameter(t) if isinstance(s, torch.nn.Parameter) else t for t, s in zip(ours, inputs)]
    queue = split.WeightGradients()
    first = None
    for mb in range(steps):
        out = call_eager(*eager)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(mb))
        out.backward(grad)
        with queue.collecting(0, mb):
            mine = call_split(*ours)
        assert torch.equal(mine, call_eager(*eager).detach())   # forward: the op itself
        mine.backward(grad)
        if first is None:
            first = [(e.grad.clone(), o.grad.clone()) for e, o in zip(eager, ours)
                     if not isinstance(e, torch.nn.Parameter) and e.requires_grad]
        queue.run(0, mb)
    return eager, ours, first


def _column_major(rows, cols):
    return torch.randn(cols, rows).t()


LAYOUTS = {
    "linear 3-d input": (F.linear, split.linear, lambda: [torch.randn(3, 2, 4, requires_grad=True),
                                                          torch.nn.Parameter(torch.randn(5, 4)),
                                                          torch.nn.Parameter(torch.randn(5))]),
    "linear 1-d input": (F.linear, split.linear, lambda: [torch.randn(4, requires_grad=True),
                                                          torch.nn.Parameter(torch.randn(5, 4)),
                                                          torch.nn.Parameter(torch.randn(5))]),
    "linear column-major input": (F.linear, split.linear, lambda: [_column_major(6, 4).requires_grad_(),
                                                                   torch.nn.Parameter(torch.randn(5, 4))]),
    "linear column-major weight": (F.linear, split.linear, lambda: [torch.randn(6, 4, requires_grad=True),
                                                                    torch.nn.Parameter(_column_major(5, 4))]),
    "linear 1-d weight": (F.linear, split.linear, lambda: [torch.randn(2, 3, 4, requires_grad=True),
                                                           torch.nn.Parameter(torch.randn(4))]),
    "addmm column-major input": (aten.addmm.default, split.addmm,
                                 lambda: [torch.nn.Parameter(torch.randn(3)), _column_major(6, 5).requires_grad_(),
                                          torch.nn.Parameter(torch.randn(5, 3))]),
    "mm column-major weight": (aten.mm.default, split.mm, lambda: [torch.randn(6, 5, requires_grad=True),
                                                                   torch.nn.Parameter(_column_major(5, 3))]),
}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_hand_computed_gradients_are_autograds(case):
    """B and W compute autograd's formulas for the op in autograd's layouts: the input's
    gradient bit for bit, the weights' (accumulated over microbatches into .grad by the
    product itself, addmm_, where autograd adds a finished product) to float32 rounding."""
    torch.manual_seed(0)
    eager_op, split_op, make = LAYOUTS[case]
    eager, ours, first = _eager_and_split(eager_op, split_op, make())
    for e, o in first:
        assert torch.equal(o, e)
    for e, o in zip(eager, ours):
        if e.requires_grad:
            # 3 microbatches of products of O(1) values over <= 6 rows: a few float32 roundings
            torch.testing.assert_close(o.grad, e.grad, atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("kwargs", [{}, {"padding_idx": 2}, {"padding_idx": -1}, {"scale_grad_by_freq": True},
                                    {"padding_idx": 2, "scale_grad_by_freq": True}], ids=str)
def test_embedding_rows_are_added_where_they_go(kwargs):
    """The table's gradient added row by row (index_add_) or, scaled by frequency, as
    embedding_backward's table: autograd's values, the padding row left without gradient."""
    ids = torch.tensor([[2, 0, 6], [2, 2, 5]])   # repeated ids, the padding row and the last row
    table = torch.nn.Parameter(torch.randn(7, 4))
    eager, ours, _ = _eager_and_split(lambda t: F.embedding(ids, t, **kwargs),
                                      lambda t: split.embedding(ids, t, **kwargs), [table])
    # a row's gradient sums up to 2 x 3 values of O(1) per microbatch: float32 rounding
    torch.testing.assert_close(ours[0].grad, eager[0].grad, atol=1e-5, rtol=1e-6)
    padding = kwargs.get("padding_idx", None)
    if padding is not None:
        assert not ours[0].grad[padding].any()
    aten_padding = {None: -1, -1: 6}.get(padding, padding)
    eager, ours, _ = _eager_and_split(
        lambda t: aten.embedding.default(t, ids, aten_padding, kwargs.get("scale_grad_by_freq", False)),
        lambda t: split.aten_embedding(t, ids, aten_padding, kwargs.get("scale_grad_by_freq", False)), [table])
    torch.testing.assert_close(ours[0].grad, eager[0].grad, atol=1e-5, rtol=1e-6)


def test_later_microbatches_accumulate_in_place_and_run_the_hooks_once_per_parameter():
    """From the second microbatch on, .grad is the same tensor, added to where the products are
    computed; every parameter's post-accumulate hook (data-parallel buckets count them) runs
    once per backward_weight, with the whole gradient so far, the tied table's two uses summed."""
    eager, ours = _params(), _params()
    fired = []
    for name, t in ours.items():
        if name != "input":
            # (backward calls them too, for the split weights with no gradient: see above)
            t.register_post_accumulate_grad_hook(
                lambda t, name=name: fired.append((name, None if t.grad is None else t.grad.clone())))
    queue = split.WeightGradients()
    storages = {}
    for mb in range(3):
        _loss(eager, EAGER).backward()
        with queue.collecting(0, mb):
            loss = _loss(ours, SPLIT)
        loss.backward()
        fired.clear()
        queue.run(0, mb)
        assert sorted(name for name, _ in fired) == ["b", "conv1d", "mm", "table", "w"]
        for name, grad in fired:
            torch.testing.assert_close(grad, eager[name].grad, atol=1e-5, rtol=1e-6, msg=name)   # as above
            storages.setdefault(name, ours[name].grad.data_ptr())
            assert ours[name].grad.data_ptr() == storages[name], name   # accumulated in place


def test_hooked_and_low_precision_weights_are_accumulated_by_autograd():
    """A parameter with a gradient hook (it sees each gradient before it is accumulated) and a
    bf16 weight whose gradient is kept in fp32 (grad_dtype) take autograd's way, as before."""
    def doubled(p):
        # (split, backward hands the hook the weight's missing gradient: None)
        p.register_hook(lambda g: None if g is None else 2 * g)
        return p

    def build():
        torch.manual_seed(0)
        low = torch.nn.Parameter(torch.randn(5, 4, dtype=torch.bfloat16))
        low.grad_dtype = torch.float32
        return [torch.randn(6, 4, requires_grad=True), doubled(torch.nn.Parameter(torch.randn(5, 4))),
                torch.randn(6, 4, dtype=torch.bfloat16), low]

    eager, ours = build(), build()
    queue = split.WeightGradients()
    for mb in range(2):
        (F.linear(eager[0], eager[1]).sum() + F.linear(eager[2], eager[3]).float().sum()).backward()
        with queue.collecting(0, mb):
            loss = split.linear(ours[0], ours[1]).sum() + split.linear(ours[2], ours[3]).float().sum()
        loss.backward()
        queue.run(0, mb)
    assert ours[3].grad.dtype == torch.float32
    for e, o in zip(eager, ours):
        if e.grad is not None:
            # the same bf16 / fp32 products, summed over two microbatches in the same order
            torch.testing.assert_close(o.grad, e.grad, atol=1e-5, rtol=1e-6)


def test_a_gradient_that_is_the_output_gradient_itself_is_copied_before_it_becomes_grad():
    """A full-size addmm bias's gradient is the output gradient itself, which other calls (the
    same bias read twice, a matmul on the same sum) still read: it becomes .grad as a copy."""
    def build():
        torch.manual_seed(0)
        return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5, 3)),
                torch.nn.Parameter(torch.randn(5, 3)), torch.randn(4, 5, requires_grad=True)]

    def loss(ops, bias, w, w2, x):
        return ops["addmm"](bias, x, w) + ops["addmm"](bias, x, w2) + ops["mm"](x, w2)

    eager, ours = build(), build()
    grad = torch.randn(4, 3)
    loss(EAGER, *eager).backward(grad)
    queue = split.WeightGradients()
    with queue.collecting(0, 0):
        out = loss(SPLIT, *ours)
    out.backward(grad)
    queue.run(0, 0)
    for e, o in zip(eager, ours):
        # the same products, a weight's two uses summed in another order: float32 rounding
        torch.testing.assert_close(o.grad, e.grad, atol=1e-5, rtol=1e-6)
    assert ours[0].grad.data_ptr() != grad.data_ptr()

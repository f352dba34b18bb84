"""Weight gradients as work of their own: the run-time half of passes/split_backward.py.

Under a schedule that splits backward (graphpar.strategy.SPLIT_BACKWARD: zero-bubble, zbv),
the pass turns each call of a layer reading a trainable parameter whose weight gradient can
be computed on its own into a call of the function here of the same name, with the same
arguments:

    before: linear_4 = linear(layer_norm_1, blocks_0_mlp_fc_weight, blocks_0_mlp_fc_bias)
    after:  linear_4 = graphpar.runtime.split_backward.linear(layer_norm_1, blocks_0_mlp_fc_weight,
                                                              blocks_0_mlp_fc_bias)

In a forward the pipeline executor runs to collect weight gradients (`WeightGradients.
collecting`, split schedules only) such a call runs under `_Split`, an autograd Function
that runs the op and keeps what its gradients read, packed by the saved-tensor hooks in
effect (for a linear layer its input, and its weight when the input needs a gradient):

    backward (B)          the gradient of the call's other inputs only, the critical path to
                          the previous stage; the output gradient, packed by the same hooks,
                          is queued with the saved input under the (stage, microbatch) whose
                          forward made the call
    backward_weight (W)   `WeightGradients.run(stage, mb)`: each queued call's weight
                          gradients added into the parameters' `.grad`, by the product itself
                          (`grad.addmm_(g.T, x)`; an embedding's rows `index_add_`ed where
                          they go), then each parameter's post-accumulate-grad hooks
                          (data-parallel buckets, the host update) run once, as autograd runs
                          them after it accumulates

Both are computed by hand, with autograd's own formulas for the op (torch's derivatives of
mm, addmm and embedding, in the layouts autograd picks), so their values are those of the
unsplit program's backward (B's bit for bit; W's to float32 rounding, the product and the
sum being one operation), without a second autograd graph per call: the first version held
the op as a small graph of its own and ran `autograd.grad` on it twice (B with
retain_graph, then W), then handed the summed gradients to `autograd.backward`. On the
benchmark's CPU a stage's step cost 1.24-1.29x the unsplit one's CPU time that way, 1.07x
this way (1.12-1.13x with each W one backward late; benchmarks/README.md, "What the split
backward costs"). A weight several calls read (a
tied embedding and LM head) gets each call's gradient once, added into the same `.grad`.
Where `.grad` is not there yet (a step's first microbatch) the gradient becomes it; a
parameter with a gradient hook (which must see each gradient before it is accumulated) or
whose gradient is accumulated in another dtype (fp32 for bf16 weights) is accumulated by
autograd (`torch.autograd.backward`), as before.

A call made outside a collecting forward (schedules that do not split, gp.verify's runs of
a program, fake-tensor runs), in evaluation (no gradient recording), or whose weights need
no gradient runs the op itself.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.fx
import torch.nn.functional as F

from graphpar.ir import fetch_attr
from graphpar.runtime.grad_sync import grad_dtype

aten = torch.ops.aten
_binding = threading.local()   # .target: (queue, key), where the forward running now queues its calls


@dataclass
class _Work:
    """One call's weight gradients, pending: the rule of its op, the tensors its weight
    gradients read (packed by the saved-tensor hooks of its forward), the parameters at the
    weight positions, and the packed output gradient."""
    rule: "_Rule"
    call: "_Call"
    packed: Dict[int, Any]
    params: Dict[int, torch.Tensor]
    packed_grad: Any
    unpack: Callable[[Any], torch.Tensor]


class WeightGradients:
    """The weight-gradient work of one executor's step, by (stage, microbatch)."""

    def __init__(self):
        self._pending: Dict[Tuple[int, int], List[_Work]] = {}

    @contextlib.contextmanager
    def collecting(self, stage: int, mb: int):
        """Calls made by the forward in the block queue their weight gradients under (stage, mb)."""
        previous = getattr(_binding, "target", None)
        _binding.target = (self, (stage, mb))
        try:
            yield
        finally:
            _binding.target = previous

    def add(self, key: Tuple[int, int], work: _Work) -> None:
        self._pending.setdefault(key, []).append(work)

    def run(self, stage: int, mb: int) -> None:
        """Accumulate the weight gradients queued under (stage, mb) into the parameters."""
        through_autograd: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        in_place: Dict[int, torch.Tensor] = {}
        with torch.no_grad():
            # last queued first: backward queued the calls from the stage's end to its start, so
            # the output gradients it made last are the ones still in the caches
            for work in reversed(self._pending.pop((stage, mb), [])):
                grad = work.unpack(work.packed_grad)
                saved = {i: work.unpack(packed) for i, packed in work.packed.items()}
                for i, param in work.params.items():
                    if not _accumulates_in_place(param, grad.dtype):
                        # summed in p.grad's dtype (fp32 for bf16 weights), as autograd sums a weight's uses
                        found = work.rule.grads(grad, saved, work.call, {i})[i].to(grad_dtype(param))
                        earlier = through_autograd.get(id(param))
                        through_autograd[id(param)] = (param, found if earlier is None else earlier[1] + found)
                    elif param.grad is None:
                        param.grad = _own(param, work.rule.grads(grad, saved, work.call, {i})[i], grad)
                        in_place[id(param)] = param
                    else:
                        work.rule.accumulate(i, param.grad, grad, saved, work.call)
                        in_place[id(param)] = param
        if through_autograd:
            params, grads = zip(*through_autograd.values())
            torch.autograd.backward(list(params), list(grads))
        for param in in_place.values():
            _post_accumulate(param)

    def pending(self) -> List[Tuple[int, int]]:
        return sorted(self._pending)

    def clear(self) -> None:
        """Drop what a failed step left queued."""
        self._pending.clear()


def _accumulates_in_place(param: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a weight gradient may be accumulated here, into `param.grad` where it is
    computed (the product adding into it: `addmm_`), rather than by autograd: gradients of the
    product's dtype (not the fp32 sums of bf16 weights) and no hook that would change a
    gradient before it is accumulated."""
    grad = param.grad
    return (grad_dtype(param) == dtype and (grad is None or grad.layout == torch.strided)
            and not param._backward_hooks)


def _own(param: torch.Tensor, found: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A first gradient as autograd stores it: itself when it is a tensor of its own in the
    parameter's layout, else a copy in that layout (a bias's gradient may be the output
    gradient itself, which other calls' weight gradients may still read)."""
    if found.stride() == param.stride() and found.untyped_storage().data_ptr() != grad.untyped_storage().data_ptr():
        return found
    return torch.empty_like(param).copy_(found)


def _post_accumulate(param: torch.Tensor) -> None:
    """Run the parameter's post-accumulate-grad hooks (data-parallel buckets), as autograd runs
    them after it accumulates a gradient."""
    for hook in list((param._post_accumulate_grad_hooks or {}).values()):
        hook(param)


def _collecting() -> Optional[Tuple[WeightGradients, Tuple[int, int]]]:
    return getattr(_binding, "target", None)


def _saved_tensor_hooks() -> Tuple[Callable, Callable]:
    """The saved-tensor hooks in effect now (identity without any)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    return hooks if hooks is not None else (_identity, _identity)


def _identity(t):
    return t


# ---- the ops' gradients, by hand -------------------------------------------------------
# autograd's own formulas for these ops (torch's derivatives of mm, addmm and embedding, and
# linear as autograd runs it: addmm / mm on input.reshape(-1, in)), in the layouts autograd
# picks, so that B and W each compute their share alone, with no graph of their own, and the
# values are those of the unsplit op's backward.

def _column_major(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.shape[0] > 1 and t.stride(0) == 1 and t.stride(1) == t.shape[0]


def _row_major(t: torch.Tensor) -> bool:
    """Whether t.T is column-major."""
    return t.dim() == 2 and t.shape[1] > 1 and t.stride(1) == 1 and t.stride(0) == t.shape[1]


def _mat1_grad(grad: torch.Tensor, mat2: torch.Tensor, mat1_column_major: bool) -> torch.Tensor:
    """d(mat1 @ mat2)/d mat1 applied to grad, in mat1's layout."""
    return mat2.mm(grad.t()).t() if mat1_column_major else grad.mm(mat2.t())


def _mat2_grad(grad: torch.Tensor, mat1: torch.Tensor, mat2_column_major: bool) -> torch.Tensor:
    """d(mat1 @ mat2)/d mat2 applied to grad, in mat2's layout."""
    return grad.t().mm(mat1).t() if mat2_column_major else mat1.t().mm(grad)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """linear's input as the matrix it multiplies: its rows, the last dim kept."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _scaled(t: torch.Tensor, factor) -> torch.Tensor:
    return t if factor == 1 else t * factor


@dataclass(frozen=True)
class _Call:
    """What one call's gradients read besides its saved tensors: its other arguments (by
    position, and keywords), the shapes of its tensor arguments and which of the matrices it
    multiplies are column-major."""
    scalars: Dict[int, Any]
    kwargs: Dict[str, Any]
    shapes: Dict[int, torch.Size]
    column_major: Dict[int, bool]

    def argument(self, name: str, position: int, default):
        return self.scalars.get(position, self.kwargs.get(name, default))


class _Rule:
    """An op whose gradients are computed by hand. `reads[i]`: the arguments the gradient of
    argument i reads (saved in forward when that gradient is wanted); `grads(grad, saved,
    call, wanted)`: the gradients of the positions in `wanted`, from the output gradient and
    the saved arguments (position -> tensor)."""
    reads: Dict[int, Tuple[int, ...]] = {}

    @staticmethod
    def column_major(args: Sequence[Any]) -> Dict[int, bool]:
        """Which of the matrices the op multiplies are column-major, by argument."""
        return {}

    @staticmethod
    def grads(grad, saved, call: _Call, wanted) -> Dict[int, torch.Tensor]:
        raise NotImplementedError

    @classmethod
    def accumulate(cls, i: int, into: torch.Tensor, grad, saved, call: _Call) -> None:
        """`into += the gradient of argument i`."""
        into.add_(cls.grads(grad, saved, call, {i})[i])


class _Linear(_Rule):
    """linear(input, weight, bias): input @ weight.T + bias (a 1-d weight: one output feature,
    dropped from the output's shape)."""
    reads = {0: (1,), 1: (0,), 2: ()}

    @staticmethod
    def column_major(args):
        x = args[0]
        # the input's rows: a contiguous input's are row-major (what reshape makes of the others is looked at)
        return {0: not x.is_contiguous() and _column_major(_rows(x)), 1: _row_major(args[1])}

    @staticmethod
    def grads(grad, saved, call, wanted):
        g = grad.reshape(-1, _out_features(call))
        out = {}
        if 0 in wanted:
            weight = _weight_matrix(saved[1])
            out[0] = _mat1_grad(g, weight.t(), call.column_major[0]).reshape(call.shapes[0])
        if 1 in wanted:
            out[1] = _mat2_grad(g, _rows(saved[0]), call.column_major[1]).t().reshape(call.shapes[1])
        if 2 in wanted:
            out[2] = g.sum_to_size(call.shapes[2]) if len(call.shapes[2]) else g.sum()
        return out

    @classmethod
    def accumulate(cls, i, into, grad, saved, call):
        if i == 1:   # weight += grad.T @ input, in one product
            _weight_matrix(into).addmm_(grad.reshape(-1, _out_features(call)).t(), _rows(saved[0]))
        else:
            super().accumulate(i, into, grad, saved, call)


def _weight_matrix(weight: torch.Tensor) -> torch.Tensor:
    return weight if weight.dim() == 2 else weight.view(1, -1)


def _out_features(call: _Call) -> int:
    return call.shapes[1][0] if len(call.shapes[1]) == 2 else 1


class _Addmm(_Rule):
    """aten.addmm(bias, mat1, mat2, beta=1, alpha=1): beta * bias + alpha * mat1 @ mat2."""
    reads = {0: (), 1: (2,), 2: (1,)}

    @staticmethod
    def column_major(args):
        return {1: _column_major(args[1]), 2: _column_major(args[2])}

    @staticmethod
    def grads(grad, saved, call, wanted):
        beta, alpha = call.kwargs.get("beta", 1), call.kwargs.get("alpha", 1)   # keyword-only
        out = {}
        if 0 in wanted:
            out[0] = _scaled(grad, beta).sum_to_size(call.shapes[0])
        if 1 in wanted:
            out[1] = _scaled(_mat1_grad(grad, saved[2], call.column_major[1]), alpha)
        if 2 in wanted:
            out[2] = _scaled(_mat2_grad(grad, saved[1], call.column_major[2]), alpha)
        return out

    @classmethod
    def accumulate(cls, i, into, grad, saved, call):
        if i == 2:   # weight += alpha * mat1.T @ grad, in one product
            into.addmm_(saved[1].t(), grad, alpha=call.kwargs.get("alpha", 1))
        else:
            super().accumulate(i, into, grad, saved, call)


class _Mm(_Rule):
    """aten.mm(mat1, mat2)."""
    reads = {0: (1,), 1: (0,)}

    @staticmethod
    def column_major(args):
        return {0: _column_major(args[0]), 1: _column_major(args[1])}

    @staticmethod
    def grads(grad, saved, call, wanted):
        out = {}
        if 0 in wanted:
            out[0] = _mat1_grad(grad, saved[1], call.column_major[0])
        if 1 in wanted:
            out[1] = _mat2_grad(grad, saved[0], call.column_major[1])
        return out

    @classmethod
    def accumulate(cls, i, into, grad, saved, call):
        into.addmm_(saved[0].t(), grad)   # weight += mat1.T @ grad, in one product


class _Embedding(_Rule):
    """F.embedding(ids, table, padding_idx=None, max_norm=None, norm_type=2, scale_grad_by_freq=False,
    sparse=False) (the pass splits it only without max_norm and sparse): all of its backward
    is the table's gradient, each id's row of the output gradient added to the id's row."""
    table, ids = 1, 0
    reads = {1: (0,)}

    @staticmethod
    def padding_idx(call: _Call) -> int:
        """aten's padding_idx: F.embedding's None is -1 (none), a negative index counts from the end."""
        padding_idx, rows = call.argument("padding_idx", 2, None), call.shapes[1][0]
        return -1 if padding_idx is None else padding_idx + rows if padding_idx < 0 else padding_idx

    @staticmethod
    def scale_grad_by_freq(call: _Call) -> bool:
        return call.argument("scale_grad_by_freq", 5, False)

    @classmethod
    def grads(cls, grad, saved, call, wanted):
        return {cls.table: aten.embedding_backward.default(
            grad, saved[cls.ids], call.shapes[cls.table][0], cls.padding_idx(call), cls.scale_grad_by_freq(call),
            False)}

    @classmethod
    def accumulate(cls, i, into, grad, saved, call):
        if cls.scale_grad_by_freq(call):
            super().accumulate(i, into, grad, saved, call)
            return
        # the rows added where they go, instead of a table-sized gradient added to the table's
        ids = saved[cls.ids].reshape(-1)
        rows = grad.reshape(ids.numel(), -1)
        padding_idx = cls.padding_idx(call)
        if padding_idx >= 0:   # the padding row gets no gradient
            keep = ids != padding_idx
            ids, rows = ids[keep], rows[keep]
        into.index_add_(0, ids, rows)


class _AtenEmbedding(_Embedding):
    """aten.embedding(table, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False)."""
    table, ids = 0, 1
    reads = {0: (1,)}

    @staticmethod
    def padding_idx(call: _Call) -> int:
        return call.argument("padding_idx", 2, -1)

    @staticmethod
    def scale_grad_by_freq(call: _Call) -> bool:
        return call.argument("scale_grad_by_freq", 3, False)


class _Split(torch.autograd.Function):
    """One call with its weight gradients split off (module docstring). The weights are not
    inputs of the Function when another argument needs a gradient: backward has none to give
    them, and autograd would still visit each weight's accumulator with an empty one."""

    @staticmethod
    def forward(ctx, op, rule, kwargs, weights, target, hidden, *args):
        args = [hidden.get(i, a) for i, a in enumerate(args)] if hidden else args
        pack, ctx.unpack = _saved_tensor_hooks()
        needs = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        ctx.packed = {j: pack(args[j]) for j in {j for i in needs for j in rule.reads.get(i, ())}}
        ctx.call = _Call({i: a for i, a in enumerate(args) if not isinstance(a, torch.Tensor)}, kwargs,
                         {i: a.shape for i, a in enumerate(args) if isinstance(a, torch.Tensor)},
                         rule.column_major(args))
        ctx.rule, ctx.weights, ctx.target, ctx.pack = rule, weights, target, pack
        ctx.inputs = [i for i in needs if i not in weights]
        ctx.params = {i: args[i] for i in weights}
        ctx.count = len(args)
        return op(*args)

    @staticmethod
    def backward(ctx, grad):
        wanted = set(ctx.inputs)
        saved = {j: ctx.unpack(ctx.packed[j]) for i in wanted for j in ctx.rule.reads[i]}
        found = ctx.rule.grads(grad, saved, ctx.call, wanted) if wanted else {}
        queue, key = ctx.target
        weight_reads = {j: ctx.packed[j] for i in ctx.weights for j in ctx.rule.reads[i]}
        queue.add(key, _Work(ctx.rule, ctx.call, weight_reads, ctx.params, ctx.pack(grad), ctx.unpack))
        ctx.packed = ctx.params = None
        return (None,) * 6 + tuple(found.get(i) for i in range(ctx.count))


def _call(op, rule, weight_positions: Sequence[int], args: Sequence[Any], kwargs: Dict[str, Any]):
    """`op(*args, **kwargs)`, its weights (the arguments at `weight_positions` that are
    trainable leaves: parameters) split off when a collecting forward records it."""
    run = functools.partial(op, **kwargs) if kwargs else op
    target = _collecting()
    if target is None or not torch.is_grad_enabled():
        return run(*args)
    weights = tuple(i for i in weight_positions if i < len(args) and isinstance(args[i], torch.Tensor)
                    and args[i].requires_grad and args[i].is_leaf)
    if not weights:
        return run(*args)
    if any(isinstance(a, torch.Tensor) and a.requires_grad for i, a in enumerate(args) if i not in weights):
        hidden = {i: args[i] for i in weights}
        args = [None if i in hidden else a for i, a in enumerate(args)]
    else:
        hidden = {}
    return _Split.apply(run, rule, kwargs, weights, target, hidden, *args)


def _splitting(name: str, op, rule, weights: Tuple[int, ...], doc: str):
    """The function standing for `op` in rewritten graphs: `op`'s signature, the positional
    arguments at `weights` split off as weights (the others are inputs, whose gradients are
    B's). Named as a module attribute, so that generated graph code imports it."""
    def call(*args, **kwargs):
        return _call(op, rule, weights, args, kwargs)
    call.__name__ = call.__qualname__ = name
    call.__module__ = __name__
    call.__doc__ = doc
    call.weights = weights
    return call


linear = _splitting("linear", F.linear, _Linear, (1, 2), "F.linear(input, weight, bias)")
aten_linear = _splitting("aten_linear", aten.linear.default, _Linear, (1, 2), "aten.linear(input, weight, bias)")
addmm = _splitting("addmm", aten.addmm.default, _Addmm, (0, 2),
                   "aten.addmm(bias, input, weight): GPT-2's Conv1D, its weight stored (in, out)")
mm = _splitting("mm", aten.mm.default, _Mm, (1,), "aten.mm(input, weight): a row-parallel Conv1D's local matmul (its "
                "bias is added after the all-reduce, passes/rewrite_parallel_layers.py)")
embedding = _splitting("embedding", F.embedding, _Embedding, (1,),
                       "F.embedding(ids, table, ...): all of its backward is the weight gradient")
aten_embedding = _splitting("aten_embedding", aten.embedding.default, _AtenEmbedding, (0,),
                            "aten.embedding(table, ids, ...)")

# the function standing for each op passes/split_backward.py rewrites
SPLIT_OF = {F.linear: linear, aten.linear.default: aten_linear, aten.addmm.default: addmm, aten.mm.default: mm,
            F.embedding: embedding, aten.embedding.default: aten_embedding}


def trainable_parameter(gm: torch.fx.GraphModule, arg) -> Optional[torch.nn.Parameter]:
    """The parameter a graph argument reads, if it is a get_attr of one that trains."""
    if not (isinstance(arg, torch.fx.Node) and arg.op == "get_attr"):
        return None
    value = fetch_attr(gm, arg.target)
    return value if isinstance(value, torch.nn.Parameter) and value.requires_grad else None


def split_parameters(gm: torch.fx.GraphModule) -> List[torch.nn.Parameter]:
    """The parameters whose gradient (all or part of it) the program's split calls leave to
    backward_weight: the trainable weights they read."""
    found: Dict[int, torch.nn.Parameter] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _FUNCTIONS:
            for i in node.target.weights:
                param = trainable_parameter(gm, node.args[i]) if i < len(node.args) else None
                if param is not None:
                    found[id(param)] = param
    return list(found.values())


_FUNCTIONS = frozenset(SPLIT_OF.values())

__all__ = ["WeightGradients", "SPLIT_OF", "split_parameters", "trainable_parameter", "linear", "aten_linear", "addmm",
           "mm", "embedding", "aten_embedding"]

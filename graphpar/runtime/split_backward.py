"""Weight gradients as work of their own: the run-time half of passes/split_backward.py.

Under a schedule that splits backward (graphpar.strategy.SPLIT_BACKWARD: zero-bubble, zbv),
the pass turns each call of a layer reading a trainable parameter whose weight gradient can
be computed on its own into a call of the function here of the same name, with the same
arguments:

    before: linear_4 = linear(layer_norm_1, blocks_0_mlp_fc_weight, blocks_0_mlp_fc_bias)
    after:  linear_4 = graphpar.runtime.split_backward.linear(layer_norm_1, blocks_0_mlp_fc_weight,
                                                              blocks_0_mlp_fc_bias)

In a training forward such a call runs under `_Split`, an autograd Function holding the op
itself as a small autograd graph of its own, on detached copies of its arguments (which
keeps what the op's backward needs: for a linear layer its input):

    backward (B)          the gradient of the call's other inputs only, the critical path to
                          the previous stage; the output gradient and the small graph are
                          queued under the (stage, microbatch) whose forward made the call
    backward_weight (W)   `WeightGradients.run(stage, mb)`: each queued call's weight
                          gradients from its small graph, summed per parameter, then handed
                          to autograd (`torch.autograd.backward` on the parameters), which
                          accumulates them into `.grad` and runs the parameters' hooks
                          (data-parallel buckets, the host update) as for any backward

The gradients are autograd's own formulas for the op, so they are those of the unsplit
program. A weight several calls read (a tied embedding and LM head) gets each call's
gradient once: they are summed, never counted twice. The queued output gradient is packed
by the saved-tensor hooks in effect where the forward ran, as autograd packs what it saves
(zero=3's recipes pass it on, a measurement counts it, `save_on_cpu` moves it).

A call made outside a collecting forward (schedules that do not split, gp.verify's runs of
a program, fake-tensor runs) returns its weight gradients from its backward: autograd
accumulates them at once, as for the original op. Evaluation (no gradient recording) and
calls whose weights need no gradient run the op itself.
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
_binding = threading.local()   # .queue, .key: where the forward running now queues its calls


@dataclass
class _Work:
    """One call's weight gradients, pending: its small graph, the detached weights it was
    built on, the parameters they stand for, and the packed output gradient."""
    output: torch.Tensor
    leaves: List[torch.Tensor]
    params: List[torch.Tensor]
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
        summed: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        for work in self._pending.pop((stage, mb), []):
            grads = torch.autograd.grad(work.output, work.leaves, work.unpack(work.packed_grad), allow_unused=True)
            for param, grad in zip(work.params, grads):
                if grad is not None:
                    # summed in p.grad's dtype (fp32 for bf16 weights), as autograd sums a weight's uses
                    grad = grad.to(grad_dtype(param))
                    earlier = summed.get(id(param))
                    summed[id(param)] = (param, grad if earlier is None else earlier[1] + grad)
        if summed:
            params, grads = zip(*summed.values())
            torch.autograd.backward(list(params), list(grads))

    def pending(self) -> List[Tuple[int, int]]:
        return sorted(self._pending)

    def clear(self) -> None:
        """Drop what a failed step left queued."""
        self._pending.clear()


def _collecting() -> Optional[Tuple[WeightGradients, Tuple[int, int]]]:
    return getattr(_binding, "target", None)


def _saved_tensor_hooks() -> Tuple[Callable, Callable]:
    """The saved-tensor hooks in effect now (identity without any)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    return hooks if hooks is not None else (_identity, _identity)


def _identity(t):
    return t


class _Split(torch.autograd.Function):
    """One call with its weight gradients split off (module docstring)."""

    @staticmethod
    def forward(ctx, op, weights: Tuple[int, ...], target, *args):
        leaves = [a.detach().requires_grad_(i in weights or a.requires_grad) if isinstance(a, torch.Tensor) else a
                  for i, a in enumerate(args)]
        with torch.enable_grad():
            output = op(*leaves)
        ctx.output, ctx.leaves, ctx.weights, ctx.target = output, leaves, weights, target
        ctx.params = [args[i] for i in weights]
        ctx.hooks = _saved_tensor_hooks()
        return output.detach()

    @staticmethod
    def backward(ctx, grad):
        inputs = [i for i, a in enumerate(ctx.leaves)
                  if isinstance(a, torch.Tensor) and a.requires_grad and i not in ctx.weights]
        wanted = inputs if ctx.target is not None else inputs + list(ctx.weights)
        found = torch.autograd.grad(ctx.output, [ctx.leaves[i] for i in wanted], grad,
                                    retain_graph=ctx.target is not None, allow_unused=True) if wanted else ()
        if ctx.target is not None:
            queue, key = ctx.target
            pack, unpack = ctx.hooks
            queue.add(key, _Work(ctx.output, [ctx.leaves[i] for i in ctx.weights], ctx.params, pack(grad), unpack))
        grads: List[Optional[torch.Tensor]] = [None] * len(ctx.leaves)
        for i, g in zip(wanted, found):
            grads[i] = g
        ctx.output = ctx.leaves = ctx.params = None
        return (None, None, None, *grads)


def _call(op, weight_positions: Sequence[int], args: Sequence[Any], kwargs: Dict[str, Any]):
    """`op(*args, **kwargs)`, its weights (the arguments at `weight_positions` that are
    trainable leaves: parameters) split off when autograd records."""
    run = functools.partial(op, **kwargs) if kwargs else op
    weights = tuple(i for i in weight_positions if i < len(args) and isinstance(args[i], torch.Tensor)
                    and args[i].requires_grad and args[i].is_leaf)
    if not weights or not torch.is_grad_enabled():
        return run(*args)
    return _Split.apply(run, weights, _collecting(), *args)


def _splitting(name: str, op, weights: Tuple[int, ...], doc: str):
    """The function standing for `op` in rewritten graphs: `op`'s signature, the positional
    arguments at `weights` split off as weights (the others are inputs, whose gradients are
    B's). Named as a module attribute, so that generated graph code imports it."""
    def call(*args, **kwargs):
        return _call(op, weights, args, kwargs)
    call.__name__ = call.__qualname__ = name
    call.__module__ = __name__
    call.__doc__ = doc
    call.weights = weights
    return call


linear = _splitting("linear", F.linear, (1, 2), "F.linear(input, weight, bias)")
aten_linear = _splitting("aten_linear", aten.linear.default, (1, 2), "aten.linear(input, weight, bias)")
addmm = _splitting("addmm", aten.addmm.default, (0, 2),
                   "aten.addmm(bias, input, weight): GPT-2's Conv1D, its weight stored (in, out)")
mm = _splitting("mm", aten.mm.default, (1,), "aten.mm(input, weight): a row-parallel Conv1D's local matmul (its "
                "bias is added after the all-reduce, passes/rewrite_parallel_layers.py)")
embedding = _splitting("embedding", F.embedding, (1,),
                       "F.embedding(ids, table, ...): all of its backward is the weight gradient")
aten_embedding = _splitting("aten_embedding", aten.embedding.default, (0,), "aten.embedding(table, ids, ...)")

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

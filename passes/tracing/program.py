"""The module that tracing actually sees: the user's model followed by the loss.

Tracing `model` and `loss_fn` together puts the loss inside the graph, where the tensor
parallel passes can rewrite cross entropy on sharded logits and the pipeline passes can put
it in the last stage. Inputs and outputs are flattened with torch's pytree so that every
graph has a flat signature: placeholders are (*flat_inputs, target) and the output is
(loss, *flat_model_outputs), or (loss_sum, count, *flat_model_outputs) for a loss_fn that
returns a token-weighted pair; the specs recorded here rebuild the user's structures.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from graphpar.passes.tracing.loss_checks import check_loss_value, loss_values

MODEL_PREFIX = "model."
# torch.export snapshots and restores module attributes (dict contents included) after
# tracing, so what tracing learns (output structure, how many leading outputs are the loss)
# is recorded outside the module, keyed by the wrapper's id.
_CAPTURED: Dict[int, Tuple[pytree.TreeSpec, int]] = {}


def loss_from_output(output):
    """With no loss_fn the model may compute its own loss: a tensor (kept only if it turns
    out to be a scalar, see tracing.check_loss), or an output with a .loss field (a
    transformers model given labels). None when it has none."""
    if isinstance(output, (torch.Tensor, torch.fx.Proxy)):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss


class WithLoss(nn.Module):
    """forward(*flat_inputs[, target]) -> (loss, *flat_outputs) or (*flat_outputs)."""

    def __init__(self, model: nn.Module, loss_fn: Optional[Callable], in_spec, with_loss: bool,
                 with_target: bool):
        super().__init__()
        self.model = model
        # Kept out of the module tree so a loss nn.Module's (rare) state is not renamed.
        self.__dict__["loss_fn"] = loss_fn
        self.in_spec = in_spec
        self.with_loss = with_loss
        self.with_target = with_target

    def take_captured(self) -> Tuple[pytree.TreeSpec, int]:
        """(output structure, leading outputs that are the loss: 0, 1 or 2 for (loss_sum,
        count)), as seen while tracing."""
        return _CAPTURED.pop(id(self))

    def run(self, *flat):
        n = self.in_spec.num_leaves
        inputs = pytree.tree_unflatten(list(flat[:n]), self.in_spec)
        output = self.model(*inputs)
        flat_out, out_spec = pytree.tree_flatten(output)
        loss = None
        if self.with_loss and self.loss_fn is not None:
            loss = self.loss_fn(output, flat[n])
            check_loss_value(loss, self.loss_fn)
        elif self.with_loss:
            loss = loss_from_output(output)
        losses = () if loss is None else loss_values(loss)
        _CAPTURED[id(self)] = (out_spec, len(losses))
        return (*losses, *flat_out)


def with_named_inputs(wrapper: WithLoss) -> WithLoss:
    """Give the wrapper a forward with one named argument per flat input.

    Both tracers name placeholders after the forward's parameters; a `*args` forward would
    trace into one tuple placeholder under symbolic_trace. Generating the signature keeps the
    graphs of the two front ends alike: (input_0, ..., input_{n-1}, target).
    """
    names = [f"input_{i}" for i in range(wrapper.in_spec.num_leaves)]
    if wrapper.with_target:
        names.append("target")
    args = ", ".join(names)
    namespace: Dict[str, Any] = {}
    exec(f"def forward(self, {args}):\n    return self.run({args})\n", namespace)
    named = type("GraphparProgram", (WithLoss,), {"forward": namespace["forward"]})
    wrapper.__class__ = named
    return wrapper


def flatten_inputs(example_inputs: Tuple[Any, ...]) -> Tuple[List[Any], pytree.TreeSpec]:
    flat, spec = pytree.tree_flatten(tuple(example_inputs))
    return flat, spec

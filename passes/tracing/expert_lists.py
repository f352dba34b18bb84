"""Experts held as a list of expert modules (the ModuleList / ModuleDict layout), traced as
one dense region that passes/expert_parallel.py replaces.

transformers' SwitchTransformers (and MoE code users write themselves, as transformers 4.x
wrote Mixtral) hold a layer's E experts as E modules of one container, an nn.ModuleList or
nn.ModuleDict with `num_experts = E` and a forward of its own, called as

    forward(hidden [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]        (index)
    forward(hidden [T, H], selected [T, K, E] one-hot, top_k_weights [T, K]) -> [T, H] (mask)

(a mask row of zeros: a pair the router dropped), computing for each token the sum over k of
its weight times its expert's output. The forward loops over the experts that got tokens: a
loop whose length and slices depend on the routing, which neither front end traces. When the
experts are split (Strategy.splits_experts), tracing runs `dense_forward` instead: every
expert on every row, weighted by what the token gives it (0 where it did not pick it). That
is the same function of the inputs, with static shapes; the expert_parallel pass then puts a
call of this rank's experts where its nodes are, whose forward runs only the experts that got
rows (an expert without tokens gets no gradient, as in eager).
"""
from __future__ import annotations

import contextlib
import types
from dataclasses import dataclass
from typing import Iterator, List, Tuple

import torch
import torch.nn as nn


class ExpertParallelError(ValueError):
    """Bad input to expert parallelism (here and in passes/expert_parallel.py)."""


@dataclass(frozen=True)
class ExpertList:
    path: str                   # the container's path in the model
    keys: Tuple[str, ...]       # its experts' names, in expert order
    params: Tuple[str, ...]     # each expert's parameter names (every expert has the same)


def is_expert_list(module: nn.Module) -> bool:
    """A ModuleList or ModuleDict with `num_experts` and a forward of its own."""
    experts = getattr(module, "num_experts", None)
    return (isinstance(module, (nn.ModuleList, nn.ModuleDict)) and isinstance(experts, int) and experts > 1
            and type(module).forward is not nn.Module.forward)


def expert_list_paths(model: nn.Module) -> List[str]:
    """The paths of the expert containers of `model` (unchecked: check_expert_list says what
    expert parallelism refuses)."""
    return [path for path, module in model.named_modules() if is_expert_list(module)]


def expert_lists(model: nn.Module) -> List[ExpertList]:
    """The expert containers of `model`, in model order, each checked (check_expert_list)."""
    return [check_expert_list(path, module) for path, module in model.named_modules() if is_expert_list(module)]


def check_expert_list(path: str, module: nn.Module) -> ExpertList:
    """Expert parallelism moves whole experts between ranks and runs each on the rows it got:
    E experts of one structure (the same parameter names and shapes), holding nothing but
    parameters (a buffer is state the other ranks' copies would not see)."""
    children = list(module.named_children())
    if len(children) != module.num_experts:
        raise ExpertParallelError(
            f"the experts container {path!r} ({type(module).__name__}) has num_experts={module.num_experts} but "
            f"holds {len(children)} modules ({', '.join(k for k, _ in children)}): expert parallelism takes its "
            f"modules as the experts, expert e being the e-th. Fix: hold exactly the experts in it (other "
            f"modules beside it, in the MoE block), or use ep=1.")
    shapes = [(key, tuple((name, tuple(p.shape)) for name, p in child.named_parameters())) for key, child in children]
    for key, shape in shapes[1:]:
        if shape != shapes[0][1] or type(dict(children)[key]) is not type(children[0][1]):
            raise ExpertParallelError(
                f"the experts of {path!r} differ: expert {key!r} ({type(dict(children)[key]).__name__}: "
                f"{_describe(shape)}) is not like expert {shapes[0][0]!r} ({type(children[0][1]).__name__}: "
                f"{_describe(shapes[0][1])}); expert parallelism gives each rank E/ep experts of one structure. "
                f"Fix: make every expert the same module class with the same parameter shapes, or use ep=1.")
    for key, child in children:
        state = [name for name, _ in child.named_buffers()]
        dropout = [name for name, m in child.named_modules() if isinstance(m, nn.Dropout) and m.p > 0]
        if state or dropout:
            what = f"buffers {state}" if state else f"dropout with p > 0 at {dropout}"
            raise ExpertParallelError(
                f"expert {key!r} of {path!r} has {what}: expert parallelism runs the experts eagerly on the "
                f"rows they receive, where a buffer's updates and dropout's random streams are not those of "
                f"one device. Fix: experts holding parameters only, with dropout p=0 inside them (dropout "
                f"outside the experts module is fine), or use ep=1.")
    if not shapes[0][1]:
        raise ExpertParallelError(f"the experts of {path!r} have no parameters: nothing to split. Fix: use ep=1.")
    return ExpertList(path, tuple(k for k, _ in children), tuple(name for name, _ in shapes[0][1]))


def _describe(shape) -> str:
    return ", ".join(f"{name} {list(s)}" for name, s in shape) or "no parameters"


def dense_forward(self, hidden: torch.Tensor, routing: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The container's function with static shapes: every expert on every row, times the
    weight the row gives it (the sum of its pairs' weights for that expert, 0 if none)."""
    if routing.dim() == 3:   # one-hot [T, K, E]
        per_expert = (routing.to(weights.dtype) * weights.unsqueeze(-1)).sum(dim=1)
    else:
        per_expert = weights.new_zeros((hidden.shape[0], self.num_experts)).scatter_add(1, routing, weights)
    out = torch.zeros_like(hidden)
    for e, expert in enumerate(self.children()):
        out = out + (expert(hidden) * per_expert[:, e:e + 1]).to(hidden.dtype)
    return out


@contextlib.contextmanager
def dense_expert_lists(model: nn.Module, enabled: bool) -> Iterator[None]:
    """While tracing: each expert container of `model` runs dense_forward (`enabled`: the
    experts are split, so expert_parallel replaces the region)."""
    containers = [model.get_submodule(e.path) for e in expert_lists(model)] if enabled else []
    for module in containers:
        module.forward = types.MethodType(dense_forward, module)
    try:
        yield
    finally:
        for module in containers:
            del module.forward

"""graphpar runtime ops: the mode-dependent operations of a traced graph.

Tracing runs the model in training mode, which bakes `training=True` into dropout, batch
norm and attention dropout. The tracing front ends replace those ops with the functions
here, which read the executor's mode at run time, so one graph serves both `train_step`
and evaluation (`pm(x)`). Later passes key their rules on these functions, e.g. the TP
RNG rules on `dropout`.

    before: aten.dropout.default(x, 0.1, True)
    after:  graphpar.runtime.ops.dropout(x, 0.1)
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Dict, Optional

import torch
import torch.fx
import torch.nn.functional as F

from graphpar.ir.layout import piece

_state = threading.local()


def is_training(module: str = "") -> bool:
    """Whether a mode-dependent op of the module at path `module` trains now: never while
    evaluating (`mode(training=False)`); in a train step, as that module's own `training`
    flag says (`module_modes`), as in eager PyTorch, where `bn.eval()` freezes one BatchNorm."""
    if getattr(_state, "training", None) is False:
        return False
    flags = getattr(_state, "module_modes", None)
    return True if flags is None else flags.get(module, True)


def axis_group(axis: str):
    """The process group of a mesh axis for the program running now (see `running_on`).

    Graph nodes name mesh axes ("dp", "tp", "pp"), never process groups, so graphs stay
    printable, comparable across ranks and independent of any live process group.
    """
    mesh = getattr(_state, "mesh", None)
    if mesh is None:
        raise RuntimeError(f"a graphpar collective on axis {axis!r} ran outside a graphpar executor. "
                           f"Fix: run compiled programs through ParallelModule.")
    return mesh.group(axis)


def axis_size(axis: str) -> int:
    return getattr(getattr(_state, "mesh", None), axis, 1)


def simulating() -> bool:
    """True while the planner runs a program on fake tensors: collectives keep their shapes
    and skip the communication (there is no process group)."""
    return bool(getattr(_state, "simulating", False))


def simulation(mesh):
    return _setting(simulating=True, mesh=mesh)


@contextlib.contextmanager
def _setting(**values):
    """Set run-time state for the block, restoring what was there before."""
    previous = {name: getattr(_state, name, None) for name in values}
    for name, value in values.items():
        setattr(_state, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(_state, name, value)


def running_on(mesh):
    return _setting(mesh=mesh)


def mode(training: bool):
    return _setting(training=training)


def training_flags(model: torch.nn.Module) -> Dict[str, bool]:
    """Each module's own `training` flag, by module path (the root is "")."""
    return {path: m.training for path, m in model.named_modules(remove_duplicate=False)}


def module_modes(flags: Optional[Dict[str, bool]]):
    """Each module's training flag by module path, for the train steps run in the block."""
    return _setting(module_modes=flags)


def rng(stream: str) -> Optional[torch.Generator]:
    """The generator of an RNG stream ("global" or "tp_local"), set by the executor; None
    outside an executor (tracing), where torch's default generator is used."""
    streams = getattr(_state, "rng", None)
    return streams.get(stream) if streams else None


def rng_streams(streams: Optional[Dict[str, torch.Generator]]):
    return _setting(rng=streams)


def current_streams() -> Optional[Dict[str, torch.Generator]]:
    return getattr(_state, "rng", None)


def snapshot() -> Dict[str, object]:
    """This thread's run-time state (mode, training flags, mesh, streams), for `restored`:
    a recomputed region's backward runs as its forward did (graphpar/runtime/recompute.py)."""
    return dict(vars(_state))


def restored(state: Dict[str, object]):
    return _setting(**state)


def _keep_mask(shape, p: float, generator, like: torch.Tensor) -> torch.Tensor:
    """bool, 1 byte an element: what recomputation keeps of a dropout (the draws equal a
    float mask's)."""
    return torch.empty(shape, dtype=torch.bool, device=like.device).bernoulli_(1 - p, generator=generator)


@torch.fx.wrap
def dropout(x: torch.Tensor, p: float, stream: str = "global", shard_dim: Optional[int] = None,
            blocks: int = 1, module: str = "") -> torch.Tensor:
    """Dropout drawing its mask from an RNG stream (see passes/assign_rng_streams.py).

    With shard_dim set, x is this rank's shard of a tp-sharded value: the mask of the full
    value is drawn from the stream shared by all tp ranks and this rank keeps its slice, so
    masks do not depend on the tp degree (at the cost of drawing tp times more numbers).
    `blocks` > 1: the dim holds equal blocks split separately (a flattened [b*s, h] value
    split along the sequence)."""
    if not is_training(module) or p == 0:
        return x
    generator = rng(stream)
    if generator is None and not simulating():  # outside an executor: torch's own dropout
        return F.dropout(x, p, training=True)
    # a fake run (planner, passes) takes the executor's path, so it saves what training saves
    if shard_dim is None:
        mask = _keep_mask(x.shape, p, generator, x)
    else:
        tp, rank = axis_size("tp"), (0 if simulating() else torch.distributed.get_rank(axis_group("tp")))
        full = list(x.shape)
        full[shard_dim] *= tp
        mask = piece(_keep_mask(full, p, generator, x), shard_dim, rank, tp, blocks)
    return x * mask / (1 - p)


@torch.fx.wrap
def batch_norm(x, running_mean, running_var, weight, bias, momentum: float, eps: float, module: str = ""):
    # Running statistics are updated in place by F.batch_norm only in training mode,
    # exactly as nn.BatchNorm*d does.
    return F.batch_norm(x, running_mean, running_var, weight, bias,
                        training=is_training(module), momentum=momentum, eps=eps)


@torch.fx.wrap
def count_batch(num_batches_tracked: torch.Tensor, module: str = "") -> torch.Tensor:
    """BatchNorm's step counter: advances only in training mode."""
    if is_training(module):
        num_batches_tracked.add_(1)
    return num_batches_tracked


@torch.fx.wrap
def attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
              enable_gqa=False, stream: str = "global", module: str = ""):
    dropout_p = dropout_p if is_training(module) else 0.0
    generator = rng(stream) if dropout_p > 0 else None
    sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=attn_mask, dropout_p=dropout_p,
                             is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
    if dropout_p == 0 or (generator is None and not simulating()):
        return sdpa()
    # sdpa draws from torch's default generator: seed it from the stream, then restore it. A
    # fake run (planner, passes) draws the seed too: it makes the calls training makes
    seed = torch.randint(0, 2 ** 62, (), generator=generator)
    if simulating():
        return sdpa()
    with torch.random.fork_rng(devices=[]):
        if q.device.type == "cpu":  # torch.manual_seed would also queue seeds for every accelerator, 1.5 ms a call
            torch.default_generator.manual_seed(int(seed))
        else:
            torch.manual_seed(int(seed))
        return sdpa()


MODE_DEPENDENT_OPS = (dropout, batch_norm, count_batch, attention)


def bind_module_modes(gm: torch.fx.GraphModule, module_path) -> None:
    """Give every mode-dependent op the path of the module it came from (`module_path(node)`),
    whose training flag it follows at run time (see is_training)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in MODE_DEPENDENT_OPS:
            node.kwargs = {**node.kwargs, "module": module_path(node)}
    gm.recompile()


def is_impure(node: torch.fx.Node) -> bool:
    """For dead-code elimination: ops run for their effect (BatchNorm's counter, an in-place
    update of model state such as `self.steps.add_(1)`), not a value."""
    return node.target is count_batch or _updates_state(node) or node.is_impure()


def _updates_state(node: torch.fx.Node) -> bool:
    """An in-place tensor method (torch names them with a trailing underscore) on a
    parameter or buffer, as symbolic_trace records it."""
    name = str(node.target)
    return (node.op == "call_method" and name.endswith("_") and not name.endswith("__")
            and bool(node.args) and isinstance(node.args[0], torch.fx.Node) and node.args[0].op == "get_attr")

"""Per-rank functions for the planner tests: real runs with instrumented transfers."""
import torch
import torch.distributed as dist

import graphpar as gp
from tests import helpers, pp_targets


def measure(name, strategy_dict, batch=8):
    """One training step with every collective and point-to-point call counted, plus the
    bytes this rank really holds: parameters, gradients, optimizer states."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    model, loss_fn = pp_targets.build(name, strategy.tp)
    x, y = pp_targets.data(name, batch)
    local = batch // strategy.dp
    mesh_dp = (dist.get_rank() // strategy.tp) % strategy.dp
    xs, ys = x[mesh_dp * local:(mesh_dp + 1) * local], y[mesh_dp * local:(mesh_dp + 1) * local]
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=helpers.adamw(), bucket_bytes=4096)
    pm.train_step(xs, target=ys)  # warm-up: optimizer states exist from here on
    counts = {}
    originals = {}

    def counting(op, fn):
        def wrapper(tensor, *args, **kwargs):
            entry = counts.setdefault(op, [0, 0])
            entry[0] += tensor.numel() * tensor.element_size()
            entry[1] += 1
            return fn(tensor, *args, **kwargs)
        return wrapper
    for op in ("all_reduce", "all_gather", "broadcast"):
        originals[op] = getattr(dist, op)
        setattr(dist, op, counting(op, originals[op]))

    def batched(operations):  # the pipeline posts its sends and receives in batches
        for operation in operations:
            entry = counts.setdefault(operation.op.__name__, [0, 0])
            entry[0] += operation.tensor.numel() * operation.tensor.element_size()
            entry[1] += 1
        return originals["batch_isend_irecv"](operations)
    originals["batch_isend_irecv"] = dist.batch_isend_irecv
    dist.batch_isend_irecv = batched
    try:
        pm.train_step(xs, target=ys)
    finally:
        for op, fn in originals.items():
            setattr(dist, op, fn)
    params = {n: p for n, p in pm.named_parameters()}
    optimizer_bytes = sum(t.numel() * t.element_size() for state in pm.optimizer.state.values()
                          for t in state.values() if isinstance(t, torch.Tensor) and t.numel() > 1)
    return {"counts": counts, "param_bytes": sum(p.numel() * p.element_size() for p in params.values()),
            "grad_bytes": sum(p.grad.numel() * p.grad.element_size() for p in params.values() if p.grad is not None),
            "optimizer_bytes": optimizer_bytes, "rank": dist.get_rank()}

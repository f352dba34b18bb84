"""Per-rank functions for the verify tests: each injects one bug, runs graphpar.verify and takes
the bug out again (the tests run them one after another in the same processes)."""
import contextlib

import torch.distributed as dist

import graphpar as gp
from graphpar.tools.verify import _localise_from_start, verify_rank
from tests import helpers


def _check(strategy):
    """verify_rank's report on the tiny GPT, 2 AdamW steps, at verify's default tolerances."""
    model = helpers.tiny_gpt()
    x, y = helpers.token_batch(batch=4)
    return verify_rank(model, strategy, (x,), y, helpers.lm_loss, helpers.adamw(), 2, 1e-4, 1e-3, {})


@contextlib.contextmanager
def _injected(owner, name, value):
    """`owner.name` (a module's or a class's attribute) replaced by `value` inside the block."""
    original = vars(owner)[name]  # a class's own entry: a staticmethod stays one
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def transformers_bf16(arch, layout):
    """verify_rank's report on a transformers model (torch.export traced) trained in bf16."""
    model = getattr(helpers, f"hf_{arch}")()
    x, y = helpers.token_batch(batch=4)
    strategy = gp.Strategy(param_dtype="bf16", **layout)
    return verify_rank(model, strategy, (x,), y, helpers.hf_causal_lm_loss, helpers.adamw(1e-3), 3, 1e-4, 1e-3, {})


def transformers_localised(arch, layout):
    """What verify's localisation finds on a correct transformers program trained in bf16 (it
    compiles again and compares every forward value with the whole-model trace): None."""
    model = getattr(helpers, f"hf_{arch}")()
    x, y = helpers.token_batch(batch=4)
    return _localise_from_start(None, model, model.state_dict(), gp.Strategy(param_dtype="bf16", **layout), (x,), y,
                                helpers.hf_causal_lm_loss, 1e-4, 1e-3, {})


def clean(param_dtype=None):
    return _check(gp.Strategy(tp=2, param_dtype=param_dtype))


def wrong_reduce_op(param_dtype=None):
    from graphpar.runtime import collectives, ops

    def forward(ctx, x, axis):  # MAX where the row-parallel partial sums must be added
        x = x.clone()
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=ops.axis_group(axis))
        return x
    with _injected(collectives._ReduceFrom, "forward", staticmethod(forward)):
        return _check(gp.Strategy(tp=2, param_dtype=param_dtype))


def wrong_head_count(param_dtype=None):
    import graphpar.passes.rewrite_parallel_layers as rewrite
    with _injected(rewrite, "_localize_shape_args", lambda node, tp: None):  # views keep the global head count
        return _check(gp.Strategy(tp=2, param_dtype=param_dtype))


def swapped_column_row(param_dtype=None):
    from graphpar.ir import Shard
    from graphpar.passes.tp import solver
    original = solver.Solver._column_specs

    def swapped(self, columns, local, roles, params):
        original(self, columns, local, roles, params)
        for name, spec in list(params.items()):
            if spec.dim == 0 and name.endswith("weight") and ".attn." in name:
                params[name] = Shard(1)  # a column weight split as a row weight
    with _injected(solver.Solver, "_column_specs", swapped):
        return _check(gp.Strategy(tp=2, param_dtype=param_dtype))


def dropped_gradient_sync(param_dtype=None):
    from graphpar.runtime import grad_sync

    def complete(self, index):  # waits for a bucket's all-reduce, never writes the averages back
        bucket = self.buckets[index]
        bucket.work.wait(self.timeout)
        bucket.buffer, bucket.work = None, None
    with _injected(grad_sync.GradientSync, "complete", complete):
        return _check(gp.Strategy(dp=2, param_dtype=param_dtype))

"""Per-rank functions for tests/multiprocess/runtime/test_zero.py and test_zero_pipeline.py (run in
processes started by graphpar.launch)."""
import functools
import os

import torch
import torch.distributed as dist

import graphpar as gp
from graphpar.runtime.zero import AllGatherParams, ReduceScatterGrads
from tests.helpers import adamw, dp_slice, held_parameters, lm_loss, loadable_state, tiny_gpt, token_batch


def optimizer(name):
    if name == "adamw":
        return adamw()
    return functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def _compile(strategy, global_batch, optimizer_name="adamw", model=None):
    x, y = token_batch(batch=global_batch)
    xs, ys = dp_slice(x, strategy), dp_slice(y, strategy)
    model = model or tiny_gpt()
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=lm_loss,
                    optimizer=optimizer(optimizer_name),
                    bucket_bytes=4096)  # small buckets: several reduce-scatters per step
    return pm, model, xs, ys


def _state_elements(pm):
    """Elements of per-element optimizer state this rank holds (scalars such as Adam's step
    left out, as the planner counts)."""
    return sum(t.numel() for state in pm.optimizer.state.values() for t in state.values()
               if torch.is_tensor(t) and t.dim() > 0)


def train(strategy_dict, steps, global_batch, optimizer_name):
    """Losses, the full state, pm(x) on this rank's slice, and what the rank holds."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    pm, model, xs, ys = _compile(strategy, global_batch, optimizer_name)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    return losses, loadable_state(pm, model), pm(xs), _held(pm)


def _bucket_storages(update):
    """Per bucket: (distinct storages behind its parameters, their elements, dp * shard)."""
    storages = []
    for step in update:
        behind = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() // p.element_size()
                  for p in step.params}
        storages.append((len(behind), sum(behind.values()), step.layout.shard * step.layout.dp))
    return storages


def _held(pm):
    """What the rank holds after its steps: its share of the parameters and optimizer state."""
    update = pm._placed.shard_steps
    return {
        "state_elements": _state_elements(pm),
        "owned": sum(step.layout.owned() for step in update),
        "padding": sum(step.layout.padding for step in update),
        "shard": sum(step.layout.shard for step in update),
        "elements": sum(step.layout.total for step in update),  # the rank's (tp) share, whole
        "held_parameter_elements": sum(p.numel() for p in held_parameters(pm)),
        "grads": [p.grad is not None for p in pm.parameters()],
        "dp_rank": pm.mesh.dp_rank,
        "buckets": len(update),
        "bucket_storages": _bucket_storages(update),
    }


def _record_dp_collectives(pm):
    """Lists that fill, as the steps run, with the names of the update program's dp
    collectives in the order this rank issues them, one list per process group: the
    reduce-scatters (reduce_k, backward's thread, over dp) and the weight all-gathers
    (gather_k, the worker thread, over the second dp group)."""
    issued = {"reduce": [], "gather": []}
    for name, module in pm._placed.program.named_children():
        if isinstance(module, (ReduceScatterGrads, AllGatherParams)):
            kind = "reduce" if isinstance(module, ReduceScatterGrads) else "gather"

            def recording(*args, _name=name, _forward=module.forward, _kind=kind):
                issued[_kind].append(_name)
                return _forward(*args)
            module.forward = recording
    return issued


def train_pipeline(configs):
    """train() for each (strategy dict, steps, global batch, optimizer name) in one set of
    processes (start-up dominates small runs), with what a pipeline rank adds: its pp rank,
    the order of its dp collectives, the buckets launched during backward and those holding
    a weight summed across pipeline ranks (tied), and its copies of those weights."""
    results = []
    for strategy_dict, steps, global_batch, optimizer_name in configs:
        pm, model, xs, ys = _compile(gp.Strategy.from_dict(strategy_dict), global_batch, optimizer_name)
        issued = _record_dp_collectives(pm)
        losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
        runner = pm._executor.grad_sync
        tied = {id(p) for p, _ in pm._executor.tied}
        held = {**_held(pm), "pp_rank": pm.mesh.pp_rank, "tp_rank": pm.mesh.tp_rank, "issued": issued,
                "launched_in_backward": runner.launched_in_backward,
                "tied_buckets": sum(any(id(p) in tied for p in bucket) for bucket in runner.bucket_params),
                "tied_copies": _tied_copies(pm, tied)}
        results.append((losses, loadable_state(pm, model), pm(xs), held))
    return results


def _tied_copies(pm, tied):
    """This rank's copies of the weights summed across pipeline ranks, whole. At zero=3 the copy
    is its own bucket's shards, gathered over dp (every rank calls this: a collective)."""
    if pm.strategy.zero == 3:
        whole = pm._placed.masters()
        names = [step.names[0] for step in pm._placed.shard_steps if id(step.unsharded.shard) in tied]
        return {name: whole[name] for name in names}
    return {name: p.detach().clone() for name, p in pm.named_parameters() if id(p) in tied}


def load_then_train(configs, state):
    """For each (strategy dict, steps, global batch, optimizer name): compile, load the full
    state dict `state`, and return the state as loaded, the losses of the steps from there and
    the state after them."""
    results = []
    for strategy_dict, steps, global_batch, optimizer_name in configs:
        pm, _, xs, ys = _compile(gp.Strategy.from_dict(strategy_dict), global_batch, optimizer_name)
        pm.load_full_state_dict(state)
        loaded = pm.full_state_dict()
        losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
        results.append((loaded, losses, pm.full_state_dict()))
    return results


def save_pipeline(directory, steps, global_batch):
    """dp=2 x pp=2, zero=2 trains, saves to `directory` and takes one more step."""
    pm, _, xs, ys = _compile(gp.Strategy(dp=2, pp=2, zero=2, microbatches=2), global_batch)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    pm.save_checkpoint(directory)
    straight = pm.train_step(xs, target=ys)
    return losses, straight, pm.full_state_dict()


def resume(directory, strategy_dict, global_batch):
    """Under another strategy (in a launched process, or a world of one without one): the
    checkpoint's weights as loaded, then one step's loss and the weights after it."""
    pm, _, xs, ys = _compile(gp.Strategy.from_dict(strategy_dict), global_batch)
    pm.load_checkpoint(directory)
    loaded = pm.full_state_dict()
    loss = pm.train_step(xs, target=ys)
    return loaded, loss, pm.full_state_dict()


def save_reload(directory, steps, global_batch):
    """(dp=4, zero=3) trains, saves A and steps on; (dp=2, tp=2, zero=1) loads A, saves B and
    steps; (dp=4, zero=3) loads B, saves C and takes the step the first run took."""
    first = gp.Strategy(dp=4, zero=3)
    pm, model, xs, ys = _compile(first, global_batch)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    pm.save_checkpoint(os.path.join(directory, "A"))
    straight = pm.train_step(xs, target=ys)

    other, _, xo, yo = _compile(gp.Strategy(dp=2, tp=2, zero=1), global_batch)
    other.load_checkpoint(os.path.join(directory, "A"))
    other.save_checkpoint(os.path.join(directory, "B"))
    other_loss = other.train_step(xo, target=yo)

    again, _, _, _ = _compile(first, global_batch)
    again.load_checkpoint(os.path.join(directory, "B"))
    again.save_checkpoint(os.path.join(directory, "C"))
    resumed = again.train_step(xs, target=ys)
    return losses, straight, other_loss, resumed, pm.full_state_dict(), again.full_state_dict(), dist.get_rank()


def planned_and_held(strategy_dict):
    """One step, then the plan of this module beside what the rank holds and moved."""
    from graphpar.runtime.placement.transfers import bytes_moved, reset_bytes_moved
    strategy = gp.Strategy.from_dict(strategy_dict)
    pm, _, xs, ys = _compile(strategy, 8)
    pm.train_step(xs, target=ys)
    reset_bytes_moved()
    pm.train_step(xs, target=ys)
    moved = bytes_moved()
    plan = pm.report().ranks[dist.get_rank()]
    steps = pm._placed.shard_steps
    held = {
        "param": sum(p.nbytes for p in pm.parameters()),
        "grad": sum(p.grad.nbytes for p in pm.parameters() if p.grad is not None),
        "masters": sum(step.flat.nbytes for step in steps if step.flat is not None),
        "states": sum(t.nbytes for state in pm.optimizer.state.values() for t in state.values()),  # 0-d steps too
        "moved": moved,
    }
    planned = {"param": plan.param_bytes, "grad": plan.grad_bytes, "optimizer": plan.optimizer_bytes,
               "host": plan.host_bytes, "host_moves": {t.op: t.bytes for t in plan.collectives if t.axis == "host"}}
    return planned, held


def documented_path(strategy_dict, steps, global_batch):
    """Compiled as the API's example does (no example_target: the loss is traced at the first
    train_step), from real weights and from a meta-device model given its weights after."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    x, y = token_batch(batch=global_batch)
    xs, ys = dp_slice(x, strategy), dp_slice(y, strategy)
    runs = []
    for meta in (False, True):
        if meta:
            with torch.device("meta"):
                model = tiny_gpt()
        else:
            model = tiny_gpt()
        pm = gp.compile(model, strategy, example_inputs=(xs,), loss_fn=lm_loss, optimizer=adamw())
        if meta:
            pm.load_full_state_dict(tiny_gpt().state_dict())
        losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
        runs.append((losses, pm.full_state_dict()))
    return runs


def gathered_lifetimes(steps):
    """zero=3 at dp=2: which gathered buckets graphpar holds when each forward gather arrives,
    which buffers are still alive after the whole forward, the bucket the program keeps for
    backward (its `keep` node), and how many all-gathers of each bucket forward and backward
    issue per step (counted where they are issued: Unsharded.gather)."""
    import time

    from torch.multiprocessing.reductions import StorageWeakRef

    from graphpar.runtime import zero3
    from graphpar.runtime.zero3 import Unsharded
    pm, _, xs, ys = _compile(gp.Strategy(dp=2, zero=3), 8)
    buffers, alive_at_gather = [], []
    gathers = {"forward": {}, "backward": {}}
    phase = ["forward"]
    unshard, gather = Unsharded.unshard, Unsharded.gather

    def counted_unshard(self, gathering):
        views = unshard(self, gathering)
        buffers.append((self.index, StorageWeakRef(views[0].untyped_storage())))
        # the buckets graphpar holds gathered (between their wait and their free); a freed
        # buffer may outlive its free briefly, until gloo's thread drops its reference
        alive_at_gather.append(sorted(bucket.index for bucket in zero3._GATHERED.values()))
        return views

    def counted_gather(self):
        gathers[phase[0]][self.index] = gathers[phase[0]].get(self.index, 0) + 1
        return gather(self)

    forward = pm._executor._loss_gm
    after_forward = []

    def loss_and_check(*args):
        phase[0] = "forward"
        out = forward(*args)
        # gloo's worker thread drops its reference to an all-gather's output just after the wait
        # returns: a buffer may outlive the forward by that long, never longer
        deadline = time.monotonic() + 5
        kept = [k for k, ref in buffers if not ref.expired()]
        while len(kept) > 1 and time.monotonic() < deadline:
            time.sleep(0.001)
            kept = [k for k, ref in buffers if not ref.expired()]
        after_forward.append(kept)
        buffers.clear()
        phase[0] = "backward"
        return out

    Unsharded.unshard, Unsharded.gather = counted_unshard, counted_gather
    pm._executor._loss_gm = loss_and_check
    try:
        losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    finally:
        Unsharded.unshard, Unsharded.gather = unshard, gather
    keep_nodes = [str(n.target) for n in pm._executor.gm.graph.nodes if str(n.target).endswith(".keep")]
    return {"buckets": len(pm._placed.program.unsharded), "gathers": gathers, "after_forward": after_forward,
            "keep_nodes": keep_nodes, "most_alive": max(alive_at_gather, key=len), "losses": losses}


def verify_zero(zero):
    """graphpar.verify of the tiny GPT at dp=2 with `zero`, inside this launched world (verify
    runs on every rank of a process group of the strategy's size): this rank's report."""
    x, y = token_batch(batch=8)
    return gp.verify(tiny_gpt(), gp.Strategy(dp=2, zero=zero), (x,), y, loss_fn=lm_loss, optimizer=optimizer("sgd"))

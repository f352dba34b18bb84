"""Varying input shapes (graphpar/runtime/shapes.py): the batches, the reference and the runs
of tests/unit/runtime/test_shapes.py and its multiprocess twin (these run inside
graphpar.launch children too)."""
import contextlib
import functools
from unittest import mock

import torch
import torch.nn.functional as F

import graphpar as gp
import graphpar.passes.trace
from graphpar.distributed.mesh import Mesh
from tests.helpers import dp_slice, lm_loss, tiny_gpt, token_batch, train_reference

# SGD with momentum: one optimizer state that every shape's program must share (a program
# stepping a momentum of its own would leave the trajectory), without Adam's division by
# sqrt(v), which turns the float rounding of near-zero gradients into lr-sized steps
SGD = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)


def token_sum(logits, target):
    """lm_loss as a (loss_sum, count) pair, the count the target's size."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"), torch.ones_like(target).sum()


def token_sum_of_a_constant(logits, target):
    """token_sum with a count torch.export bakes into a constant of the traced shape (fx cannot
    trace torch.tensor of a size): each shape's program must keep its own."""
    return F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="sum"), torch.tensor(target.numel())


def model():
    return tiny_gpt(block_size=32)  # positions for the longest sequence


@contextlib.contextmanager
def counting_traces():
    """Count the calls of the tracing entry point (the trace pass's front end) in the list
    yielded, one item per trace."""
    counts = []
    real = graphpar.passes.trace.trace_program

    def counted(*args, **kwargs):
        counts.append(1)
        return real(*args, **kwargs)
    with mock.patch.object(graphpar.passes.trace, "trace_program", counted):
        yield counts


def global_batches(shapes):
    """One global (ids, targets) batch per (batch size, sequence length), each its own tokens."""
    return [token_batch(batch, seq, seed=i + 1) for i, (batch, seq) in enumerate(shapes)]


def reference(shapes):
    """Single-device eager training on the global batches in turn: (losses, state dict)."""
    batches = global_batches(shapes)
    trained, losses = train_reference(model(), batches, lm_loss, SGD, len(batches))
    return losses, trained.state_dict()


def reference_output(state, x):
    """The eager model with `state`, evaluated on x."""
    evaluated = model()
    evaluated.load_state_dict(state)
    with torch.no_grad():
        return evaluated.eval()(x)


def train(strategy_dict, shapes, options=None):
    """This rank's run over the global batches of `shapes`, each rank on its dp slice: the loss
    and the number of traces so far after each step, the state, pm(x) of the last batch and
    the traces after it, the report's shapes and, with options' max_shapes, the message of a
    shape past the bound."""
    options = options or {}
    strategy = gp.Strategy.from_dict(strategy_dict)
    batches = [(dp_slice(x, strategy), dp_slice(y, strategy)) for x, y in global_batches(shapes)]
    with counting_traces() as traces:
        pm = gp.compile(model(), strategy, example_inputs=(batches[0][0],), example_target=batches[0][1],
                        loss_fn=lm_loss, optimizer=SGD, **options)
        losses, traced = [], []
        for x, y in batches:
            losses.append(pm.train_step(x, target=y))
            traced.append(len(traces))
        out = pm(batches[-1][0])
        evaluated = len(traces)
    run = {"losses": losses, "traced": traced, "evaluated": evaluated, "state": pm.full_state_dict(), "out": out,
           "evaluated_input": batches[-1][0], "shapes": pm.report().shapes}
    if "max_shapes" in options:
        run["bound"] = _past_bound(pm, batches[0])
    return run


def _past_bound(pm, batch):
    """The error of a train_step on a batch of yet another shape (its first 8 tokens)."""
    x, y = batch
    try:
        pm.train_step(x[:, :8], target=y[:, :8])
    except ValueError as error:
        return str(error)
    return "no error"


def replica_batches(steps):
    """Per step, one (ids, targets) batch of each dp replica: (batch size, sequence length)s."""
    return [[token_batch(batch, seq, seed=10 * step + replica + 1) for replica, (batch, seq) in enumerate(shapes)]
            for step, shapes in enumerate(steps)]


def reference_token_mean(steps):
    """Single-device eager training, each step on every replica's batch with the token mean
    over all of them: (losses, state dict)."""
    trained = model()
    optimizer = SGD(trained.parameters())
    losses = []
    for batches in replica_batches(steps):
        optimizer.zero_grad()
        pairs = [token_sum(trained(x), y) for x, y in batches]
        loss = sum(loss_sum for loss_sum, _ in pairs) / sum(int(count) for _, count in pairs)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, trained.state_dict()


def train_replicas(strategy_dict, steps, options=None):
    """train() with dp replicas that see batches of different shapes at one step (`steps`:
    per step, each replica's shape) and a token_sum loss."""
    strategy = gp.Strategy.from_dict(strategy_dict)
    replica = Mesh(strategy.dp, strategy.tp, strategy.pp, torch.distributed.get_rank()).dp_rank
    batches = [step[replica] for step in replica_batches(steps)]
    with counting_traces() as traces:
        pm = gp.compile(model(), strategy, example_inputs=(batches[0][0],), example_target=batches[0][1],
                        loss_fn=token_sum, optimizer=SGD, **(options or {}))
        losses, traced = [], []
        for x, y in batches:
            losses.append(pm.train_step(x, target=y))
            traced.append(len(traces))
    return {"losses": losses, "traced": traced, "state": pm.full_state_dict()}


def train_cases(trained, replicas):
    """train(*trained) and train_replicas(*replicas), in one launch."""
    return train(*trained), train_replicas(*replicas)

"""Runs a rank's compiled programs: microbatching, backward, gradient sync, optimizer step.

The executor sees only GraphModules and the traced program's signature, never pass
internals. A program's placeholders are (*flat_inputs, target) and its output is
(loss, *flat_outputs), all with the microbatch shapes it was traced with (torch.export
bakes them into view/reshape constants), so inputs are split into microbatches here;
ParallelModule picks the program of the batch's shape (graphpar/runtime/shapes.py).
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from graphpar.distributed import faults
from graphpar.runtime import ops, zero3
from graphpar.runtime.grad_divisor import GradientDivisor
from graphpar.ir import record


def placeholders(gm: torch.fx.GraphModule) -> List[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def batch_size(flat: Sequence[Any], what: str) -> int:
    sizes = {tuple(t.shape[:1]) for t in flat if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"{what}: every tensor input must share its first (batch) dimension, got "
                         f"leading sizes {sorted(sizes)}. Fix: pass batch-first tensors of one batch size.")
    size = sizes.pop()[0]
    if size == 0:
        raise ValueError(f"{what}: the batch is empty (0 samples); every rank needs at least one sample per "
                         f"step, and a data-parallel rank with none would leave the others waiting in the "
                         f"gradient all-reduce. Fix: skip empty batches, e.g. graphpar.tools.data.DistributedBatches "
                         f"with remainder='drop' never yields one.")
    return size


def first_microbatch(value: Any, microbatches: int) -> Any:
    """The first of `microbatches` equal pieces along dim 0 (what programs are traced with)."""
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.chunk(microbatches, dim=0)[0]
    return value


def split_microbatches(flat: Sequence[Any], chunks: int) -> List[List[Any]]:
    """Split every tensor along dim 0 into `chunks` equal pieces; other values repeat."""
    pieces = [t.chunk(chunks, dim=0) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * chunks
              for t in flat]
    return [[p[i] for p in pieces] for i in range(chunks)]


def project(gm: torch.fx.GraphModule, keep, name: str) -> torch.fx.GraphModule:
    """A copy of the program returning only the outputs picked by `keep` (a slice), with
    the work only the others needed removed: the evaluation program drops the loss and the
    target input, the training program drops the model outputs (and their gathers)."""
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(tuple(output[keep]))
    projected = torch.fx.GraphModule(gm, graph, class_name=name)
    projected.graph.eliminate_dead_code(is_impure_node=ops.is_impure)
    for node in placeholders_of(projected.graph):
        if node.name == "target" and not node.users:
            projected.graph.erase_node(node)
    projected.recompile()
    return projected


def forward_only(gm: torch.fx.GraphModule, loss_outputs: int) -> torch.fx.GraphModule:
    """The model's outputs only (`loss_outputs`: TracedProgram.loss_outputs)."""
    return project(gm, slice(loss_outputs, None), "GraphparForward")


def loss_only(gm: torch.fx.GraphModule, loss_outputs: int) -> torch.fx.GraphModule:
    """The loss only: (loss,) or (loss_sum, count)."""
    return project(gm, slice(0, loss_outputs), "GraphparLoss")


def placeholders_of(graph: torch.fx.Graph) -> List[torch.fx.Node]:
    return [n for n in graph.nodes if n.op == "placeholder"]


class SingleStageExecutor:
    """pp = 1: each microbatch runs forward and backward in turn (gradient accumulation)."""

    def __init__(self, gm: torch.fx.GraphModule, program, strategy, mesh, divisor: GradientDivisor, grad_sync=None,
                 rng=None):
        self.gm = gm
        self.rng = rng
        self.program = program
        self.strategy = strategy
        self.mesh = mesh
        self.divisor = divisor
        self.grad_sync = grad_sync
        self.loss_scale = 1.0  # fp16 training scales the loss (graphpar.runtime.placement.precision)
        self._forward_gm: Optional[torch.fx.GraphModule] = None
        self._loss_gm = loss_only(gm, program.loss_outputs) if program.has_loss else None
        self._gathers = bool(zero3.buckets_of(gm))

    def parameters(self) -> List[torch.nn.Parameter]:
        return list(self.gm.parameters())

    @faults.guard_step
    def train_step(self, flat_inputs: List[Any], target: Any) -> torch.Tensor:
        """Forward and backward of every microbatch, then the gradient sync; returns the sum
        of the microbatches' losses (means, or loss sums: see graphpar/runtime/grad_divisor.py)."""
        m = self.strategy.microbatches
        # ParallelModule.train_step chose the program of this batch's shape
        values = list(flat_inputs) + ([target] if target is not None else [])
        micro = split_microbatches(values, m)
        total = torch.zeros((), dtype=torch.float64)
        with ops.mode(training=True), ops.running_on(self.mesh), ops.rng_streams(self.rng), \
                zero3.regathered_in_backward(self._gathers):
            for i, batch in enumerate(micro):
                outputs = self._loss_gm(*batch)
                if self.program.loss_count:
                    self.divisor.add_count(outputs[1])
                if self.grad_sync is not None and i == m - 1:
                    self.grad_sync.arm()
                self.divisor.scaled_for_backward(outputs[0], self.loss_scale).backward()
                total += outputs[0].detach().to(torch.float64)
        if self.grad_sync is not None:
            self.grad_sync.finish()
        return total

    def forward(self, flat_inputs: List[Any]) -> List[Any]:
        if self._forward_gm is None:
            self._forward_gm = forward_only(self.gm, self.program.loss_outputs)
        gm = self._forward_gm
        # ParallelModule chose a program whose microbatch divides the batch (graphpar/runtime/shapes.py)
        micro_batch = record(placeholders(gm)[0]).value.shape[0]
        chunks = split_microbatches(flat_inputs, batch_size(flat_inputs, "pm(x)") // micro_batch)
        with torch.no_grad(), ops.mode(training=False), ops.running_on(self.mesh):
            outputs = [gm(*chunk) for chunk in chunks]
        return [_concat([out[i] for out in outputs]) for i in range(len(outputs[0]))]


def _concat(values: List[Any]) -> Any:
    if len(values) == 1:
        return values[0]
    if all(isinstance(v, torch.Tensor) and v.dim() > 0 for v in values):
        return torch.cat(values, dim=0)
    raise ValueError("pm(x): a model output with no batch dimension cannot be evaluated in several "
                     "microbatches. Fix: pass exactly one compiled microbatch to pm(x).")


def unflatten_output(flat: List[Any], spec: pytree.TreeSpec) -> Any:
    return pytree.tree_unflatten(flat, spec)

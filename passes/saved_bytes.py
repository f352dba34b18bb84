"""What autograd saves for backward in one microbatch, found by running a program on fake
tensors under saved_tensors_hooks: the same autograd as training, no memory, no compute.
The planner costs each unit (layer) with it, and passes/recompute.py measures its choices.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

from graphpar.ir import TensorMeta, fetch_attr, record
from graphpar.runtime import ops


def node_stage(node) -> int:
    """A node's pipeline stage, 0 before partition_stages tags it."""
    stage = record(node).stage
    return 0 if stage is None else stage


class _SavedBytes(torch.fx.Interpreter):
    """Runs the graph on fake tensors and adds the bytes autograd saves to each node's stage."""

    def __init__(self, gm, parameters, stand_ins=None):
        super().__init__(gm)
        self.saved: Dict[int, Dict[Any, int]] = {}
        self.seen: set = set()
        self.stage = 0
        self.parameter_storages: Dict[Any, str] = {StorageWeakRef(p.untyped_storage()): "" for p in parameters}
        self.weights_saved: Dict[int, set] = {}  # stage -> parameters (or views of them) it saves
        self.stand_ins: Dict[torch.fx.Node, Optional[torch.fx.Node]] = stand_ins or {}
        self.standing_in = False     # running a node of stand_ins: its own saves do not count
        self.to_keep = {kept: None for kept in self.stand_ins.values() if kept is not None}

    def run_node(self, n):
        if n.op != "output":
            self.stage = node_stage(n)
        self.standing_in = n in self.stand_ins
        result = super().run_node(n)
        self.standing_in = False
        if n in self.to_keep:   # the interpreter lets a value go after its last reader
            self.to_keep[n] = result
        kept = self.stand_ins.get(n)
        if kept is not None:
            self.pack(self.to_keep[kept])
        return result

    def pack(self, tensor):
        """Each storage counts once, for the first unit that saves it (a view saved again by a
        later layer costs no new memory). A value saved on both sides of a pipeline cut is
        counted on the first side only: the estimate of the later stage is then slightly low."""
        ref = StorageWeakRef(tensor.untyped_storage())
        if self.standing_in and ref not in self.parameter_storages:
            return tensor
        if ref in self.parameter_storages:  # zero=3 gathers these again in backward
            self.weights_saved.setdefault(self.stage, set()).add(self.parameter_storages[ref])
        elif ref not in self.seen:
            self.seen.add(ref)
            self.saved.setdefault(self.stage, {})[ref] = tensor.untyped_storage().nbytes()
        return tensor

    def fetch_attr(self, target):
        # parameters and buffers as fakes; a submodule a call_module runs (a recompute region) as is
        return self.fakes[target] if target in self.fakes else super().fetch_attr(target)


def saved_activation_bytes(gm: torch.fx.GraphModule, inputs, mesh, meta: bool = False,
                           stand_ins: Optional[Dict[torch.fx.Node, Optional[torch.fx.Node]]] = None
                           ) -> Tuple[Dict[int, int], Dict[int, set]]:
    """Bytes saved for backward per stage for one microbatch (fake execution), and the
    parameters each stage saves (a weight or a view of it); a model on the meta device was
    traced with meta inputs, so the run uses meta tensors too. `stand_ins`: nodes whose own
    saves are not counted, each with the value it is counted as keeping instead (or None),
    counted when it has run (an experts call, passes/recompute.py experts_stand_ins)."""
    if meta:
        inputs = [t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    runner = _SavedBytes(gm, [], stand_ins)
    fakes = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = record(node).value
            if isinstance(value, TensorMeta):  # this rank's (tp-local) shape, not the user's tensor
                with mode:  # a fake tensor on the input's device, with no storage behind it
                    fake = torch.empty(value.shape, dtype=value.dtype, device=_device(inputs))
                fakes[str(node.target)] = fake.requires_grad_(value.requires_grad)
            else:
                fakes[str(node.target)] = fetch_attr(gm, str(node.target))
    runner.fakes = fakes
    runner.parameter_storages = {StorageWeakRef(t.untyped_storage()): name for name, t in fakes.items()
                                 if isinstance(t, torch.Tensor)}
    fake_inputs = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in inputs]
    with ops.simulation(mesh), ops.mode(training=True), mode, \
            torch.autograd.graph.saved_tensors_hooks(runner.pack, lambda t: t):
        runner.run(*fake_inputs)
    return {stage: sum(sizes.values()) for stage, sizes in runner.saved.items()}, runner.weights_saved


def _device(inputs) -> torch.device:
    return next((t.device for t in inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))


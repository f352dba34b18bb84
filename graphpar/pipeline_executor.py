"""Runs this rank's pipeline stages under a schedule (graphpar/schedules.py).

The schedule is a list of instructions for this rank; each is executed in order:

    recv_act / recv_grad   blocking receive from the neighbour stage's rank, into buffers
                           whose shapes and dtypes come from the stage plan (records), not
                           from a handshake; a peer that never sends fails at the timeout
    forward / backward     run the stage GraphModule / autograd on its saved outputs
    send_act / send_grad   asynchronous send; all sends are waited for at the end of a step

Peers are the ranks holding the neighbour stages with this rank's dp and tp coordinates.
Gradients travel only for values that need one (integer ids, masks and the like don't).
Every tensor is tagged with (kind, stage, microbatch, index) so messages cannot be matched
to the wrong receive.
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from graphpar import ops
from graphpar.executor import batch_size, check_shapes, split_microbatches
from graphpar.schedules import build_schedule, forward_only

_KIND = {"act": 0, "grad": 1}


class PipelineExecutor:
    def __init__(self, stages: Dict[int, Any], num_stages: int, strategy, mesh, grad_sync=None,
                 tied=None, rng=None, timeout_s: float = 120.0, input_names=None):
        self.stages = stages                       # stage id -> StageProgram (split_stages)
        self.num_stages = num_stages
        self.strategy = strategy
        self.mesh = mesh
        self.grad_sync = grad_sync
        self.tied = tied or []                     # [(parameter, process group)] summed across stages
        self.rng = rng
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.input_names = input_names            # placeholder names of the user's batch, in order
        self.gm = next(iter(stages.values())).gm
        self.schedule = build_schedule(strategy.schedule if strategy.virtual_stages == 1 else "interleaved-1f1b",
                                       mesh.pp, strategy.microbatches, strategy.virtual_stages)[mesh.pp_rank]
        self.timeline: List[Tuple[float, float, Any]] = []   # last step: (start s, end s, Instr)
        self.peak_in_flight: Dict[int, int] = {}             # stage -> most microbatches held at once

    # ---- communication ------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.mesh.rank_at(self.mesh.dp_rank, stage % self.mesh.pp, self.mesh.tp_rank)

    def _tag(self, kind: str, stage: int, mb: int, index: int) -> int:
        return ((_KIND[kind] * self.num_stages + stage) * 4096 + mb) * 256 + index

    def _recv(self, kind, stage, mb, metas, peer_stage) -> List[torch.Tensor]:
        tensors = []
        for i, meta in enumerate(metas):
            buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self._device())
            work = dist.irecv(buffer, src=self._peer(peer_stage), tag=self._tag(kind, stage, mb, i))
            work.wait(self.timeout)
            tensors.append(buffer)
        return tensors

    def _send(self, kind, stage, mb, tensors, peer_stage, pending) -> None:
        for i, tensor in enumerate(tensors):
            if tensor is None:
                continue
            pending.append(dist.isend(tensor.detach().contiguous(), dst=self._peer(peer_stage),
                                      tag=self._tag(kind, stage, mb, i)))

    def _device(self):
        return next(iter(self.gm.parameters()), torch.empty(0)).device

    # ---- training -----------------------------------------------------------------------
    def _stage_inputs(self, program, batch: Dict[str, Any], received: List[torch.Tensor]) -> List[Any]:
        return [batch[name] for name in program.inputs] + received

    def train_step(self, flat_inputs: List[Any], target: Any) -> torch.Tensor:
        m = self.strategy.microbatches
        values = list(flat_inputs) + ([target] if target is not None else [])
        micro = split_microbatches(values, m)
        batches = [dict(zip(self.input_names, mb)) for mb in micro]
        state: Dict[Tuple[int, int], Dict[str, Any]] = {}
        pending: List[Any] = []
        total = torch.zeros((), dtype=torch.float64)
        self.timeline, self._in_flight = [], {}
        self.peak_in_flight = {stage: 0 for stage in self.stages}
        start = time.perf_counter()
        with ops.mode(training=True), ops.running_on(self.mesh), ops.rng_streams(self.rng):
            for instr in self.schedule:
                began = time.perf_counter() - start
                total += self._run(instr, batches, state, pending, m)
                if instr.op in ("forward", "backward"):
                    self.timeline.append((began, time.perf_counter() - start, instr))
        for work in pending:
            work.wait(self.timeout)
        self._sync_gradients()
        return total / m

    def _run(self, instr, batches, state, pending, m) -> float:
        key = (instr.stage, instr.mb)
        program = self.stages.get(instr.stage)
        slot = state.setdefault(key, {})
        if instr.op == "recv_act":
            received = self._recv("act", instr.stage, instr.mb, program.receive_meta, instr.stage - 1)
            for tensor, meta in zip(received, program.receive_meta):
                tensor.requires_grad_(meta.requires_grad)
            slot["received"] = received
        elif instr.op == "forward":
            self._count(instr.stage, +1)
            args = self._stage_inputs(program, batches[instr.mb], slot.get("received", []))
            slot["outputs"] = program.gm(*args)
            if program.is_last:
                loss = slot["outputs"][0]
                slot["outputs"] = None  # only the loss is needed for backward
                slot["loss"] = loss
                return float(loss.detach())
        elif instr.op == "send_act":
            self._send("act", instr.stage + 1, instr.mb, list(slot["outputs"]), instr.stage + 1, pending)
        elif instr.op == "recv_grad":
            metas = self.stages[instr.stage].send_meta
            needs = [i for i, meta in enumerate(metas) if meta.requires_grad]
            grads = self._recv("grad", instr.stage, instr.mb, [metas[i] for i in needs], instr.stage + 1)
            slot["grads"] = dict(zip(needs, grads))
        elif instr.op == "backward":
            self._backward(program, slot, m)
            self._count(instr.stage, -1)
        elif instr.op == "send_grad":
            grads = [t.grad for t, meta in zip(slot["received"], program.receive_meta) if meta.requires_grad]
            self._send("grad", instr.stage - 1, instr.mb, [g if g is not None else torch.zeros(1) for g in grads],
                       instr.stage - 1, pending)
            state.pop((instr.stage, instr.mb), None)
        return 0.0

    def _count(self, stage: int, change: int) -> None:
        """Microbatches whose activations this stage holds: forward done, backward not yet."""
        self._in_flight[stage] = self._in_flight.get(stage, 0) + change
        self.peak_in_flight[stage] = max(self.peak_in_flight[stage], self._in_flight[stage])

    def _backward(self, program, slot, m) -> None:
        if program.is_last:
            # loss_fn means over its microbatch; equal microbatches make the mean of means
            # the mean over the whole local batch
            (slot.pop("loss") / m).backward()
            return
        outputs = slot.pop("outputs")
        pairs = [(outputs[i], grad) for i, grad in slot.pop("grads").items() if outputs[i].requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def _sync_gradients(self) -> None:
        """Tied weights first (summed over the stages holding a copy), then data parallel."""
        for param, group in self.tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            work = dist.all_reduce(param.grad, group=group, async_op=True)
            work.wait(self.timeout)
        if self.grad_sync is not None:
            self.grad_sync.finish()

    # ---- evaluation ---------------------------------------------------------------------
    def forward(self, flat_inputs: List[Any]) -> List[Any]:
        """Forward-only schedule; the last stage's outputs are broadcast to every pp rank."""
        forward_programs, output_metas = self.eval_programs, self.output_metas
        micro_batch = self.micro_batch
        local_batch = batch_size(flat_inputs, "pm(x)")
        if local_batch % micro_batch:
            raise ValueError(f"pm(x): the batch of {local_batch} does not split into the compiled "
                             f"microbatch size {micro_batch}. Fix: pass a multiple of {micro_batch} samples.")
        m = local_batch // micro_batch
        names = [n for n in self.input_names if n != "target"]
        batches = [dict(zip(names, mb)) for mb in split_microbatches(flat_inputs, m)]
        outputs: List[List[torch.Tensor]] = []
        pending: List[Any] = []
        schedule = forward_only(self.mesh.pp, m, self.strategy.virtual_stages)[self.mesh.pp_rank]
        state: Dict[Tuple[int, int], Dict[str, Any]] = {}
        with torch.no_grad(), ops.mode(training=False), ops.running_on(self.mesh):
            for instr in schedule:
                program = forward_programs[instr.stage]
                slot = state.setdefault((instr.stage, instr.mb), {})
                if instr.op == "recv_act":
                    slot["received"] = self._recv("act", instr.stage, instr.mb, program.receive_meta, instr.stage - 1)
                elif instr.op == "forward":
                    slot["outputs"] = program.gm(*self._stage_inputs(program, batches[instr.mb], slot.get("received", [])))
                    if program.is_last:
                        outputs.append(list(slot["outputs"]))
                elif instr.op == "send_act":
                    self._send("act", instr.stage + 1, instr.mb, list(slot.pop("outputs")), instr.stage + 1, pending)
        for work in pending:
            work.wait(self.timeout)
        return self._broadcast_outputs(outputs, output_metas, m)

    def _broadcast_outputs(self, outputs, metas, m) -> List[torch.Tensor]:
        last_rank = (self.num_stages - 1) % self.mesh.pp
        source = self.mesh.rank_at(self.mesh.dp_rank, last_rank, self.mesh.tp_rank)
        result = []
        for i, meta in enumerate(metas):
            if self.mesh.pp_rank == last_rank:
                tensor = torch.cat([out[i] for out in outputs], dim=0) if m > 1 else outputs[0][i]
            else:
                shape = (meta.shape[0] * m,) + tuple(meta.shape[1:]) if meta.shape else meta.shape
                tensor = torch.empty(shape, dtype=meta.dtype, device=self._device())
            work = dist.broadcast(tensor.contiguous(), src=source, group=self.mesh.group("pp"), async_op=True)
            work.wait(self.timeout)
            result.append(tensor)
        return result


__all__ = ["PipelineExecutor"]

"""Runs this rank's pipeline stages under a schedule (graphpar/runtime/pipeline/schedules.py).

The schedule is a list of instructions for this rank; each is executed in order:

    recv_act / recv_grad   receive from the neighbour stage's rank, into buffers whose
                           shapes and dtypes come from the stage plan (records), not from a
                           handshake; posted with the communication before the compute op
                           ahead of it, waited for where the schedule has it; a peer that
                           never sends fails at the timeout
    forward / backward     run the stage GraphModule / autograd on its saved outputs
    backward_weight        (schedules that split backward) the weight gradients the stage's
                           backward of that microbatch left queued (runtime/split_backward.py)
    send_act / send_grad   asynchronous send; all sends are waited for at the end of a step

Peers are the ranks holding the neighbour stages with this rank's dp and tp coordinates
(Strategy.stage_rank); neighbour stages on this very rank (the V's turn under zbv) hand a
copy over in memory. With GRAPHPAR_PIPELINE_TRANSPORT=shm, when all the pipeline's ranks
share a host and compute on the CPU, messages travel through shared memory on the ranks' own
threads (shm_transport.py: a send never waits, a receive waits in the kernel until its
message is there) instead of through gloo, whose transport threads must find a core while
the ranks compute.
Gradients travel only for values that need one (integer ids, masks and the like don't).
Every tensor is tagged with (kind, stage, microbatch, index) so messages cannot be matched
to the wrong receive.
"""
from __future__ import annotations

import contextlib
import datetime
import time
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from graphpar.distributed import faults
from graphpar.runtime import ops, zero3
from graphpar.runtime.grad_divisor import GradientDivisor
from graphpar.runtime.single_stage import batch_size, split_microbatches
from graphpar.runtime.pipeline import shm_transport
from graphpar.runtime.pipeline.schedules import build_eval_schedule, build_schedule, splits_backward
from graphpar.runtime.grad_sync import flat_grads_and_usage, write_grads
from graphpar.runtime.split_backward import WeightGradients, split_parameters

_KIND = {"act": 0, "grad": 1}
_COMMUNICATION = ("send_act", "recv_act", "send_grad", "recv_grad")
_BACKWARDS = ("backward", "backward_weight")


def _runs(schedule) -> List[Tuple[List[Any], List[Any]]]:
    """Consecutive communication instructions together, every other instruction alone; each
    run with the receives of the next communication run after it (posted ahead)."""
    groups: List[List[Any]] = []
    for instr in schedule:
        if instr.op == "step":
            continue
        if instr.op in _COMMUNICATION and groups and groups[-1][0].op in _COMMUNICATION:
            groups[-1].append(instr)
        else:
            groups.append([instr])
    ahead: List[Any] = []
    runs: List[Tuple[List[Any], List[Any]]] = []
    for group in reversed(groups):
        runs.append((group, ahead))
        if group[0].op in _COMMUNICATION:
            ahead = [i for i in group if i.op.startswith("recv")]
    return runs[::-1]


class PipelineExecutor:
    def __init__(self, stages: Dict[int, Any], num_stages: int, strategy, mesh, divisor: GradientDivisor,
                 grad_sync=None, tied=None, rng=None, timeout_s: float = 120.0, input_names=None,
                 loss_count: bool = False):
        self.stages = stages                       # stage id -> StageProgram (split_stages)
        self.num_stages = num_stages
        self.strategy = strategy
        self.mesh = mesh
        self.divisor = divisor                     # the loss's backward scaling and the token counts
        self.loss_count = loss_count               # the last stage returns (loss_sum, count)
        self.grad_sync = grad_sync
        self.loss_scale = 1.0  # fp16 training scales the loss (graphpar.runtime.placement.precision)
        self.tied = tied or []                     # [(parameter, process group)] summed across stages
        self.rng = rng
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.input_names = input_names            # placeholder names of the user's batch, in order
        self.gm = next(iter(stages.values())).gm
        # zero=3: the buckets each stage gathers, whose shards stand for its trained weights
        self.buckets = {stage: zero3.buckets_of(program.gm) for stage, program in stages.items()}
        self.schedule = build_schedule(strategy.schedule, mesh.pp, strategy.microbatches,
                                       strategy.virtual_stages)[mesh.pp_rank]
        # the weight gradients each forward queues for its backward_weight (split schedules only)
        self.weight_grads = WeightGradients() if splits_backward(strategy.schedule) else None
        self._local: Dict[int, torch.Tensor] = {}   # messages between stages of this rank, by tag
        # receives posted ahead: (op, stage, mb) -> (buffers, their works)
        self._posted: Dict[Tuple[str, int, int], Tuple[List[torch.Tensor], List[Any]]] = {}
        self._arm_at = self._final_gradients()
        self._shm: Optional[shm_transport.SharedMemoryChannels] = None   # set up at the first step
        self._connected = False
        self.timeline: List[Tuple[float, float, Any]] = []   # last step: (start s, end s, Instr)
        self.peak_in_flight: Dict[int, int] = {}             # stage -> most microbatches held at once

    def _final_gradients(self) -> Dict[Tuple[str, int, int], List[torch.nn.Parameter]]:
        """(op, stage, microbatch) of the instruction that makes each parameter's gradient
        final -> those parameters, armed just before it so that data-parallel buckets start
        during it: its stage's last backward, or, for a weight whose gradient the stage's
        program splits off (passes/split_backward.py), the stage's last backward_weight. A
        parameter two local stages read waits for the later one; tied weights (summed over
        pp ranks after the schedule) are never armed, so their buckets start after the sum.
        Every earlier instruction's gradient (an earlier microbatch's, or a split weight's
        empty one from backward) arrives unarmed and is not counted."""
        last: Dict[Tuple[str, int], Tuple[int, int]] = {}   # (op, stage) -> (position, mb) of its last one
        for n, i in enumerate(self.schedule):
            if i.op in _BACKWARDS:
                last[(i.op, i.stage)] = (n, i.mb)
        tied = {id(p) for p, _ in self.tied}
        final: Dict[int, Tuple[int, Tuple[str, int, int], torch.nn.Parameter]] = {}   # id -> (position, key, param)
        for stage, program in self.stages.items():
            split = {id(p) for p in split_parameters(program.gm)}
            # at zero=3 a stage's trained weights are the shards of the buckets it gathers
            for p in [*program.gm.parameters(), *(b.shard for b in self.buckets[stage])]:
                op = "backward_weight" if id(p) in split else "backward"
                n, mb = last[(op, stage)]
                if id(p) not in tied and n > final.get(id(p), (-1, ("", 0, 0), None))[0]:
                    final[id(p)] = (n, (op, stage, mb), p)
        arm_at: Dict[Tuple[str, int, int], List[torch.nn.Parameter]] = {}
        for _, key, p in final.values():
            arm_at.setdefault(key, []).append(p)
        return arm_at

    # ---- communication ------------------------------------------------------------------
    def _peer(self, stage: int) -> int:
        return self.mesh.rank_at(self.mesh.dp_rank, self.strategy.stage_rank(stage), self.mesh.tp_rank)

    def _tag(self, kind: str, stage: int, mb: int, index: int) -> int:
        return ((_KIND[kind] * self.num_stages + stage) * 4096 + mb) * 256 + index

    def _outgoing(self, instr, slot, program) -> List[Tuple[torch.Tensor, int, int]]:
        """(tensor, tag, peer stage) of each message a send instruction sends."""
        if instr.op == "send_act":
            tensors, kind, peer = list(slot["outputs"]), "act", instr.stage + 1
        else:
            needed = [(t, meta) for t, meta in zip(slot["received"], program.receive_meta) if meta.requires_grad]
            # a received value this stage never used has no gradient: send zeros of its shape
            tensors = [t.grad if t.grad is not None else torch.zeros(meta.shape, dtype=meta.dtype)
                       for t, meta in needed]
            kind, peer = "grad", instr.stage - 1
        return [(t.detach().contiguous(), self._tag(kind, peer, instr.mb, i), peer) for i, t in enumerate(tensors)]

    def _incoming(self, instr, program) -> Tuple[List[torch.Tensor], List[int], int]:
        """Buffers, shaped by the plan, and tags of each message a receive instruction takes."""
        if instr.op == "recv_act":
            metas, kind, peer = program.receive_meta, "act", instr.stage - 1
        else:
            metas = [meta for meta in program.send_meta if meta.requires_grad]
            kind, peer = "grad", instr.stage + 1
        buffers = [torch.empty(meta.shape, dtype=meta.dtype, device=self._device()) for meta in metas]
        return buffers, [self._tag(kind, instr.stage, instr.mb, i) for i in range(len(metas))], peer

    def _store(self, instr, slot, program, buffers) -> None:
        if instr.op == "recv_act":
            for tensor, meta in zip(buffers, program.receive_meta):
                tensor.requires_grad_(meta.requires_grad)
            slot["received"] = buffers
        else:
            needs = [i for i, meta in enumerate(program.send_meta) if meta.requires_grad]
            slot["grads"] = dict(zip(needs, buffers))

    def _communicate(self, instrs, programs, state, pending, ahead=()) -> None:
        """Post a run of consecutive send/receive instructions as one batch (a stage's send
        of activations and its receive of gradients travel together, as in Megatron), with
        the receives of the next run (`ahead`), then wait for this run's receives; the sends
        are waited for at the end of the step. Receives go out one compute op early because
        gloo moves a message's data only once both sides have posted it: posted when needed,
        a message sent long before still costs a round trip between the ranks' transport
        threads on the critical path (several ms on a loaded machine, an instruction's worth
        of idle time per transfer), while posted ahead it arrives during the compute op. A
        message between two stages of this rank is a copy left in `_local` (sends go first).
        Over shared memory nothing is posted: sends are done when made, receives read when reached."""
        operations, owners, receives = [], [], []
        for instr in sorted(instrs, key=lambda i: not i.op.startswith("send")):
            if instr.op.startswith("send"):
                for op in self._sends(instr, state.setdefault((instr.stage, instr.mb), {}), programs[instr.stage]):
                    operations.append(op)
                    owners.append(None)
                if instr.op == "send_grad":
                    state.pop((instr.stage, instr.mb), None)
            else:
                receives.append(instr)
        # over shared memory nothing is posted ahead: a receive reads its message when reached
        for instr in [*receives, *ahead] if self._shm is None else []:
            key = (instr.op, instr.stage, instr.mb)
            if instr.peer == self.mesh.pp_rank or key in self._posted:
                continue
            buffers, tags, peer = self._incoming(instr, programs[instr.stage])
            self._posted[key] = (buffers, [])
            for buffer, tag in zip(buffers, tags):
                operations.append(dist.P2POp(dist.irecv, buffer, self._peer(peer), tag=tag))
                owners.append(key)
        works = dist.batch_isend_irecv(operations) if operations else []
        for work, key in zip(works, owners):
            if key is None:
                pending.append(work)
            else:
                self._posted[key][1].append(work)
        for instr in receives:
            program = programs[instr.stage]
            self._store(instr, state.setdefault((instr.stage, instr.mb), {}), program,
                        self._received(instr, program))

    def _sends(self, instr, slot, program) -> List[Any]:
        """The point-to-point operations of a send instruction (none to a stage of this rank,
        whose message is left in `_local`, and none over shared memory, where a send is done
        when made)."""
        operations = []
        for tensor, tag, peer in self._outgoing(instr, slot, program):
            if instr.peer == self.mesh.pp_rank:
                self._local[tag] = tensor.clone()
            elif self._shm is not None:
                self._shm.send(self._peer(peer), tag, tensor)
            else:
                operations.append(dist.P2POp(dist.isend, tensor, self._peer(peer), tag=tag))
        return operations

    def _received(self, instr, program) -> List[torch.Tensor]:
        """A receive instruction's tensors: taken from `_local`, or its posted receives waited for."""
        if instr.peer == self.mesh.pp_rank:
            return [self._local.pop(tag) for tag in self._incoming(instr, program)[1]]
        if self._shm is not None:
            buffers, tags, peer = self._incoming(instr, program)
            for buffer, tag in zip(buffers, tags):
                self._shm.receive(self._peer(peer), tag, buffer, f"{instr.op} of stage {instr.stage}, microbatch "
                                  f"{instr.mb} (tag {tag})")
            return buffers
        buffers, works = self._posted.pop((instr.op, instr.stage, instr.mb))
        for work in works:
            work.wait(self.timeout)
        return buffers

    def _connect(self) -> None:
        """The shared-memory channels to the neighbour stages' ranks, set up once, at the first
        step (collective over the pp group, which every rank of the pipeline runs)."""
        if not self._connected:
            neighbours = {self._peer(n) for s in self.stages for n in (s - 1, s + 1)
                          if 0 <= n < self.num_stages and self.strategy.stage_rank(n) != self.mesh.pp_rank}
            self._shm = shm_transport.connect(self.mesh, neighbours, self._device().type == "cpu",
                                              self.timeout.total_seconds())
            self._connected = True
        if self._shm is not None:
            self._shm.begin_step()

    def _device(self):
        return next(iter(self.gm.parameters()), torch.empty(0)).device

    # ---- training -----------------------------------------------------------------------
    def _stage_inputs(self, program, batch: Dict[str, Any], received: List[torch.Tensor]) -> List[Any]:
        return [batch[name] for name in program.inputs] + received

    @faults.guard_step
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
        self._forget_pending()   # what a failed step may have left
        self._connect()
        start = time.perf_counter()
        with ops.mode(training=True), ops.running_on(self.mesh), ops.rng_streams(self.rng), \
                zero3.regathered_in_backward(any(self.buckets.values())):
            for group, ahead in _runs(self.schedule):
                if group[0].op in _COMMUNICATION:
                    self._communicate(group, self.stages, state, pending, ahead)
                    continue
                instr = group[0]
                began = time.perf_counter() - start
                total += self._run(instr, batches, state, pending)
                self.timeline.append((began, time.perf_counter() - start, instr))
        for work in pending:
            work.wait(self.timeout)
        self._check_nothing_pending()
        self._sync_gradients()
        return total

    def _forget_pending(self) -> None:
        self._local.clear()
        self._posted.clear()
        if self.weight_grads is not None:
            self.weight_grads.clear()

    def _check_nothing_pending(self) -> None:
        """Every weight gradient ran and every local message was taken: else the schedule lost work."""
        left = self.weight_grads.pending() if self.weight_grads is not None else []
        if left or self._local:
            raise RuntimeError(f"pipeline rank {self.mesh.pp_rank}: the schedule ended with weight gradients "
                               f"of (stage, microbatch) {left} not run and {len(self._local)} local messages not "
                               f"received; a schedule must run each backward_weight once and receive every send. "
                               f"Fix: check the schedule with graphpar.runtime.pipeline.check.check_schedule("
                               f"schedule, pp, microbatches, virtual_stages, name=...), which names the instruction")

    def _run(self, instr, batches, state, pending) -> float:
        """A compute instruction (forward, backward, backward_weight); returns the loss a last
        stage computed."""
        program = self.stages.get(instr.stage)
        if self.grad_sync is not None and (instr.op, instr.stage, instr.mb) in self._arm_at:
            self.grad_sync.arm(self._arm_at[(instr.op, instr.stage, instr.mb)])
        if instr.op == "backward_weight":
            self.weight_grads.run(instr.stage, instr.mb)
            return 0.0
        slot = state.setdefault((instr.stage, instr.mb), {})
        if instr.op == "forward":
            self._count(instr.stage, +1)
            args = self._stage_inputs(program, batches[instr.mb], slot.get("received", []))
            with self._collecting(instr):
                slot["outputs"] = program.gm(*args)
            if program.is_last:
                loss = slot["outputs"][0]
                if self.loss_count:
                    self.divisor.add_count(slot["outputs"][1])
                slot["outputs"] = None  # only the loss is needed for backward
                slot["loss"] = loss
                return float(loss.detach())
        elif instr.op == "backward":
            self._backward(program, slot)
            self._count(instr.stage, -1)
        return 0.0

    def _collecting(self, instr):
        """Under a split schedule, the forward's split calls queue their weight gradients for
        this (stage, microbatch)'s backward_weight."""
        if self.weight_grads is None:
            return contextlib.nullcontext()
        return self.weight_grads.collecting(instr.stage, instr.mb)

    def _count(self, stage: int, change: int) -> None:
        """Microbatches whose activations this stage holds: forward done, backward not yet."""
        self._in_flight[stage] = self._in_flight.get(stage, 0) + change
        self.peak_in_flight[stage] = max(self.peak_in_flight[stage], self._in_flight[stage])

    def _backward(self, program, slot) -> None:
        if program.is_last:
            self.divisor.scaled_for_backward(slot.pop("loss"), self.loss_scale).backward()
            return
        outputs = slot.pop("outputs")
        pairs = [(outputs[i], grad) for i, grad in slot.pop("grads").items() if outputs[i].requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def _sync_gradients(self) -> None:
        """Tied weights first (summed over the stages holding a copy), then data parallel."""
        buckets = {id(b.shard): b for stage_buckets in self.buckets.values() for b in stage_buckets}
        for param, group in self.tied:
            if id(param) in buckets:  # zero=3: the weight's own bucket, its reduced rows summed
                buckets[id(param)].sum_reduced_over(group)
                continue
            summed = flat_grads_and_usage([param])
            dist.all_reduce(summed, group=group, async_op=True).wait(self.timeout)
            write_grads([param], summed, 1)
        if self.grad_sync is not None:
            self.grad_sync.finish()

    # ---- evaluation ---------------------------------------------------------------------
    def forward(self, flat_inputs: List[Any]) -> List[Any]:
        """Forward-only schedule; the last stage's outputs are broadcast to every pp rank."""
        forward_programs, output_metas = self.eval_programs, self.output_metas
        # ParallelModule chose a program whose microbatch divides the batch (graphpar/runtime/shapes.py)
        m = batch_size(flat_inputs, "pm(x)") // self.micro_batch
        names = [n for n in self.input_names if n != "target"]
        batches = [dict(zip(names, mb)) for mb in split_microbatches(flat_inputs, m)]
        outputs: List[List[torch.Tensor]] = []
        pending: List[Any] = []
        schedule = build_eval_schedule(self.mesh.pp, m, self.strategy.virtual_stages,
                                       self.strategy.schedule)[self.mesh.pp_rank]
        state: Dict[Tuple[int, int], Dict[str, Any]] = {}
        self._connect()
        with torch.no_grad(), ops.mode(training=False), ops.running_on(self.mesh):
            for group, ahead in _runs(schedule):
                if group[0].op in _COMMUNICATION:
                    self._communicate(group, forward_programs, state, pending, ahead)
                    continue
                instr = group[0]
                program = forward_programs[instr.stage]
                slot = state.setdefault((instr.stage, instr.mb), {})
                slot["outputs"] = program.gm(*self._stage_inputs(program, batches[instr.mb], slot.get("received", [])))
                if program.is_last:
                    outputs.append(list(slot["outputs"]))
        for work in pending:
            work.wait(self.timeout)
        return self._broadcast_outputs(outputs, output_metas, m)

    def _broadcast_outputs(self, outputs, metas, m) -> List[torch.Tensor]:
        last_rank = self.strategy.stage_rank(self.num_stages - 1)
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

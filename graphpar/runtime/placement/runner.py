"""Runs a rank's update program: each bucket's step starts when its gradients are final.

The executors treat this like data-parallel gradient sync (arm before the last microbatch's
backward, finish after the schedule). During that backward a bucket whose gradients are
complete (after its dp all-reduce, when dp > 1) is handed to one worker thread, which runs
the bucket's "step" nodes: gather, move to the host, update the master weights. Backward
goes on meanwhile. `finish` waits for each bucket in turn (with the collective timeout) and
runs its "write" nodes as soon as it is done: the updated compute weights back to the device
parameters, which is only safe once no backward op can still read them (ZeRO in fp32 has
none: its all-gathers fill the parameters, graphpar/runtime/zero.py). A bucket's "launch" nodes (ZeRO's
reduce-scatter, graphpar/runtime/zero.py) run when it completes, on backward's own thread,
before its step is handed over: each process group gets its collectives from one thread in
one order (the worker's step nodes issue ZeRO's weight all-gathers over a dp group of their
own).

With fp16 (a LossScaler) nothing starts early: whether any rank overflowed is known only
after every gradient is final, and an overflowing step must not touch any master weight.
With ZeRO that also means every full gradient is still on its rank when the scaler checks
them (no reduce-scatter has run). Nor with a token-weighted loss, whose gradients are divided
by the global token count, known only after backward (graphpar/runtime/grad_divisor.py), nor
with gradient-norm clipping, whose norm needs every gradient reduced first: then `finish` runs
every bucket's launch and the nodes before its step (ZeRO's reduce-scatter and its wait) for
all buckets, takes the global norm (graphpar/runtime/grad_norm.py), and only then steps.
Deferred, the whole program runs in `finish`, every step dividing its gradients by the one
post-backward divisor (the `grad_divisor` of MasterWeights, ShardStep and host tables); p.grad
keeps what backward and the dp average left in it.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional

import torch
import torch.fx

from graphpar.ir import PHASE_LAUNCH, PHASE_STEP, PHASE_WRITE, record
from graphpar.runtime.grad_divisor import GradientDivisor
from graphpar.runtime.grad_norm import NormShare
from graphpar.runtime.grad_sync import BucketTracker
from graphpar.runtime.placement.embedding import EmbeddingUpdate
from graphpar.runtime.placement.precision import LossScaler
from graphpar.runtime.placement.update import MasterWeights
from graphpar.runtime.zero import ShardStep
from graphpar.runtime.zero3 import ReducedTracker


def program_buckets(program: torch.fx.GraphModule) -> Dict[object, Dict[str, List[torch.fx.Node]]]:
    """bucket -> phase -> its nodes in program order; nodes of no bucket (host tables'
    row updates) under the key None, run after every bucket's writes."""
    def empty():
        return {PHASE_LAUNCH: [], PHASE_STEP: [], PHASE_WRITE: []}
    buckets: Dict[object, Dict[str, List[torch.fx.Node]]] = {None: empty()}
    for node in program.graph.nodes:
        rec = record(node) if node.op != "output" else None
        if rec is not None and rec.phase is not None:
            buckets.setdefault(rec.bucket, empty())[rec.phase].append(node)
    return buckets


class UpdateRunner:
    def __init__(self, program: torch.fx.GraphModule, divisor: GradientDivisor, grad_sync=None,
                 timeout_s: float = 120.0, scaler: Optional[LossScaler] = None, share: Optional[NormShare] = None):
        self.program = program
        self.divisor = divisor
        self.share = share  # what this rank counts of the global gradient norm (with clipping)
        self.scaler = scaler
        self.nodes = program_buckets(program)
        self.bucket_params: List[List[torch.nn.Parameter]] = program.buckets
        self.grad_sync = grad_sync
        self.timeout_s = timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="graphpar-host-step")
        self._futures: Dict[int, Future] = {}
        self._env: Dict[torch.fx.Node, Any] = {}
        self._reduced: Dict[int, int] = {}  # bucket -> its first step node not run yet (clipping)
        self.launched_in_backward = 0  # buckets started by backward itself (overlap), ever
        # fp16 (a scaler) or a divisor known only after backward: nothing starts early, the
        # whole update runs in finish. Otherwise a bucket starts when its dp all-reduce starts,
        # or without dp when its gradients are in. With no bucket steps (host tables only) the
        # dp buckets are not the worker's: finish waits for them itself, before the tables'
        # updates read the gradients.
        self.deferred = scaler is not None or divisor.after_backward
        overlap = not self.deferred and bool(self.bucket_params)
        # zero=3: backward reduces each bucket itself, and the bucket says when it is final; the
        # other buckets (all below zero=3, expert weights' at zero=3) start when their gradients are in
        self.unsharded = list(getattr(program, "unsharded", []))
        reduced = {bucket.index for bucket in self.unsharded}
        whole = [[] if k in reduced else params for k, params in enumerate(self.bucket_params)]
        self._trackers = ([BucketTracker(whole, self._launch_in_backward),
                           ReducedTracker(self.unsharded, self._launch_in_backward)]
                          if overlap and grad_sync is None else [])
        if overlap and grad_sync is not None:
            grad_sync.on_launch = self._submit

    def arm(self, params=None) -> None:
        """Start buckets during the next backward: every parameter's, or (a pipeline stage's
        last backward) only `params`'."""
        for tracker in self._trackers:
            tracker.arm(params)
        if self.grad_sync is not None:
            self.grad_sync.arm(params)

    def _launch_in_backward(self, bucket: int) -> None:
        self.launched_in_backward += 1
        self._submit(bucket)

    def _submit(self, bucket: int) -> None:
        self._run(self.nodes[bucket][PHASE_LAUNCH])  # here, so every rank issues them in the same order
        self._futures[bucket] = self._pool.submit(self._step, bucket)

    def _step(self, bucket: int) -> None:
        if self.grad_sync is not None:
            self.grad_sync.complete(bucket)
        self._run_step(bucket)

    def _run_step(self, bucket: int, start: int = 0) -> None:
        """The bucket's step, over the parameters that got a gradient (after any dp sync),
        from its step node `start` on."""
        update = self.program.get_submodule(f"update_{bucket}")  # build_update's names
        if isinstance(update, MasterWeights):  # (ZeRO's step reads the flags its reduction summed)
            update.with_grad = [p.grad is not None for p in self.bucket_params[bucket]]
        self._run(self.nodes[bucket][PHASE_STEP][start:])

    def finish(self) -> None:
        for tracker in self._trackers:
            tracker.disarm()
        try:
            self._finish()
        finally:
            for bucket in self.unsharded:  # nothing gathered or reduced is kept into the next step
                bucket.end_step()

    def _finish(self) -> None:
        if self.deferred:
            self._finish_deferred()
            return
        if self.grad_sync is not None and not self.bucket_params:
            self.grad_sync.finish()
        elif self.grad_sync is not None:
            self.grad_sync.launch_remaining()
        for bucket in range(len(self.bucket_params)):
            if bucket not in self._futures:
                self._submit(bucket)
        try:
            # in the order the worker takes them: a bucket's writes run while later buckets
            # still reduce or step (the worker never touches an earlier bucket's weights)
            for bucket, future in list(self._futures.items()):
                future.result(timeout=self.timeout_s)
                self._run(self.nodes[bucket][PHASE_WRITE])
            self._run(self.nodes[None][PHASE_WRITE])
        finally:
            self._futures, self._env = {}, {}
            if self.grad_sync is not None:
                self.grad_sync.reset()

    def _finish_deferred(self) -> None:
        if self.grad_sync is not None:
            self.grad_sync.finish()
        overflow = self._overflowed() if self.scaler is not None else False
        scale = self.scaler.scale if self.scaler is not None else 1.0
        if self.divisor.clipping:
            self._clip(overflow, scale)
        divisor = self.divisor.value(scale)
        for module in self.program.modules():
            target = module.host_table if isinstance(module, EmbeddingUpdate) else module
            if hasattr(target, "grad_divisor"):
                target.grad_divisor = divisor
        if overflow:
            for module in self.program.modules():
                if isinstance(module, EmbeddingUpdate):
                    module.host_table.discard()
        else:
            self.run_all()
        if self.scaler is not None:
            self.scaler.update(overflow)

    def _clip(self, overflow: bool, scale: float) -> None:
        """The global norm over every gradient as the steps will take it (ZeRO's reduced shards,
        else p.grad after the dp average, and host tables' rows) into the divisor. A step the
        fp16 scaler skips is neither clipped nor stepped."""
        self._reduced = {}
        if overflow:
            self.divisor.skip_clip()
            return
        shards = [(update, self._reduce(bucket)) for bucket, update in enumerate(self._updates())
                  if isinstance(update, ShardStep)]
        tables = [m.host_table for m in self.program.modules() if isinstance(m, EmbeddingUpdate)]
        local = self.share.of_whole() + self.share.of_shards(shards) + self.share.of_tables(tables)
        self.divisor.clip(local, scale)

    def _updates(self) -> List[torch.nn.Module]:
        return [self.program.get_submodule(f"update_{bucket}") for bucket in range(len(self.bucket_params))]

    def _reduce(self, bucket: int) -> Optional[torch.Tensor]:
        """Run the bucket's launch and its step nodes before the update: the gradient as the
        update takes it (ZeRO: this rank's reduced row, or None where no rank's backward
        reached the bucket). run_all goes on from the update."""
        steps = self.nodes[bucket][PHASE_STEP]
        at = next(i for i, node in enumerate(steps) if node.op == "call_module" and node.target == f"update_{bucket}")
        self._run(self.nodes[bucket][PHASE_LAUNCH])
        self._run(steps[:at])
        self._reduced[bucket] = at
        return self._env[steps[at].args[0]]

    def _overflowed(self) -> bool:
        """Whether any rank's (loss-scaled) gradients overflowed (collective over the world)."""
        grads = [p.grad for bucket in self.bucket_params for p in bucket if p.grad is not None]
        # zero=3 holds no whole gradient: each rank checks the rows its reduce-scatters summed
        # (an inf anywhere reaches the row of the rank owning it), and found_overflow tells all
        grads += [bucket.reduced.result() for bucket in self.unsharded if bucket.reduced is not None]
        return self.scaler.found_overflow(grads, self.timeout_s)

    def run_all(self) -> None:
        """The whole program at once, in bucket order (no backward to overlap with)."""
        for bucket in range(len(self.bucket_params)):
            start = self._reduced.pop(bucket, None)
            if start is None:
                self._run(self.nodes[bucket][PHASE_LAUNCH])
            self._run_step(bucket, start or 0)
            self._run(self.nodes[bucket][PHASE_WRITE])
        self._run(self.nodes[None][PHASE_WRITE])
        self._env = {}

    def _run(self, nodes: List[torch.fx.Node]) -> None:
        for node in nodes:
            args = torch.fx.node.map_arg(node.args, lambda n: self._env[n])
            kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: self._env[n])
            if node.op == "call_module":
                self._env[node] = self.program.get_submodule(str(node.target))(*args, **kwargs)
            elif node.op == "call_function":
                self._env[node] = node.target(*args, **kwargs)
            else:
                raise RuntimeError(f"update program node {node.name} has op {node.op!r}; only call_module "
                                   f"and call_function belong to a bucket")

    def remove(self) -> None:
        for tracker in self._trackers:
            tracker.remove()
        if self.grad_sync is not None:
            self.grad_sync.remove()
        self._pool.shutdown(wait=False)

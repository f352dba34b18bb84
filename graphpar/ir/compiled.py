"""The typed records that cross from the compiler to the runtime.

    compile options  --(frontend)-->  PassContext.options: CompileOptions
    passes           --(one field each)-->  PassContext.results: PassResults (passes/context.py)
    end of pipeline  --(frozen, per rank)-->  CompiledRank  --> ParallelModule (the runtime)
    compiled again   <--(runtime)--  PreviousCompile: the state the new program must share
                     (the lazy loss trace; a program for another input shape)

They live here, on the IR floor, because both sides read them: the passes (above the
runtime) build them and the runtime (below the passes) runs them, so neither imports the
other's modules for them (docs/architecture.md, "The hand-off"). Nothing here runs a pass.
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from graphpar.ir.node_record import Shard, TensorMeta

if TYPE_CHECKING:  # annotations only: strategy and mesh are records of their own floor
    from graphpar.distributed.mesh import Mesh
    from graphpar.strategy import Strategy


# A training run pads to a few lengths (buckets); a stream of ever-new shapes would compile
# without end, each program kept (graphpar/runtime/shapes.py).
DEFAULT_MAX_SHAPES = 8


@dataclass(frozen=True)
class CompileOptions:
    """graphpar.compile's keyword options, checked by the frontend; passes read them as
    `ctx.options.<name>` (docs/strategy.md lists what each one does)."""
    device: Optional[torch.device]        # where this rank's parameters live (None, as given to
                                          # compile: the model's device; a PassContext's is resolved)
    bucket_bytes: int                     # data-parallel gradient bucket size
    tracer: str = "auto"                  # "auto", "fx" or "export"
    leaf_modules: Tuple[Any, ...] = ()    # module paths or classes the tracer keeps opaque
    tp_replicate: Tuple[str, ...] = ()    # module paths tensor parallelism leaves whole
    dropout_masks: str = "local"          # "local" or "tp_invariant"
    max_grad_norm: Optional[float] = None  # clip the global gradient norm to this (None: no clipping)
    max_shapes: int = DEFAULT_MAX_SHAPES  # programs a ParallelModule keeps, one per input shape

    def as_kwargs(self) -> Dict[str, Any]:
        """The options as compile's keyword arguments (the planner takes the same ones)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(frozen=True)
class CompileCall:
    """What graphpar.compile was called with (the whole DP-local batch): the runtime keeps it
    for pm.report(), which plans the same call."""
    model: nn.Module
    strategy: "Strategy"
    example_inputs: Tuple[Any, ...]
    example_target: Any
    loss_fn: Optional[Callable]
    optimizer: Optional[Callable]
    options: CompileOptions


@dataclass(frozen=True)
class PreviousCompile:
    """What a program compiled again must share with the programs before it: ParallelModule
    traces the model again with its loss at the first train_step when compile had no
    example_target, and for every input shape it has not seen (graphpar/runtime/shapes.py);
    the new program keeps the old one's tensors, update program, host tables and stages."""
    parameters: Mapping[str, torch.Tensor]     # canonical name -> this rank's tensor
    update: Optional[torch.fx.GraphModule]     # build_update's program (None: none)
    host_tables: Mapping[str, nn.Module]       # lower_placement's HostEmbedding modules
    stage_plan: Optional["StagePlan"] = None   # partition_stages' cut (None at one stage)


@dataclass(frozen=True)
class TracedProgram:
    """A traced GraphModule in graphpar IR plus what is needed to call it like the model."""
    gm: torch.fx.GraphModule
    front_end: str                      # "fx" or "export"
    in_spec: pytree.TreeSpec            # structure of the model's positional inputs
    out_spec: pytree.TreeSpec           # structure of the model's output
    num_inputs: int                     # flat input placeholders (the target comes after)
    has_loss: bool                      # output[0] is the loss; False: outputs only
    # output[1] is the count of a token-weighted loss_fn's (loss_sum, count): output[0] is then
    # a sum, which train_step divides by the count summed over every microbatch and dp rank
    loss_count: bool = False

    @property
    def loss_outputs(self) -> int:
        """How many leading outputs are the loss: 0, 1 (the loss), or 2 (loss_sum, count)."""
        return 2 if self.loss_count else int(self.has_loss)


@dataclass(frozen=True)
class Unit:
    """One layer of the model, in execution order."""

    path: str  # module path, e.g. "blocks.3", "features.0", "lm_head"
    module_type: str  # class name, e.g. "Block", "Conv2d", "Linear"
    params: int  # parameter elements this unit reads (a tied weight counts on every unit reading it)
    repeated: bool  # a child of an nn.ModuleList / nn.Sequential
    seconds: float = 0.0  # measured time, used by the "profile" policy
    tied: tuple[tuple[str, int], ...] = ()  # (name, elements) of those parameters other units read too


@dataclass(frozen=True)
class StagePlan:
    """partition_stages' cut of the model into pipeline stages."""
    num_stages: int
    units: List[Unit]                   # the model's layers in execution order
    bounds: List[int]                   # index in `units` where each stage begins
    stage_of_unit: Mapping[str, int]    # unit path -> stage
    description: str                    # the table `graphpar plan` prints

    def cuts(self) -> Tuple[str, ...]:
        """The module path at which each stage after the first begins."""
        return tuple(self.units[b].path for b in self.bounds[1:])


@dataclass(frozen=True)
class StageProgram:
    """One local pipeline stage, as split_stages cut it."""
    stage: int
    gm: torch.fx.GraphModule
    inputs: List[str]          # placeholder names of the user's batch this stage reads, in order
    receives: List[str]        # values received from stage - 1, in order (after the inputs)
    sends: List[str]           # values sent to stage + 1 (empty for the last stage)
    receive_meta: List[TensorMeta]
    send_meta: List[TensorMeta]
    is_last: bool


@dataclass
class TPPlan:
    """annotate_shards' tensor-parallel plan (passes/tp/solver.py solves it; mutable: rewrite_parallel_layers
    fills `reduce_to`)."""
    tp: int
    specs: Dict[str, object] = field(default_factory=dict)       # node name -> spec (absent: R)
    roles: Dict[str, str] = field(default_factory=dict)          # node name -> role
    params: Dict[str, Shard] = field(default_factory=dict)       # get_attr target -> spec
    fallbacks: List[Tuple[str, str, str]] = field(default_factory=list)  # (node, module, reason)
    # partial sum node (named after rewrite_parallel_layers) -> the spec its reduction gives
    # (absent: Replicate, an all-reduce; a SequenceShard: a reduce-scatter)
    reduce_to: Dict[str, object] = field(default_factory=dict)
    # every linear-like layer whose weight stays whole, as (module, reason): the coverage report
    replicated_linears: List[Tuple[str, str]] = field(default_factory=list)
    # (consumer node, replicated input node) -> the spec of the slice each rank reads there
    local_slices: Dict[Tuple[str, str], Shard] = field(default_factory=dict)


@dataclass(frozen=True)
class CompiledRank:
    """Everything the runtime receives from the compiler for one rank, frozen.

    Built once by the pass manager at the end of the pipeline (passes/context.py
    `hand_off`); ParallelModule reads nothing else. Mappings are read-only views."""
    # what was compiled (the model is the user's, never changed: its state_dict keys and
    # the state the graph does not read come from it)
    model: nn.Module
    strategy: "Strategy"
    mesh: "Mesh"
    example_inputs: Tuple[Any, ...]             # one microbatch of this rank's inputs
    example_target: Any                         # one microbatch of the target, or None
    loss_fn: Optional[Callable]
    options: CompileOptions
    # the programs
    program: TracedProgram                      # input/output structure, front end, has_loss
    gm: torch.fx.GraphModule                    # the rank's program (pp > 1: the driver of its stages)
    stages: Mapping[int, StageProgram]          # local stage -> its program; empty at one stage
    update: Optional[torch.fx.GraphModule]      # the update program (masters, offload), or None
    snapshots: Tuple[Tuple[str, torch.fx.GraphModule], ...]   # (pass, graph after it), for dumps
    # how state is laid out on this rank
    tp_plan: TPPlan                             # layer roles, specs, fallbacks (tp = 1: empty)
    stage_plan: Optional[StagePlan]             # None at one stage
    param_shards: Mapping[str, Shard]           # canonical name -> its tp shard (absent: whole)
    param_stages: Mapping[str, Sequence[int]]   # canonical name -> stages reading it (pp > 1)
    host_tables: Mapping[str, nn.Module]        # HostEmbedding modules by graph name
    host_table_stages: Mapping[str, int]        # host table weight -> the stage looking it up
    uninitialized: bool                         # a meta-device model got uninitialised storage
    # the pipeline's cuts (pp > 1; empty otherwise)
    crossings: Mapping[int, Sequence[str]]      # cut -> names of the values crossing it
    input_names: Tuple[str, ...]                # the rank graph's placeholders
    output_meta: Tuple[Any, ...]                # record value of each program output
    # canonical name -> the number of experts of a weight whose dim 0 is split over the ep
    # ranks (this rank holds E/ep of them: experts ep_rank*E/ep ..); empty without ep
    expert_shards: Mapping[str, int] = field(default_factory=dict)
    # the experts of a list layout (passes/tracing/expert_lists.py) are whole modules: every
    # one's parameter names (of all ep ranks) -> the ep rank holding it; this rank's are in
    # expert_shards too (trained and reduced as expert weights), whole
    expert_owners: Mapping[str, int] = field(default_factory=dict)
    # results of user passes, by their own type (PassResults.put)
    extras: Mapping[type, Any] = field(default_factory=dict)

    def __post_init__(self):
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            if isinstance(value, dict):
                object.__setattr__(self, item.name, types.MappingProxyType(dict(value)))
            elif isinstance(value, list):
                object.__setattr__(self, item.name, tuple(value))

    def extra(self, kind: type) -> Any:
        """The result of type `kind` a user pass left with `ctx.results.put`."""
        return extra_of(self.extras, kind)

    @property
    def graph_modules(self) -> List[torch.fx.GraphModule]:
        """The programs that run: one per local stage, or the rank's one graph."""
        return [p.gm for p in self.stages.values()] if self.stages else [self.gm]


def replica_axis(name: str, expert_shards: Mapping[str, int]) -> str:
    """The mesh axis over whose ranks a parameter's copies are alike, so its gradient is
    averaged, its state sharded (ZeRO) and its first copy broadcast over it: "edp" for an
    expert weight (expert parallelism: the ranks holding the same experts), else "dp"."""
    return "edp" if name in expert_shards else "dp"


def extra_of(extras: Mapping[type, Any], kind: type) -> Any:
    if kind not in extras:
        raise KeyError(f"no pass left a result of type {kind.__name__}; results by type: "
                       f"{sorted(k.__name__ for k in extras)}. Fix: run the pass that calls "
                       f"ctx.results.put({kind.__name__}(...)) earlier (declare produces=({kind.__name__},) on it "
                       f"and requires=({kind.__name__},) on its readers).")
    return extras[kind]


@dataclass(frozen=True)
class RecomputePlan:
    """What the pass chose, per microbatch of the whole program (every stage): the bytes saved
    for backward before and after, and the flops the backward runs again."""
    mode: object
    regions: int
    saved_calls: int
    bytes_before: int
    bytes_after: int
    flops: Dict[str, float]   # per unit (block), one microbatch: forward flops backward runs again
    total_flops: float        # every region's (a planner's surrogate block counted for the blocks it stands for)
    masks: int = 0            # random draws kept (dropout masks), so the backward draws none again
    skipped: int = 0          # calls the backward's replay skips: nothing it needs reads their values

    def explain(self) -> str:
        if isinstance(self.mode, float):
            what = f"a budget of {self.mode:g} x the saved activations"
        else:
            what = {"full": "each block keeps only its inputs",
                    "selective": "each block keeps its matmul and attention outputs"}[self.mode]
        if self.masks:
            what += f" and its dropout masks ({self.masks} kept, 1 byte an element: drawing them again costs more)"
        ratio = self.bytes_after / self.bytes_before if self.bytes_before else 1.0
        return (f"recompute={self.mode!r}: {what}; {self.regions} region(s), {self.saved_calls} call(s) kept, "
                f"saved activations {self.bytes_after} of {self.bytes_before} bytes per microbatch ({ratio:.2f}x), "
                f"{self.skipped} call(s) skipped in the replay (backward reads no value of theirs), "
                f"{self.total_flops / 1e6:.1f} MFLOP per microbatch run again in backward")

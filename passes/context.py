"""What a pass is and what it sees: Pass, PassContext and the typed PassResults.

A pass is a plain function ``fn(gm, ctx) -> gm`` (torch.fx style) wrapped in a `Pass` that
names it, anchors it (user passes) and declares what it `requires` and `produces`: names
of `PassResults` fields ("tp_plan") or of node record fields ("record.stage"). The manager
(manager.py) checks the declarations before running anything; the built-in list is in
builtin.py. At the end of the pipeline `hand_off` freezes the results into the one object
the runtime receives, a `graphpar.ir.compiled.CompiledRank`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from graphpar.ir import NodeRecord, Shard
from graphpar.ir.compiled import (CompiledRank, CompileOptions, PreviousCompile, RecomputePlan, StagePlan, StageProgram, TPPlan,
                                  TracedProgram, extra_of)

PassFn = Callable[[Optional[torch.fx.GraphModule], "PassContext"], torch.fx.GraphModule]
RECORD_PREFIX = "record."


@dataclass
class PassResults:
    """One typed field per result a pass leaves for later passes and the runtime (tag, then
    apply). Each is written by the built-in pass named in its comment, which declares it in
    `produces`; until then it holds the default shown."""
    program: Optional[TracedProgram] = None             # trace
    tp_plan: Optional[TPPlan] = None                    # annotate_shards (filled by rewrite_parallel_layers)
    stage_plan: Optional[StagePlan] = None              # partition_stages (None at one stage)
    param_shards: Dict[str, Shard] = field(default_factory=dict)     # lower_to_rank
    uninitialized: bool = False                         # lower_to_rank
    expert_shards: Dict[str, int] = field(default_factory=dict)      # expert_parallel
    expert_owners: Dict[str, int] = field(default_factory=dict)      # expert_parallel
    update: Optional[torch.fx.GraphModule] = None       # build_update (None: no update program)
    # shard_parameters: the stages reading each parameter it took out of the program (zero=3)
    sharded_readers: Dict[str, List[int]] = field(default_factory=dict)
    host_tables: Dict[str, nn.Module] = field(default_factory=dict)  # lower_placement
    recompute: Optional[RecomputePlan] = None           # recompute (None: no region)
    host_table_stages: Dict[str, int] = field(default_factory=dict)  # lower_placement
    stages: Dict[int, StageProgram] = field(default_factory=dict)    # split_stages (empty at one stage)
    crossings: Dict[int, List[str]] = field(default_factory=dict)    # split_stages
    param_stages: Dict[str, List[int]] = field(default_factory=dict)  # split_stages
    input_names: List[str] = field(default_factory=list)             # split_stages
    output_meta: List[Any] = field(default_factory=list)             # split_stages
    extras: Dict[type, Any] = field(default_factory=dict)            # user passes' own results, by type

    def put(self, value: Any) -> None:
        """Leave a result of a type of your own (a user pass; later passes `get` it by type)."""
        if isinstance(value, type) or value is None:
            raise TypeError(f"ctx.results.put({value!r}): put an instance of a class of your own, e.g. a "
                            f"dataclass. Fix: ctx.results.put(MyResult(...)).")
        self.extras[type(value)] = value

    def get(self, kind: type) -> Any:
        """The result of type `kind` an earlier pass put."""
        return extra_of(self.extras, kind)


RESULT_FIELDS = tuple(f.name for f in dataclasses.fields(PassResults) if f.name != "extras")


def declarable_names() -> Tuple[str, ...]:
    """Every name `requires` / `produces` accept: result fields, then record fields."""
    return RESULT_FIELDS + tuple(RECORD_PREFIX + f.name for f in dataclasses.fields(NodeRecord))


@dataclass(frozen=True)
class Pass:
    """A pass in the pipeline. `requires` / `produces` name `PassResults` fields,
    "record.<field>" of node records, or classes of results a user pass `put`s; a user
    pass may leave both empty."""
    name: str
    fn: PassFn
    after: Optional[str] = None
    before: Optional[str] = None
    requires: Tuple[Union[str, type], ...] = ()
    produces: Tuple[Union[str, type], ...] = ()

    def __post_init__(self):
        for kind in ("requires", "produces"):
            names = getattr(self, kind)
            if isinstance(names, str):
                raise TypeError(f"pass {self.name!r}: {kind}={names!r} is a string; it takes a tuple of names. "
                                f"Fix: {kind}=({names!r},).")
            object.__setattr__(self, kind, tuple(names))
            unknown = [n for n in names if not isinstance(n, type) and n not in declarable_names()]
            if unknown:
                raise ValueError(f"pass {self.name!r}: {kind} names {unknown[0]!r}, which is neither a result field, "
                                 f"a record field nor a class of your own (ctx.results.put). Fix: use a class or one "
                                 f"of {list(declarable_names())}.")


@dataclass
class PassContext:
    """What a pass may read: the strategy, this rank's mesh, the inputs and the options;
    and `results`, where passes leave typed results for later passes."""
    model: torch.nn.Module
    strategy: Any                      # graphpar.Strategy
    mesh: Any                          # graphpar.distributed.mesh.Mesh for this rank
    example_inputs: Tuple[Any, ...]    # one microbatch of this rank's inputs
    options: CompileOptions
    example_target: Any = None
    loss_fn: Optional[Callable] = None
    with_loss: bool = True
    previous: Optional[PreviousCompile] = None   # set on the lazy loss re-trace only
    results: PassResults = field(default_factory=PassResults)

    def graph_inputs(self) -> List[Any]:
        """The traced graph's placeholder values: the flat example inputs, then the target
        when the loss is traced with a loss_fn."""
        flat = list(pytree.tree_flatten(self.example_inputs)[0])
        if self.with_loss and self.loss_fn is not None and self.example_target is not None:
            flat.append(self.example_target)
        return flat

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def world_size(self) -> int:
        return self.mesh.world_size


def hand_off(ctx: PassContext, gm: torch.fx.GraphModule,
             snapshots: Sequence[Tuple[str, torch.fx.GraphModule]]) -> CompiledRank:
    """Freeze what the pipeline built for this rank into the runtime's one input."""
    r = ctx.results
    return CompiledRank(
        model=ctx.model, strategy=ctx.strategy, mesh=ctx.mesh, example_inputs=ctx.example_inputs,
        example_target=ctx.example_target, loss_fn=ctx.loss_fn, options=ctx.options,
        program=r.program, gm=gm, stages=r.stages, update=r.update, snapshots=tuple(snapshots),
        tp_plan=r.tp_plan, stage_plan=r.stage_plan, param_shards=r.param_shards, param_stages=r.param_stages,
        expert_shards=r.expert_shards, expert_owners=r.expert_owners,
        host_tables=r.host_tables, host_table_stages=r.host_table_stages, uninitialized=r.uninitialized,
        crossings=r.crossings, input_names=r.input_names, output_meta=r.output_meta, extras=r.extras)

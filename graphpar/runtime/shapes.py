"""One program per input shape: a batch of a new shape gets a program of its own.

graphpar compiles for one microbatch shape (docs/architecture.md, "Why graphs are
specialised to the microbatch shape"): torch.export bakes sizes into view and reshape
constants, and pipeline stages size their receive buffers from the records. A batch of
another shape (another batch size, another sequence length) therefore needs a program of
its own. ParallelModule compiles one on first sight, sharing what holds state (the
parameters and buffers, the update program with its master weights and ZeRO shards, the
host tables and the pipeline cut, handed over as a PreviousCompile; the optimizer, the loss
scaler, the gradient sync, the gradient divisor, the RNG streams and the tied-weight
groups are the module's own), and keeps it here, keyed by the microbatch shapes it was
traced for:

    ShapeKey(inputs=((4, 16),), target=((4, 16),))   train_step(x, target=y) with x, y of
                                                     [8, 16] at microbatches=2
    ShapeKey(inputs=((4, 16),), target=None)         a program without its loss (pm(x) of a
                                                     new shape, compile without example_target)

A shape seen before runs its program at once: nothing is traced again. Sizes may vary
wherever the parameters do not fix them (any batch size, any sequence length the model
accepts); dtypes may not, and a program that would cut a parameter otherwise over tp or
read it in other pipeline stages is refused before it is kept. At most `max_shapes`
programs are kept (compile's option): each costs a whole compile and its graphs' memory,
so ever-new shapes are refused past the bound with the shapes seen and the fix.
"""
from __future__ import annotations

import datetime
import zlib
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree

from graphpar.distributed import groups as distributed

from graphpar.ir.compiled import CompiledRank

Shape = Tuple[int, ...]


class ShapeKey(NamedTuple):
    """The microbatch shapes a program was traced for."""
    inputs: Tuple[Optional[Shape], ...]       # each flat input's (None: not a tensor)
    target: Optional[Tuple[Shape, ...]]       # each target leaf's; None: the program has no target

    def describe(self) -> str:
        text = "inputs " + ", ".join(str(list(s)) for s in self.inputs if s is not None)
        return text + (", target " + ", ".join(str(list(s)) for s in self.target) if self.target else "")

    def as_dict(self) -> Dict[str, Any]:
        return {"inputs": [list(s) for s in self.inputs if s is not None],
                "target": [list(s) for s in self.target] if self.target is not None else None}


def _microbatch(value: Any, chunks: int) -> Optional[Shape]:
    if not isinstance(value, torch.Tensor):
        return None
    return (value.shape[0] // chunks, *value.shape[1:]) if value.dim() else ()


def shape_key(flat_inputs: Sequence[Any], target: Any, chunks: int) -> ShapeKey:
    """The key of a batch split into `chunks` microbatches (`target` None: no target)."""
    leaves = None if target is None else tuple(_microbatch(t, chunks) for t in pytree.tree_leaves(target))
    return ShapeKey(tuple(_microbatch(v, chunks) for v in flat_inputs), leaves)


def batch_shapes(flat_inputs: Sequence[Any], target: Any) -> str:
    """The shapes of a call's batch, as its messages name them."""
    shapes = [list(v.shape) for v in flat_inputs if isinstance(v, torch.Tensor)]
    targets = [list(t.shape) for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor)]
    return f"inputs {shapes}" + (f", target {targets}" if targets else "")


def checks_replica_shapes(tp: int, pp: int) -> bool:
    """Whether a step starts with `check_replica_shapes`'s all-gather (its replicas have ranks
    to disagree); gp.plan counts it."""
    return tp * pp > 1


#: bytes of each rank's part of that all-gather (an int64 fingerprint)
FINGERPRINT_BYTES = 8


def check_replica_shapes(call: str, shapes: str, mesh) -> None:
    """The ranks of one dp replica (its tp x pp ranks) run one program together: tp collectives
    and pipeline messages are sized from the batch's shape, so each must be given a batch of
    the same shapes (dp replicas may differ: their programs meet only in parameter-sized
    reductions). Checked before the step with an all-gather of a fingerprint per rank over
    the world, so that every rank raises together instead of gloo aborting in a collective."""
    if not checks_replica_shapes(mesh.tp, mesh.pp):
        return
    mine = torch.tensor([zlib.crc32(shapes.encode())], dtype=torch.int64)  # hash() differs per process
    prints = torch.zeros(mesh.world_size, dtype=torch.int64)
    work = dist.all_gather(list(prints.chunk(mesh.world_size)), mine, async_op=True)
    work.wait(datetime.timedelta(seconds=distributed.DEFAULT_TIMEOUT_S))
    prints = prints.tolist()
    for dp in range(mesh.dp):
        ranks = [mesh.rank_at(dp, pp, tp) for pp in range(mesh.pp) for tp in range(mesh.tp)]
        if len({prints[r] for r in ranks}) > 1:
            kinds: Dict[int, List[int]] = {}
            for r in ranks:
                kinds.setdefault(prints[r], []).append(r)
            raise ValueError(
                f"{call}: the ranks of data-parallel replica {dp} (ranks {ranks}: tp={mesh.tp} x pp={mesh.pp}, "
                f"which run one program together) were given batches of different shapes: ranks "
                f"{' / '.join(str(group) for group in kinds.values())} differ; this rank ({mesh.rank}) got "
                f"{shapes}. Their tp collectives and pipeline messages are sized from the shapes, so the step "
                f"would fail inside a collective. Fix: give every rank of a replica the same batch shapes (the "
                f"same batch, or one padded alike); data-parallel replicas may differ.")


def _microbatch_size(key: ShapeKey) -> Optional[int]:
    return next((s[0] for s in key.inputs if s), None)


def _fits(key: ShapeKey, flat_inputs: Sequence[Any], batch: int) -> bool:
    """Whether a program of `key` evaluates the batch in whole microbatches: every size but
    the batch's the same, the batch a multiple of the microbatch."""
    micro = _microbatch_size(key)
    if micro is None or batch % micro:
        return False
    return key.inputs == shape_key(flat_inputs, None, batch // micro).inputs


@dataclass
class Specialisation:
    """One shape's program and the executor running it over the module's shared state."""
    compiled: CompiledRank
    executor: Any   # SingleStageExecutor or PipelineExecutor


class ProgramCache:
    """The programs of one ParallelModule by shape, at most `bound` of them, oldest first."""

    def __init__(self, bound: int):
        self.bound = bound
        self._programs: Dict[ShapeKey, Specialisation] = {}

    def get(self, key: ShapeKey) -> Optional[Specialisation]:
        return self._programs.get(key)

    def keys(self) -> List[ShapeKey]:
        return list(self._programs)

    def has_inputs(self, key: ShapeKey) -> bool:
        """Whether some program was traced for these input shapes (with any target)."""
        return any(k.inputs == key.inputs for k in self._programs)

    def example_target(self) -> Any:
        """A target some program was traced with (one microbatch), or None."""
        return next((p.compiled.example_target for k, p in self._programs.items() if k.target is not None), None)

    def for_evaluation(self, flat_inputs: Sequence[Any], batch: int) -> Optional[Specialisation]:
        """A program evaluating the batch in whole microbatches: the one of the largest
        microbatch (the fewest chunks), or None."""
        fitting = [k for k in self._programs if _fits(k, flat_inputs, batch)]
        return self._programs[max(fitting, key=_microbatch_size)] if fitting else None

    def add(self, key: ShapeKey, program: Specialisation) -> None:
        """Keep `program`; one with its loss replaces the one without for the same inputs."""
        self._programs.pop(ShapeKey(key.inputs, None), None)
        self._programs[key] = program

    def check_room(self, key: ShapeKey, call: str) -> None:
        """Refuse a new shape past the bound, before anything is traced."""
        replaces = ShapeKey(key.inputs, None) in self._programs
        if key in self._programs or replaces or len(self._programs) < self.bound:
            return
        seen = "; ".join(f"({k.describe()})" for k in self._programs)
        raise ValueError(
            f"{call}: a batch of a new shape (microbatch {key.describe()}) needs a program of its own, but this "
            f"ParallelModule already keeps max_shapes={self.bound} program(s), one per microbatch shape seen: "
            f"{seen}. Every new shape is traced and compiled again and its program kept, so shapes that keep "
            f"changing are refused rather than compiled without end. Fix: pad batches to a few fixed shapes "
            f"(e.g. round sequence lengths up to a multiple of 64 and pad the last batch to the batch size), or "
            f"graphpar.compile(..., max_shapes={self.bound + 1}) or more.")


def check_dtypes(values: Sequence[Any], examples: Sequence[Any], names: Sequence[str]) -> None:
    """A batch of a new shape gets a program of its own; one of a new dtype does not (the
    parameters' dtypes, and what the model computes in, follow compile's example)."""
    for name, value, example in zip(names, values, examples):
        if isinstance(value, torch.Tensor) and isinstance(example, torch.Tensor) and value.dtype != example.dtype:
            raise ValueError(
                f"{name} has shape {list(value.shape)} and dtype {value.dtype}, but the program was compiled for "
                f"{example.dtype}: the dtype differs (a new shape gets a program of its own, a new dtype does "
                f"not). Fix: convert the batch, e.g. x.to({example.dtype}), or compile with an example of dtype "
                f"{value.dtype}.")


def cannot_compile(call: str, key: ShapeKey, seen: Sequence[ShapeKey], error: Exception) -> ValueError:
    """A new shape the model does not trace at (or the passes refuse): what was asked, why
    it failed (the error without its own fix, which is about compile's shape), what exists."""
    reason = " ".join(str(error).split("Fix:")[0].split()).rstrip(".") or type(error).__name__
    return ValueError(
        f"{call}: a batch of a new shape (microbatch {key.describe()}) needs a program of its own, and compiling "
        f"the model for it failed ({type(error).__name__}: {reason}). Only sizes the parameters do not fix may "
        f"vary (the batch size, a sequence length); the programs compiled so far are for "
        f"{'; '.join(f'({k.describe()})' for k in seen)}. Fix: pass batches the model accepts, e.g. of a shape "
        f"listed, padded to it.")


# how a program compiled again must keep each parameter: cut over tp alike, read by the same stages
_LAYOUT_FIELDS = {"param_shards": "tensor parallelism cuts it as", "param_stages": "it is read by pipeline stages"}


def check_same_layout(compiled: CompiledRank, again: CompiledRank, cause: str, fix: str) -> None:
    """Every program of a ParallelModule runs on the same parameters, so one compiled again
    must lay them out as the one before did (checked before it is kept). `cause` says how it
    was compiled again, `fix` what avoids it."""
    for layout, meaning in _LAYOUT_FIELDS.items():
        before, after = getattr(compiled, layout), getattr(again, layout)
        changed = [name for name in dict.fromkeys([*before, *after]) if before.get(name) != after.get(name)]
        if changed:
            name = changed[0]
            raise ValueError(
                f"{cause}, the parameter {name!r} would change layout ({meaning} {after.get(name, 'replicated')} "
                f"instead of {before.get(name, 'replicated')}; {len(changed)} parameter(s) differ). Fix: {fix}")

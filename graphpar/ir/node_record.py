"""graphpar's intermediate representation: a torch.fx graph plus one record per node.

Both tracing front ends (symbolic_trace and torch.export) produce the same shape of graph:

    placeholder   one per flattened user input (and the loss target)
    get_attr      every parameter and buffer, by its qualified name in the user's model
    call_function torch functions, aten ops, operator.*, graphpar runtime ops
    call_method   tensor methods (symbolic_trace only)
    call_module   only modules the user marked as leaves, or ones with no functional form
    output        a flat tuple: (loss, *flattened model outputs)

Every node except the output carries ``node.meta["graphpar"]``, a frozen `NodeRecord`.
Passes never mutate a record and never write ``node.meta`` themselves: they replace the
record with ``stamp(node, pass_name, ...)`` (or ``set_record(node, rec.replace(pass_name,
...))`` when the new record starts from another node's), which also writes the pass name
into ``set_by`` so a dump tells which pass wrote what.

Glossary:
    TensorMeta  shape and dtype of a tensor value (from fake tensors, never real compute)
    ShardSpec   how a value is laid out over the tensor-parallel axis: Replicate,
                Shard(dim) or Partial(op) (a pending reduction)
    placement   "device" or "host"
    stage       pipeline stage index, or None before split_stages
    update_placement  where a trainable parameter's optimizer update runs: "device" or "host"
    bucket, phase     an update-program node's gradient bucket and when it runs ("step"
                      during backward, "write" after it)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import torch
import torch.fx

META_KEY = "graphpar"

_DTYPE_SHORT = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64",
}


@dataclass(frozen=True)
class TensorMeta:
    shape: Tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool = False

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "TensorMeta":
        return cls(tuple(int(s) for s in t.shape), t.dtype, bool(t.requires_grad))

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()

    def describe(self) -> str:
        dt = _DTYPE_SHORT.get(self.dtype, str(self.dtype).replace("torch.", ""))
        return f"{dt}{list(self.shape)}"


# A node's value: one tensor, a tuple of values (split, max with indices, ...), or None for
# non-tensor results (ints from size(), python scalars).
Value = Union[TensorMeta, Tuple["Value", ...], None]


@dataclass(frozen=True)
class Replicate:
    def describe(self) -> str:
        return "R"


@dataclass(frozen=True)
class Shard:
    """Split along `dim` over the tp ranks. With `segments` the dim is a concatenation of
    blocks (a fused q|k|v projection) and each block is split separately: rank r holds the
    r-th piece of every block, so a later split into the blocks stays local. `whole` lists
    blocks every rank holds in full: a fused weight whose q heads are split and whose one k/v
    head is not (Falcon-7B's query_key_value, S(0|32,R8,R8)); only parameters carry it."""
    dim: int
    segments: Optional[Tuple[int, ...]] = None
    whole: Tuple[int, ...] = ()

    def describe(self) -> str:
        if self.segments:
            blocks = [f"R{s}" if i in self.whole else str(s) for i, s in enumerate(self.segments)]
            return f"S({self.dim}|{','.join(blocks)})"
        return f"S({self.dim})"


@dataclass(frozen=True)
class SequenceShard(Shard):
    """Sequence parallelism: a value between TP regions (norms, dropout, residual adds)
    split along its sequence dim instead of replicated. `segments` is set when batch and
    sequence share one dim ([b*s, h], as GPT-2's Conv1D flattens them): one entry per
    sequence, each split separately. A Shard, so shape and layout code treats it as one."""

    def describe(self) -> str:
        if self.segments:
            return f"Sq({self.dim}|{len(self.segments)}x{self.segments[0]})"
        return f"Sq({self.dim})"


@dataclass(frozen=True)
class Partial:
    op: str = "sum"

    def describe(self) -> str:
        return f"P({self.op})"


ShardSpec = Union[Replicate, Shard, Partial]
PLACEMENTS = ("device", "host")
PHASE_LAUNCH = "launch"  # during backward, on its thread, once the bucket is complete (ZeRO's collectives)
PHASE_STEP = "step"    # during backward, in the update runner's worker thread
PHASE_WRITE = "write"  # after backward, on the caller's thread
PHASES = (PHASE_LAUNCH, PHASE_STEP, PHASE_WRITE)  # in the order they run


@dataclass(frozen=True)
class NodeRecord:
    value: Value
    module_path: str = ""
    module_type: str = ""
    spec: Optional[ShardSpec] = None
    placement: str = "device"
    stage: Optional[int] = None
    set_by: str = "trace"
    spec_by: Optional[str] = None   # the pass that decided `spec` (verify blames it for shapes)
    update_placement: Optional[str] = None  # trainable parameters' get_attr: where the update runs
    bucket: Optional[int] = None    # update program: the gradient bucket; None = after every bucket
    phase: Optional[str] = None     # update program: one of PHASES
    recompute: Optional[str] = None  # in a recompute region's body: "recomputed" or "saved (<ops>)"

    def replace(self, pass_name: str, **changes) -> "NodeRecord":
        if "spec" in changes and changes["spec"] != self.spec:
            changes["spec_by"] = pass_name
        return dataclasses.replace(self, set_by=pass_name, **changes)

    def describe(self) -> str:
        parts = [describe_value(self.value)]
        if self.spec is not None:
            parts.append(self.spec.describe())
        if self.placement != "device":
            parts.append(f"@{self.placement}")
        if self.update_placement is not None:
            parts.append(f"update@{self.update_placement}")
        if self.stage is not None:
            parts.append(f"stage {self.stage}")
        if self.bucket is not None:
            parts.append(f"bucket {self.bucket}")
        if self.phase is not None:
            parts.append(self.phase)
        if self.recompute is not None:
            parts.append(self.recompute)
        if self.module_path:
            parts.append(self.module_path)
        parts.append(f"[{self.set_by}]")
        return " ".join(parts)


def describe_value(value: Value) -> str:
    if value is None:
        return "-"
    if isinstance(value, TensorMeta):
        return value.describe()
    return "(" + ", ".join(describe_value(v) for v in value) + ")"


def describe_kind(value: Value) -> str:
    """describe_value, but saying what a value with no tensor metadata is (an int, a size)."""
    return "a non-tensor value such as an int read off a shape" if value is None else describe_value(value)


def value_from_example(example) -> Value:
    """Turn a (fake) tensor, or a nested tuple/list of them, into a Value."""
    if isinstance(example, torch.Tensor):
        return TensorMeta.from_tensor(example)
    if isinstance(example, (tuple, list)):
        return tuple(value_from_example(e) for e in example)
    return None


def record(node: torch.fx.Node) -> NodeRecord:
    rec = node.meta.get(META_KEY)
    if rec is None:
        raise KeyError(
            f"node {node.name!r} ({node.op} {node.target}) has no graphpar record; a pass "
            f"created it without one. Fix: copy the record of the node it replaces "
            f"(graphpar.ir.copy_record) or build one with graphpar.ir.NodeRecord.")
    return rec


def has_record(node: torch.fx.Node) -> bool:
    return isinstance(node.meta.get(META_KEY), NodeRecord)


def set_record(node: torch.fx.Node, rec: NodeRecord) -> None:
    """The one write of a node's record; every other helper and pass goes through it."""
    if not isinstance(rec, NodeRecord):
        raise TypeError(f"set_record({node.name!r}, {rec!r}): a record must be a graphpar.ir.NodeRecord. "
                        f"Fix: build one with NodeRecord(...) or record(other).replace(pass_name, ...).")
    node.meta[META_KEY] = rec


def stamp(node: torch.fx.Node, pass_name: str, **changes) -> None:
    """Replace the node's record with one carrying `changes`, stamped with the pass name."""
    set_record(node, record(node).replace(pass_name, **changes))


def copy_record(src: torch.fx.Node, dst: torch.fx.Node, pass_name: str, **changes) -> None:
    """Give a node created by a pass the record of the node it stands for."""
    set_record(dst, record(src).replace(pass_name, **changes))


def fetch_attr(root: torch.nn.Module, target: str):
    """What a get_attr node with this dotted target reads."""
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def parameter_readers(gm: torch.fx.GraphModule) -> Dict[str, List[int]]:
    """Every parameter and buffer -> the pipeline stages of the nodes computing on it, over all
    of its get_attr nodes (a tied weight may have one per stage), and the state of a module a
    staged call_module node runs (a leaf module, an ep rank's experts) under its full name,
    for a list of expert modules every ep rank's experts (the same call on each: its stage holds
    them all); those read by no staged node are left out."""
    readers: Dict[str, set] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            stages = {record(u).stage for u in node.users if u.op in ("call_function", "call_method", "call_module")}
            readers.setdefault(str(node.target), set()).update(stages - {None})
        elif node.op == "call_module" and record(node).stage is not None:
            module = gm.get_submodule(str(node.target))
            for name in [*module.state_dict(keep_vars=True), *getattr(module, "listed_params", ())]:
                readers.setdefault(f"{node.target}.{name}", set()).add(record(node).stage)
    return {name: sorted(stages) for name, stages in readers.items() if stages}


# ops whose result may share the input's storage: a tensor (a zero=3 bucket's weights) is last
# read by the last reader of it or of such a view of it (a view that outlives that stays
# correct, just held longer)
_VIEWS = frozenset({
    "view", "t", "T", "mT", "transpose", "permute", "reshape", "expand", "expand_as", "view_as", "reshape_as",
    "unsqueeze", "squeeze", "flatten", "unflatten", "narrow", "select", "slice", "alias", "detach", "getitem",
    "chunk", "split", "unbind", "as_strided", "_unsafe_view", "contiguous", "to", "type_as", "float", "half",
    "bfloat16", "movedim", "swapaxes", "diagonal", "view_as_real", "view_as_complex", "__getitem__"})


def _op_name(node: torch.fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return str(target)
    packet = getattr(target, "overloadpacket", None)
    return getattr(packet or target, "__name__", str(target))


def last_reader(start: List[torch.fx.Node], order: Dict[torch.fx.Node, int], local) -> torch.fx.Node:
    """The last node (`local`: of this rank) reading any of `start` or a view of them; `order`:
    each node's position in the graph. shard_parameters frees a zero=3 bucket after it, and
    the planner finds the bucket kept for backward by it."""
    last, seen, frontier = None, set(start), list(start)
    while frontier:
        node = frontier.pop()
        for user in [u for u in node.users if local(u)]:
            if last is None:
                last = user
            if order[user] > order[last]:
                last = user
            if user not in seen and user.op in ("call_function", "call_method") and _op_name(user) in _VIEWS:
                seen.add(user)
                frontier.append(user)
    return last


def first_keys(model: torch.nn.Module) -> Dict[int, str]:
    """id of each state_dict tensor -> its first key: graphpar's name for it (tied weights,
    such as an embedding shared with the LM head, are one tensor under one name)."""
    first: Dict[int, str] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        first.setdefault(id(tensor), key)
    return first


def canonical_keys(model: torch.nn.Module) -> Dict[str, str]:
    """Every state_dict key -> the name graphpar gives its tensor (see first_keys)."""
    first = first_keys(model)
    return {key: first[id(t)] for key, t in model.state_dict(keep_vars=True).items()}


def tensor_meta(node: torch.fx.Node) -> TensorMeta:
    value = record(node).value
    if not isinstance(value, TensorMeta):
        raise TypeError(f"node {node.name!r} is not a single tensor value: {describe_kind(value)}. Fix: "
                        f"read record(node).value for values of any kind.")
    return value

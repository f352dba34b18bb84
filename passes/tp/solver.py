"""Find the Megatron pattern in a graph: column-parallel regions closed by row-parallel layers.

For each linear-like op (linear; addmm for transformers' Conv1D; `x @ w.T` for Falcon's
FalconLinear) whose input is replicated, in graph order, the solver tries a region rooted there: it shards the output on
its last dim and propagates that spec through the users with the rules in rules.py.

    - an op that needs another input sharded (Demand) pulls that input's producing linear
      into the region as a column too (k and v of an attention, the up projection of a
      gated MLP), and the region is propagated again;
    - a split of the sharded dim into blocks (Segments) re-shards the producing column by
      blocks (a fused q|k|v projection);
    - a linear over a row block of a fused weight (passes/tp/fused.py) as a column splits
      that block and keeps the weight's other blocks whole (Falcon-7B's shared k/v head);
      those blocks' linears are then no regions of their own;
    - a replicated input demanded sharded that no linear can produce (BLOOM's alibi bias,
      computed from the attention mask) is read as this rank's slice: the plan lists the
      edge in local_slices and insert_collectives puts a scatter_to on it;
    - a linear-like op reached with its input sharded on the contraction dim is row-parallel:
      its output is Partial and becomes Replicate after one all-reduce, closing the region;
    - cross entropy over sharded logits becomes the vocab-parallel cross entropy;
    - sharded values may reach the graph output (they are gathered there, for pm(x) only).

A region that meets an op with no rule is abandoned and reported (strict mode: an error).
Embeddings whose table is the vocabulary (tied to a column-parallel LM head, or with as many
rows as a model output's last dim, the logits' classes) become vocab-parallel.
"""
from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.fx

from graphpar.ir import Replicate, Shard, TensorMeta, record
from graphpar.ir.compiled import TPPlan
from graphpar.passes.tp.opinfo import op_of
from graphpar.passes.tp.rules import (R, Demand, DivisibilityError, Segments, Unsupported, check_divisible,
                               first, propagate, shape, where)

MAX_REGION_ATTEMPTS = 64
# Ops walked back through when looking for the linear that produces a demanded input.
_PASS_THROUGH = {"pointwise", "view", "expand", "transpose", "permute", "getitem", "slice", "select", "cat",
                 "stack", "repeat_interleave"}


@dataclass
class LinearOp:
    node: torch.fx.Node
    x: torch.fx.Node
    weight: torch.fx.Node
    bias: Optional[torch.fx.Node]
    out_dim_of_weight: int          # 0 for linear's [out, in], 1 for addmm's [in, out]
    weight_t: Optional[torch.fx.Node] = None   # `x @ w.T`: the transposed weight the matmul reads
    # a row block of a fused weight (passes/tp/fused.py): (the block node, block sizes, index)
    block: Optional[Tuple[torch.fx.Node, Tuple[int, ...], int]] = None

    def out_features(self) -> int:
        return self.block[1][self.block[2]] if self.block else shape(self.weight)[self.out_dim_of_weight]


def _is_param(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "get_attr" and isinstance(record(node).value, TensorMeta)


def linear_op(node: torch.fx.Node) -> Optional[LinearOp]:
    info = op_of(node)
    if info.kind == "linear":
        weight = first(info.args, "weight")
        if _is_param(weight) and len(shape(weight)) == 2:
            return LinearOp(node, first(info.args, "input"), weight, first(info.args, "bias"), 0)
        block = _row_block(weight)
        if block is not None:
            return LinearOp(node, first(info.args, "input"), block[0], first(info.args, "bias"), 0, block=block[1])
    if info.kind == "addmm":
        weight = first(info.args, "mat2")
        if _is_param(weight) and info.args.get("beta", 1) == 1 and info.args.get("alpha", 1) == 1:
            return LinearOp(node, first(info.args, "mat1"), weight, first(info.args, "input", "self"), 1)
    if info.kind == "matmul":
        weight_t = first(info.args, "other", "mat2")
        weight = _transposed_param(weight_t)
        if weight is not None:
            return LinearOp(node, first(info.args, "input", "self"), weight, None, 0, weight_t)
    return None


def _row_block(node):
    """(param, (node, sizes, i)) if `node` is torch.split(param, sizes, 0)[i] of a 2-D parameter."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is operator.getitem):
        return None
    split, index = node.args
    if not (isinstance(split, torch.fx.Node) and split.target is torch.split and len(split.args) == 3
            and split.args[2] == 0 and _is_param(split.args[0]) and len(shape(split.args[0])) == 2):
        return None
    return split.args[0], (node, tuple(split.args[1]), index)


def _transposed_param(node) -> Optional[torch.fx.Node]:
    """The 2-D parameter `w` if `node` is `w.T`, `w.t()` or a transpose of it."""
    if not isinstance(node, torch.fx.Node) or not node.args:
        return None
    source = node.args[0]
    transposed = ((node.op == "call_function" and node.target is getattr and node.args[1] in ("T", "mT"))
                  or (node.op == "call_method" and node.target == "t")
                  or node.target in (torch.t, torch.ops.aten.t.default)
                  or op_of(node).kind == "transpose")
    return source if transposed and _is_param(source) and len(shape(source)) == 2 else None


@dataclass
class _Restart:
    columns: Dict[torch.fx.Node, Optional[Tuple[int, ...]]]


@dataclass
class _Region:
    specs: Dict[torch.fx.Node, object]
    roles: Dict[torch.fx.Node, str]
    params: Dict[str, Shard]
    slices: Dict[Tuple[torch.fx.Node, torch.fx.Node], Shard]


class Solver:
    def __init__(self, gm: torch.fx.GraphModule, tp: int, replicate: Tuple[str, ...] = ()):
        self.gm = gm
        self.tp = tp
        self.replicate = replicate
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.specs: Dict[torch.fx.Node, object] = {}
        self.roles: Dict[torch.fx.Node, str] = {}
        self.params: Dict[str, Shard] = {}
        self.fallbacks: List[Tuple[str, str, str]] = []
        self.slices: Dict[Tuple[torch.fx.Node, torch.fx.Node], Shard] = {}

    # ---- public ---------------------------------------------------------------------------
    def solve(self) -> TPPlan:
        for node in self.gm.graph.nodes:
            lin = linear_op(node)
            if lin is not None and node not in self.roles and self._spec(lin.x) == R and not self._kept(node) \
                    and not self._whole_block(lin):
                self._try_region(lin)
        self._decide_embeddings()
        return self._plan()

    # ---- regions --------------------------------------------------------------------------
    def _whole_block(self, lin: LinearOp) -> bool:
        """A block of a fused weight that a region made whole (Falcon-7B's k/v head beside
        its column-parallel q heads): replicated by that layout, not a region of its own."""
        spec = self.params.get(lin.weight.target)
        return lin.block is not None and spec is not None and lin.block[2] in spec.whole

    def _kept(self, node) -> bool:
        path = record(node).module_path
        return any(path == p or path.startswith(p + ".") for p in self.replicate)

    def _spec(self, node, local: Optional[dict] = None):
        if not isinstance(node, torch.fx.Node):
            return None
        if local is not None and node in local:
            return local[node]
        return self.specs.get(node, R)

    def _try_region(self, root: LinearOp) -> None:
        columns: Dict[torch.fx.Node, Optional[Tuple[int, ...]]] = {root.node: None}
        for _ in range(MAX_REGION_ATTEMPTS):
            outcome = self._propagate_region(columns)
            if isinstance(outcome, _Restart):
                columns = outcome.columns
                continue
            if isinstance(outcome, Unsupported):
                self.fallbacks.append((root.node.name, record(root.node).module_path, outcome.reason))
                return
            self._commit(outcome)
            return
        self.fallbacks.append((root.node.name, record(root.node).module_path, "region did not converge"))

    def _column_specs(self, columns, local, roles, params) -> None:
        for node, segments in columns.items():
            lin = linear_op(node)
            out_rank = len(shape(node))
            local[node] = Shard(out_rank - 1, segments)
            roles[node] = "column"
            if lin.block is not None:   # this block split, the weight's other blocks whole
                _, sizes, index = lin.block
                params[lin.weight.target] = Shard(0, sizes, tuple(i for i in range(len(sizes)) if i != index))
                continue
            params[lin.weight.target] = Shard(lin.out_dim_of_weight, segments)
            if _is_param(lin.bias):
                params[lin.bias.target] = Shard(0, segments)

    def _propagate_region(self, columns):
        local: Dict[torch.fx.Node, object] = {}
        roles: Dict[torch.fx.Node, str] = {}
        params: Dict[str, Shard] = {}
        slices: Dict[Tuple[torch.fx.Node, torch.fx.Node], Shard] = {}
        self._column_specs(columns, local, roles, params)
        heap: List[Tuple[int, int]] = []
        by_index = {}
        for node in columns:
            self._push_users(node, heap, by_index)
        while heap:
            _, index = heapq.heappop(heap)
            node = by_index[index]
            if node in local or node.op == "output":
                continue
            outcome = self._step(node, local, roles, params, columns, slices)
            if isinstance(outcome, (_Restart, Unsupported)):
                return outcome
            if outcome is not None and outcome != R:
                local[node] = outcome
                self._push_users(node, heap, by_index)
        for node in columns:  # a column pulled in by a Demand may read another column's output
            if local.get(linear_op(node).x, R) != R:
                return Unsupported(f"linear at {where(node)} would be a column layer but reads "
                                   f"{linear_op(node).x.name}, sharded by another column of the region")
        return _Region(local, roles, params, slices)

    def _push_users(self, node, heap, by_index) -> None:
        for user in node.users:
            index = self.order[user]
            by_index[index] = user
            heapq.heappush(heap, (index, index))

    def _step(self, node, local, roles, params, columns, slices):
        """The spec of one node inside a region, or a restart / failure."""
        spec_of = lambda n: slices.get((node, n)) or self._spec(n, local)  # noqa: E731
        lin = linear_op(node)
        if lin is not None:
            return self._row(lin, spec_of, roles, params)
        info = op_of(node)
        if info.kind == "cross_entropy":
            return self._parallel_cross_entropy(node, info, spec_of, roles)
        result = propagate(node, spec_of, self.tp)
        while isinstance(result, Demand):
            producer = self._producing_linear(result.node)
            if producer is not None and producer not in columns and producer not in self.roles:
                return _Restart({**columns, producer: None})
            if spec_of(result.node) != R:
                return Unsupported(f"{_op_name(node)} at {where(node)} needs {result.node.name} sharded as "
                                   f"{result.spec.describe()}, and it is sharded as {_describe(spec_of(result.node))}")
            slices[(node, result.node)] = result.spec   # replicated: each rank reads its slice
            result = propagate(node, spec_of, self.tp)
        if isinstance(result, Segments):
            producer = self._producing_column(result.node, columns)
            if producer is None:
                return Unsupported(f"split of a sharded value at {where(node)} not produced by a column layer")
            return _Restart({**columns, producer: result.sizes})
        if isinstance(result, Unsupported):
            return Unsupported(f"{result.reason} at {where(node)}")
        return result

    def _row(self, lin: LinearOp, spec_of, roles, params):
        spec = spec_of(lin.x)
        rank = len(shape(lin.x))
        if not isinstance(spec, Shard) or spec.dim != rank - 1 or spec.segments:
            return Unsupported(f"linear at {where(lin.node)} reads a value sharded as {_describe(spec)}")
        if lin.block is not None:
            return Unsupported(f"linear at {where(lin.node)} would be a row layer over a block of a fused weight")
        check_divisible(shape(lin.weight)[1 - lin.out_dim_of_weight], self.tp, "in_features", lin.node)
        roles[lin.node] = "row"
        params[lin.weight.target] = Shard(1 - lin.out_dim_of_weight)
        return R

    def _parallel_cross_entropy(self, node, info, spec_of, roles):
        logits = first(info.args, "input", "self")
        spec = spec_of(logits)
        rank = len(shape(logits))
        class_dim = 1 if rank > 1 else 0
        if not isinstance(spec, Shard) or spec.dim != class_dim or spec.segments:
            return Unsupported(f"cross entropy at {where(node)} with logits sharded as {_describe(spec)}")
        if isinstance(spec_of(first(info.args, "target")), Shard) or first(info.args, "weight") is not None:
            return Unsupported(f"cross entropy at {where(node)} with class weights or a sharded target")
        roles[node] = "parallel_cross_entropy"
        return R

    def _producing_linear(self, node) -> Optional[torch.fx.Node]:
        """The nearest linear upstream of `node` (through shape and pointwise ops) whose input
        is replicated: the one to make column-parallel so that `node` is sharded."""
        frontier, seen = [node], set()
        while frontier:
            current = frontier.pop(0)
            if current in seen or not isinstance(current, torch.fx.Node):
                continue
            seen.add(current)
            lin = linear_op(current)
            if lin is not None:
                return current if self._spec(lin.x) == R and not self._kept(current) else None
            if op_of(current).kind not in _PASS_THROUGH:
                continue
            frontier.extend(n for n in current.all_input_nodes if n.op not in ("get_attr", "placeholder"))
        return None

    def _producing_column(self, node, columns) -> Optional[torch.fx.Node]:
        frontier = [node]
        while frontier:
            current = frontier.pop(0)
            if current in columns:
                return current
            frontier.extend(n for n in current.all_input_nodes if n.op not in ("get_attr", "placeholder"))
        return None

    def _commit(self, region: _Region) -> None:
        for target, spec in region.params.items():
            if self.params.get(target, spec) != spec:
                node = next(n for n in region.roles)
                self.fallbacks.append((node.name, record(node).module_path,
                                       f"parameter {target} is shared with another region, sharded differently"))
                return
        for node, role in region.roles.items():
            if role == "column":
                lin = linear_op(node)
                spec = region.specs[node]
                for size in spec.segments or (lin.out_features(),):
                    check_divisible(size, self.tp, "out_features", node)
        self.specs.update(region.specs)
        self.slices.update(region.slices)
        self.roles.update(region.roles)
        self.params.update(region.params)

    # ---- embeddings -------------------------------------------------------------------------
    def _vocab_sizes(self) -> set:
        """The last dim of every tensor the model returns: a head's classes (logits' vocabulary).
        Read from the model's outputs, not from the loss: a compile without example_target
        traces no loss, and must shard the tables as the program with the loss does."""
        output = next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")
        return {shape(value)[-1] for value in output.all_input_nodes if shape(value)}

    def _decide_embeddings(self) -> None:
        vocab = self._vocab_sizes()
        for node in self.gm.graph.nodes:
            info = op_of(node)
            if info.kind != "embedding":
                continue
            weight = first(info.args, "weight")
            if not _is_param(weight) or self._kept(node):
                continue
            rows = shape(weight)[0]
            tied = self.params.get(weight.target) == Shard(0)
            if weight.target in self.params and not tied:
                self.fallbacks.append((node.name, record(node).module_path,
                                       f"embedding table {weight.target} is sharded by another layer"))
                continue
            if tied or rows in vocab:
                check_divisible(rows, self.tp, "the vocabulary size (embedding rows)", node)
                self.roles[node] = "vocab_embedding"
                self.params[weight.target] = Shard(0)

    def _plan(self) -> TPPlan:
        specs = {n.name: s for n, s in self.specs.items()}
        for node in self.gm.graph.nodes:
            if node.op == "get_attr" and node.target in self.params:
                specs[node.name] = self.params[node.target]
            lin = linear_op(node)
            if lin is not None and lin.block is not None and lin.weight.target in self.params:
                block, _, index = lin.block   # the blocks of a fused weight: split or whole
                split = block.args[0]
                spec = self.params[lin.weight.target]
                specs[split.name] = tuple(R if i in spec.whole else Shard(0) for i in range(len(spec.segments)))
                specs[block.name] = specs[split.name][index]
            if lin is not None and lin.weight_t is not None and lin.weight.target in self.params:
                spec = self.params[lin.weight.target]   # the transposed view splits the other dim
                specs[lin.weight_t.name] = Shard(1 - spec.dim, spec.segments)
        return TPPlan(self.tp, specs, {n.name: r for n, r in self.roles.items()}, dict(self.params),
                      self.fallbacks, replicated_linears=self._replicated_linears(),
                      local_slices={(c.name, s.name): spec for (c, s), spec in self.slices.items()})

    def _replicated_linears(self) -> List[Tuple[str, str]]:
        """(module, reason) of each linear-like layer left whole, in graph order; the reason is
        the last one the solver recorded for the region rooted there."""
        reasons = {name: reason for name, _, reason in self.fallbacks}
        found: Dict[str, str] = {}
        for node in self.gm.graph.nodes:
            lin = linear_op(node)
            if lin is None or lin.weight.target in self.params:
                continue
            reason = "kept whole by tp_replicate" if self._kept(node) else reasons.get(node.name, "in no region")
            found.setdefault(record(node).module_path, reason)
        return list(found.items())


def _describe(spec) -> str:
    return spec.describe() if hasattr(spec, "describe") else str(spec)


def _op_name(node) -> str:
    return getattr(node.target, "__name__", None) or str(node.target)


def solve(gm: torch.fx.GraphModule, tp: int, replicate: Tuple[str, ...] = ()) -> TPPlan:
    return Solver(gm, tp, replicate).solve()


__all__ = ["TPPlan", "Solver", "solve", "linear_op", "DivisibilityError", "Replicate", "R"]

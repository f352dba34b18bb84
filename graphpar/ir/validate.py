"""The validator run between passes: fx's graph lint plus graphpar's own invariants.

Invariants (see graphpar/ir/node_record.py):
  - every node but the output carries a NodeRecord;
  - records hold well-formed fields: a ShardSpec or None, a known placement, an int stage
    or None, and a Shard dim inside the value's rank;
  - every get_attr target resolves on the GraphModule;
  - the output is one flat tuple.
A violation raises GraphValidationError naming the pass that ran last and the node.
"""
from __future__ import annotations

import torch
import torch.fx

from graphpar.ir import META_KEY, PLACEMENTS, NodeRecord, Partial, Replicate, Shard, TensorMeta


class GraphValidationError(RuntimeError):
    pass


def _fail(pass_name: str, node: torch.fx.Node, problem: str, fix: str) -> GraphValidationError:
    return GraphValidationError(
        f"after pass {pass_name!r}: node {node.name!r} ({node.op} {_short(node.target)}) {problem}. "
        f"Fix: {fix}")


def _short(target) -> str:
    text = getattr(target, "__name__", None) or str(target)
    return text if len(text) < 60 else text[:57] + "..."


def _check_record(pass_name: str, node: torch.fx.Node) -> None:
    rec = node.meta.get(META_KEY)
    if not isinstance(rec, NodeRecord):
        raise _fail(pass_name, node, "has no graphpar record (node.meta['graphpar'])",
                    "a pass that creates or replaces nodes must carry the record along "
                    "(graphpar.ir.copy_record(old, new, pass_name)).")
    if rec.spec is not None and not isinstance(rec.spec, (Replicate, Shard, Partial)):
        raise _fail(pass_name, node, f"has spec {rec.spec!r}, not a ShardSpec",
                    "use graphpar.ir.Replicate(), Shard(dim) or Partial(op).")
    if isinstance(rec.spec, Shard) and isinstance(rec.value, TensorMeta):
        rank = len(rec.value.shape)
        if not -rank <= rec.spec.dim < max(rank, 1):
            raise _fail(pass_name, node, f"is sharded on dim {rec.spec.dim} of a {rank}-d value",
                        "shard a dimension the value has.")
    if rec.placement not in PLACEMENTS:
        raise _fail(pass_name, node, f"has placement {rec.placement!r}",
                    f"placement must be one of {PLACEMENTS}.")
    if rec.stage is not None and (not isinstance(rec.stage, int) or rec.stage < 0):
        raise _fail(pass_name, node, f"has stage {rec.stage!r}", "stage must be an int >= 0 or None.")


def validate(gm: torch.fx.GraphModule, pass_name: str) -> None:
    try:
        gm.graph.lint()
    except Exception as exc:  # lint raises plain RuntimeErrors; say which pass produced the graph
        raise GraphValidationError(
            f"after pass {pass_name!r}: the graph fails torch.fx lint: {exc}\nFix: edit the graph so that every "
            f"node comes after its inputs and every get_attr target is registered on the GraphModule.") from exc
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    if len(outputs) != 1 or not isinstance(outputs[0].args[0], (tuple, list)):
        raise GraphValidationError(
            f"after pass {pass_name!r}: the graph must end in one output returning a flat tuple, "
            f"got {[o.args for o in outputs]}. Fix: end the graph with graph.output((value, ...)), "
            f"one flat tuple, as the pass received it.")
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        _check_record(pass_name, node)

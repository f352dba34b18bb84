"""The validator run between passes: fx's graph lint plus graphpar's own invariants.

Invariants (see graphpar/ir/node_record.py):
  - every node but the output carries a NodeRecord;
  - records hold well-formed fields: a ShardSpec or None, a known placement, an int stage
    or None, and a Shard dim inside the value's rank;
  - update_placement only on get_attr nodes of trainable parameters (build_update gathers
    exactly those), and bucket and phase only in the update program;
  - every get_attr target resolves on the GraphModule;
  - the output is one flat tuple.
The update program (build_update's GraphModule) has rules of its own, from how the update
runner executes it (validate_update_program). A violation raises GraphValidationError
naming the pass that ran last and the node.
"""
from __future__ import annotations

import torch
import torch.fx

from graphpar.ir import (META_KEY, PHASE_LAUNCH, PHASE_STEP, PHASE_WRITE, PHASES, PLACEMENTS, NodeRecord, Partial, Replicate,
                         Shard, TensorMeta, fetch_attr)


class GraphValidationError(RuntimeError):
    pass


def _fail(pass_name: str, node: torch.fx.Node, problem: str, fix: str) -> GraphValidationError:
    return GraphValidationError(
        f"after pass {pass_name!r}: node {node.name!r} ({node.op} {_short(node.target)}) {problem}. "
        f"Fix: {fix}")


def _short(target) -> str:
    text = getattr(target, "__name__", None) or str(target)
    return text if len(text) < 60 else text[:57] + "..."


def _check_record(pass_name: str, node: torch.fx.Node) -> NodeRecord:
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
    if rec.update_placement is not None and rec.update_placement not in PLACEMENTS:
        raise _fail(pass_name, node, f"has update_placement {rec.update_placement!r}",
                    f"update_placement must be None or one of {PLACEMENTS}.")
    return rec


def _check_program_record(pass_name: str, gm: torch.fx.GraphModule, node: torch.fx.Node, rec: NodeRecord) -> None:
    """A model program's node: an update placement only where build_update looks for one."""
    if rec.update_placement is not None and not _is_trainable_parameter(gm, node):
        raise _fail(pass_name, node, f"has update_placement {rec.update_placement!r} but is not the get_attr of a "
                                     f"trainable parameter", "set update_placement only on get_attr nodes reading a "
                                                             "parameter with requires_grad (place_on_host's rule).")
    if rec.bucket is not None or rec.phase is not None:
        raise _fail(pass_name, node, f"has bucket {rec.bucket!r} and phase {rec.phase!r}, which only nodes of the "
                                     f"update program carry", "leave bucket and phase None outside build_update's "
                                                              "program.")


def _is_trainable_parameter(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    return node.op == "get_attr" and bool(getattr(fetch_attr(gm, str(node.target)), "requires_grad", False))


def _lint(gm: torch.fx.GraphModule, pass_name: str) -> None:
    try:
        gm.graph.lint()
    except Exception as exc:  # lint raises plain RuntimeErrors; say which pass produced the graph
        raise GraphValidationError(
            f"after pass {pass_name!r}: the graph fails torch.fx lint: {exc}\nFix: edit the graph so that every "
            f"node comes after its inputs and every get_attr target is registered on the GraphModule.") from exc


def validate(gm: torch.fx.GraphModule, pass_name: str) -> None:
    _lint(gm, pass_name)
    outputs = [n for n in gm.graph.nodes if n.op == "output"]
    if len(outputs) != 1 or not isinstance(outputs[0].args[0], (tuple, list)):
        raise GraphValidationError(
            f"after pass {pass_name!r}: the graph must end in one output returning a flat tuple, "
            f"got {[o.args for o in outputs]}. Fix: end the graph with graph.output((value, ...)), "
            f"one flat tuple, as the pass received it.")
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        _check_program_record(pass_name, gm, node, _check_record(pass_name, node))


def validate_update_program(program: torch.fx.GraphModule, pass_name: str) -> None:
    """The update program, as graphpar.runtime.placement.runner runs it: every node but the
    output is a call with a phase (nodes without one would never run); a bucket's launches
    run on backward's thread once the bucket is complete, its steps in a worker thread during
    backward, its writes and the bucketless writes after it, so a launch or a step needs a
    bucket among program.buckets, and a node reads only its own bucket's nodes of the same or
    an earlier phase."""
    _lint(program, pass_name)
    buckets = len(getattr(program, "buckets", ()))
    for node in program.graph.nodes:
        if node.op == "output":
            continue
        _check_update_node(pass_name, node, _check_record(pass_name, node), buckets)


def _check_update_node(pass_name: str, node: torch.fx.Node, rec: NodeRecord, buckets: int) -> None:
    if node.op not in ("call_module", "call_function") or rec.phase not in PHASES:
        raise _fail(pass_name, node, f"is a {node.op} with phase {rec.phase!r} in the update program",
                    f"the update runner runs only call_module and call_function nodes with a phase in {PHASES}.")
    if rec.update_placement is not None:
        raise _fail(pass_name, node, f"has update_placement {rec.update_placement!r} in the update program",
                    "update_placement belongs on the model program's parameter get_attr nodes.")
    if rec.bucket is not None and (isinstance(rec.bucket, bool) or not isinstance(rec.bucket, int)
                                   or not 0 <= rec.bucket < buckets):
        raise _fail(pass_name, node, f"has bucket {rec.bucket!r}, but the program has {buckets} bucket(s)",
                    f"bucket must be None (after every bucket) or an int in [0, {buckets}).")
    if rec.phase in (PHASE_LAUNCH, PHASE_STEP) and rec.bucket is None:
        raise _fail(pass_name, node, f"is a {rec.phase} with no bucket", f"give it the bucket whose gradients it reads, or "
                                                                 f"make it a {PHASE_WRITE!r} node.")
    for source in node.all_input_nodes:
        src = source.meta[META_KEY]  # checked already: lint keeps sources before their users
        other_bucket = rec.bucket is not None and src.bucket != rec.bucket
        if other_bucket or PHASES.index(src.phase) > PHASES.index(rec.phase):
            raise _fail(pass_name, node, f"({rec.phase}, bucket {rec.bucket}) reads {source.name!r} ({src.phase}, "
                                         f"bucket {src.bucket}), which the runner may not have run by then",
                        f"read only nodes of the same bucket, in the same or an earlier phase {PHASES}.")

"""shard_parameters: ZeRO-3, each trained parameter read from its bucket's gather, never held.

With Strategy.zero = 3 at dp > 1, build_update made one `Unsharded` bucket (the rank's shard
of the bucket's weights, graphpar/runtime/zero3.py) per gradient bucket. This pass puts the
buckets into the rank's program, gathers each just before the first node that reads any of
its parameters, starts the next bucket's gather as soon as the current one is in (prefetch),
and frees the bucket after the last node that reads its weights or a view of them; the
parameters' own tensors leave the program:

    before: fc1_weight = self.fc1.weight                         # get_attr, f32[64, 32]
            linear = linear(x, fc1_weight, fc1_bias)
    after:  zero3_0_start = self.zero3_0.start()                 # all-gather over dp, async
            zero3_0_wait = self.zero3_0.wait(zero3_0_start)      # (f32[64, 32], f32[64], ...)
            zero3_1_start = self.zero3_1.start()                 # prefetch of the next bucket
            fc1_weight_1 = getitem(zero3_0_wait, 0)
            fc1_bias_1 = getitem(zero3_0_wait, 1)
            linear = linear(x, fc1_weight_1, fc1_bias_1)
            ...
            zero3_0_free = self.zero3_0.free()                   # after the bucket's last reader

Buckets are gathered in the order the forward pass first reads them; in backward each
bucket prefetches the one whose forward reads ended just before its own (backward_next).
The bucket whose forward reads end last is the one backward reads first: at pp = 1 it gets
`zero3_k_keep = self.zero3_k.keep()` in place of its free, so its buffer stays gathered into
backward instead of being freed and gathered again (FSDP2 keeps its root's parameters so).
Under pp the pass keeps none: a stage runs other microbatches' forwards and backwards between
a microbatch's forward and its backward (docs/zero.md, "Keeping the last bucket").
"""
from __future__ import annotations

import operator
from typing import Dict, List, Tuple

import torch
import torch.fx
import torch.nn as nn

from graphpar.ir import NodeRecord, TensorMeta, copy_record, last_reader, parameter_readers, record, set_record
from graphpar.runtime.experts import ExpertParallel

PASS = "shard_parameters"

def _node(graph: torch.fx.Graph, target: str, args, value, stage) -> torch.fx.Node:
    node = graph.call_module(target, args)
    set_record(node, NodeRecord(value=value, stage=stage, set_by=PASS))
    return node


def _remove_parameter(gm: torch.fx.GraphModule, target: str, still_read: bool) -> None:
    """The parameter leaves the program; where a stage of another pp rank still reads it (a tied
    weight) a shape-only stand-in keeps that rank's reads well-formed in this rank's graph."""
    owner, _, leaf = target.rpartition(".")
    module = gm.get_submodule(owner) if owner else gm
    param = getattr(module, leaf)
    delattr(module, leaf)
    if still_read:
        module.register_parameter(leaf, nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                                     requires_grad=param.requires_grad))


def _bucket_spans(gm, buckets, local) -> List[Tuple[object, List[torch.fx.Node], torch.fx.Node, torch.fx.Node]]:
    """Per bucket read by this program: its parameters' get_attr nodes, its first and last reader
    on this rank, in the order of the first readers."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    reads: Dict[str, List[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            reads.setdefault(str(node.target), []).append(node)
    spans = []
    for bucket in buckets:
        attrs = [n for name in bucket.names for n in reads.get(name, [])]
        readers = [u for n in attrs for u in n.users if local(u)]
        if readers:
            spans.append((bucket, attrs, min(readers, key=order.get), last_reader(attrs, order, local)))
    return sorted(spans, key=lambda span: order[span[2]])


def _stage_of(nodes: List[torch.fx.Node], local):
    """The stage of this rank reading the bucket (build_update keeps a bucket to one)."""
    stages = [record(u).stage for n in nodes for u in n.users if local(u) and record(u).stage is not None]
    return min(stages) if stages else None


def _on_rank(mesh, strategy):
    """Whether a node runs on this pp rank (graphpar.strategy.stage_rank)."""
    def local(node: torch.fx.Node) -> bool:
        stage = record(node).stage
        return stage is None or strategy.stage_rank(stage) == mesh.pp_rank
    return local


def shard_parameters(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    program = ctx.results.update
    buckets = getattr(program, "unsharded", None) if program is not None else None
    if not buckets:
        return gm
    graph, local = gm.graph, _on_rank(ctx.mesh, ctx.strategy)
    _expose_expert_weights(gm, buckets)
    spans = _bucket_spans(gm, buckets, local)
    # where a state dict finds each parameter taken out (split_stages' param_stages), every pp
    # rank's readers included: read now, before the readers read the buckets instead
    taken = {name for bucket, _, _, _ in spans for name in bucket.names}
    ctx.results.sharded_readers = {name: stages for name, stages in parameter_readers(gm).items() if name in taken}
    kept = _kept_for_backward(graph, spans, ctx.strategy)
    previous_wait = None
    for bucket, attrs, first, last in spans:
        name, stage = f"zero3_{bucket.index}", _stage_of(attrs, local)
        gm.add_submodule(name, bucket)
        # the gather starts right after the previous bucket's wait: it arrives while that one computes
        with graph.inserting_after(previous_wait) if previous_wait is not None else graph.inserting_before(first):
            start = _node(graph, f"{name}.start", (), None, stage)
        with graph.inserting_before(first):
            wait = _node(graph, f"{name}.wait", (start,),
                         tuple(TensorMeta(s, bucket.shard.dtype, True) for s in bucket.shapes), stage)
            views = {}
            for index, param in enumerate(bucket.names):
                # named after the parameter (fx adds a suffix: the get_attr still holds the name)
                views[param] = graph.create_node("call_function", operator.getitem, (wait, index),
                                                 name=param.replace(".", "_"))
        with graph.inserting_after(last):
            _node(graph, f"{name}.keep" if bucket is kept else f"{name}.free", (), None, stage)
        for attr in attrs:
            view = views[str(attr.target)]
            if "graphpar" not in view.meta:
                copy_record(attr, view, PASS, update_placement=None, stage=stage)
            attr.replace_all_uses_with(view, delete_user_cb=local)
        previous_wait = wait
    for bucket, attrs, _, _ in spans:
        read_elsewhere = {str(attr.target) for attr in attrs if attr.users}
        for attr in attrs:
            if not attr.users:
                graph.erase_node(attr)
        for param in bucket.names:
            _remove_parameter(gm, param, param in read_elsewhere)
        for view in [n for n in graph.nodes if n.op == "call_function" and n.target is operator.getitem
                     and n.args[0].target == f"zero3_{bucket.index}.wait" and not n.users]:
            graph.erase_node(view)  # a parameter of the bucket this program does not read
    _link_backward_order(graph, spans)
    gm.recompile()
    return gm


def _expose_expert_weights(gm: torch.fx.GraphModule, buckets) -> None:
    """An experts call (passes/expert_parallel.py) reads its expert weights inside its module,
    through no get_attr node. Those zero=3 shards over edp each get a get_attr handed to the call
    by the weight's own name, which the module's forward reads (graphpar/runtime/experts.py):

        experts = self.model.layers.0.mlp.experts(hidden, index, weights,
                                                  gate_up_proj=..._gate_up_proj, down_proj=..._down_proj)

    so that the rest of this pass gathers the bucket before the call, hands it the views and
    frees it after, as for any other reader."""
    sharded = {name for bucket in buckets for name in bucket.names}
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(str(node.target)), ExpertParallel):
            continue
        module = gm.get_submodule(str(node.target))
        leaves = [leaf for leaf, _ in module.named_parameters() if f"{node.target}.{leaf}" in sharded]
        attrs = {}
        with graph.inserting_before(node):
            for leaf in leaves:
                param = module.get_parameter(leaf)
                # (a list's expert module weight, `0.w1.weight`, is no keyword: held_<i> stands for it)
                key = module.keyword(leaf)
                attrs[key] = graph.get_attr(f"{node.target}.{leaf}")
                set_record(attrs[key], NodeRecord(value=TensorMeta(tuple(param.shape), param.dtype, param.requires_grad),
                                                  stage=record(node).stage, set_by=PASS))
        if attrs:
            node.kwargs = {**node.kwargs, **attrs}


def _kept_for_backward(graph: torch.fx.Graph, spans, strategy):
    """The bucket whose forward reads end last, which backward reads first, at pp = 1, where
    each microbatch's backward directly follows its forward; None under pp."""
    if strategy.pp > 1 or not spans:
        return None
    order = {node: i for i, node in enumerate(graph.nodes)}
    return max(spans, key=lambda span: order[span[3]])[0]


def _link_backward_order(graph: torch.fx.Graph, spans) -> None:
    """Backward needs buckets about in the reverse order their forward reads end: each one
    prefetches the bucket whose reads ended just before its own."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    by_end = [span[0] for span in sorted(spans, key=lambda span: order[span[3]])]
    for earlier, later in zip([None] + by_end, by_end):
        later.__dict__["backward_next"] = earlier

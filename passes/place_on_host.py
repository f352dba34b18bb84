"""place_on_host: decide where optimizer updates and embedding tables live. Tags only.

Reads Strategy.offload_optimizer and Strategy.offload_embedding. Writes:

* every trainable parameter's get_attr node: NodeRecord.update_placement = "host" or "device",
  where its update, fp32 master weight and optimizer states will live (build_update reads it);
* with offload_embedding, each chosen embedding lookup and its table's get_attr node:
  NodeRecord.placement = "host" (lower_placement reads it and moves them).

    before: embedding = embedding(input_0, wte_weight)
    after:  embedding = embedding(input_0, wte_weight)      # wte_weight @host, embedding @host

Nothing moves here, so dumps show the decision before the transfers that implement it.
"""
from __future__ import annotations

import torch.fx

from graphpar.ir import fetch_attr, stamp
from graphpar.passes.host_tables import host_lookups

PASS = "place_on_host"


def place_on_host(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    update = update_placement(ctx.strategy)
    for node in gm.graph.nodes:
        if node.op == "get_attr" and getattr(fetch_attr(gm, str(node.target)), "requires_grad", False):
            stamp(node, PASS, update_placement=update)
    for lookup, table in host_lookups(gm, ctx.model, ctx.strategy.offload_embedding):
        stamp(lookup, PASS, placement="host")
        stamp(table, PASS, placement="host")
    return gm


def update_placement(strategy) -> str:
    """Where every trainable parameter's update, fp32 master and optimizer states live (build_update
    asks too, for the expert weights whose get_attrs expert_parallel replaced)."""
    return "host" if strategy.offload_optimizer else "device"

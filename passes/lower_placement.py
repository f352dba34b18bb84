"""lower_placement: carry out place_on_host's tags with explicit transfers.

Update program: wherever a node's input lives elsewhere (a device gradient read by a host
update, host weights read by a device write) a transfer goes in between:

    before: weights_0 = self.update_0(grads_0)               # update_0 @host
    after:  grads_0_host = to_host(grads_0)
            weights_0 = self.update_0(grads_0_host)
            weights_0_device = to_device(weights_0, 'cpu')
            written_0 = self.write_0(weights_0_device)

Forward graph: a host lookup becomes a HostEmbedding module holding this rank's rows of
the table (the table leaves the device parameters); only the batch's unique rows come to
the device, where an ordinary embedding over them restores the batch's shape:

    before: embedding = embedding(input_0, wte_weight)               # @host
    after:  input_0_host = to_host(input_0)
            lookup = self.host_wte_weight(input_0_host)              # @host: (rows, inverse)
            rows = lookup[0]; inverse = lookup[1]
            rows_device = to_device(rows, 'cpu'); inverse_device = to_device(inverse, 'cpu')
            embedding = embedding(inverse_device, rows_device)

The host tables' row updates join the update program (after every bucket's write).
"""
from __future__ import annotations

import operator

import torch
import torch.fx
import torch.nn.functional as F

from graphpar.ir import NodeRecord, PHASE_WRITE, TensorMeta, fetch_attr, record, set_record
from graphpar.runtime.placement.embedding import EmbeddingUpdate, HostEmbedding, rows_per_rank
from graphpar.runtime.placement.transfers import to_device, to_host
from graphpar.passes.tp.opinfo import op_of

PASS = "lower_placement"


def _transfer(graph, value: torch.fx.Node, placement: str, device: str, rec: NodeRecord) -> torch.fx.Node:
    """Move `value` for the consumer whose record is `rec`: the transfer runs in the consumer's
    stage, and in the update program in its bucket and phase (a device write's input comes back
    after backward, with the write)."""
    fn, args = (to_host, (value,)) if placement == "host" else (to_device, (value, device))
    node = graph.create_node("call_function", fn, args, name=f"{value.name}_{placement}")
    set_record(node, record(value).replace(PASS, placement=placement, stage=rec.stage, bucket=rec.bucket,
                                            phase=rec.phase))
    return node


def _lower_update(program: torch.fx.GraphModule, device: str) -> None:
    for node in list(program.graph.nodes):
        if node.op != "call_module":
            continue
        for source in list(node.all_input_nodes):
            if record(source).placement != record(node).placement:
                with program.graph.inserting_before(node):
                    moved = _transfer(program.graph, source, record(node).placement, device, record(node))
                node.replace_input_with(source, moved)
    program.recompile()


def _host_table(gm, table: torch.fx.Node, lookup: torch.fx.Node, ctx) -> str:
    """This rank's rows of the table: ceil(rows / dp) each, in dp-rank order, the last short."""
    name = "host_" + str(table.target).replace(".", "_")
    existing = ctx.previous.host_tables.get(name) if ctx.previous is not None else None
    if existing is not None:  # compiled again: the same rows and their optimizer
        gm.add_module(name, existing)
        return name
    full = fetch_attr(gm, str(table.target))
    per_rank = rows_per_rank(full.shape[0], ctx.mesh.dp)
    first = ctx.mesh.dp_rank * per_rank
    mine = full.detach()[first:first + per_rank]
    rows = (torch.zeros(mine.shape, dtype=torch.float32) if mine.is_meta
            else mine.to("cpu", torch.float32, copy=True))
    padding = op_of(lookup).args.get("padding_idx")
    gm.add_module(name, HostEmbedding(str(table.target), full.shape[0], rows, first, "dp", ctx.mesh.dp,
                                      ctx.strategy.param_dtype or torch.float32,
                                      padding if padding is not None and padding >= 0 else None))
    return name


def _lower_lookup(gm, lookup: torch.fx.Node, table: torch.fx.Node, ctx) -> str:
    ids = op_of(lookup).args.get("input", op_of(lookup).args.get("indices"))
    name = _host_table(gm, table, lookup, ctx)
    rec, device = record(lookup), str(ctx.options.device)
    n, dim = record(ids).value.numel, record(table).value.shape[1]
    dtype = ctx.strategy.param_dtype or torch.float32
    graph = gm.graph
    with graph.inserting_before(lookup):
        ids_host = _transfer(graph, ids, "host", device, rec)
        pair = graph.call_module(name, (ids_host,))
        # unique rows: at most one per id (the batch's size is the bound the planner uses)
        set_record(pair, rec.replace(PASS, value=(TensorMeta((n, dim), dtype), record(ids).value)))
        rows, inverse = (graph.create_node("call_function", operator.getitem, (pair, i), name=f"{name}_{what}")
                         for i, what in ((0, "rows"), (1, "positions")))
        set_record(rows, rec.replace(PASS, value=TensorMeta((n, dim), dtype, True)))
        set_record(inverse, rec.replace(PASS, value=record(ids).value))
        rows_device = _transfer(graph, rows, "device", device, rec)
        inverse_device = _transfer(graph, inverse, "device", device, rec)
        expanded = graph.call_function(F.embedding, (inverse_device, rows_device))
        set_record(expanded, rec.replace(PASS, placement="device"))
    lookup.replace_all_uses_with(expanded)
    graph.erase_node(lookup)
    if not table.users:
        graph.erase_node(table)
        *path, leaf = str(table.target).split(".")
        delattr(gm.get_submodule(".".join(path)), leaf)
    return name


def _add_table_updates(program: torch.fx.GraphModule, gm, names) -> None:
    output = next(n for n in program.graph.nodes if n.op == "output")
    for name in names:
        program.add_module(f"update_{name}", EmbeddingUpdate(gm.get_submodule(name)))
        with program.graph.inserting_before(output):
            node = program.graph.call_module(f"update_{name}")
        set_record(node, NodeRecord(value=None, placement="host", phase=PHASE_WRITE, set_by=PASS))
    program.recompile()


def lower_placement(gm: torch.fx.GraphModule, ctx) -> torch.fx.GraphModule:
    program = ctx.results.update
    if program is None:
        return gm
    lookups = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")
               and record(n).placement == "host"]
    ctx.results.host_table_stages = {str(op_of(n).args["weight"].target): record(n).stage or 0 for n in lookups}
    tables = [_lower_lookup(gm, lookup, op_of(lookup).args["weight"], ctx) for lookup in lookups]
    ctx.results.host_tables = {name: gm.get_submodule(name) for name in tables}
    if ctx.previous is None or ctx.previous.update is None:  # a program compiled again is lowered already
        _add_table_updates(program, gm, tables)
        _lower_update(program, str(ctx.options.device))
    gm.recompile()
    return gm

"""graphpar's own passes, in pipeline order: the list `default_passes` returns.

Edit the pipeline here: the order of this list is the order the passes run in, and each
entry declares the results it requires and produces (passes/context.py), which the
manager checks before running anything. Every built-in is listed for every strategy: a
pass that does not apply (tp = 1, one stage, no offload) returns the graph unchanged, so
dumps are numbered alike whatever the strategy.
"""
from __future__ import annotations

from typing import List

from graphpar.passes.annotate_shards import annotate_shards
from graphpar.passes.assign_rng_streams import assign_rng_streams
from graphpar.passes.build_update import build_update
from graphpar.passes.cast_params import cast_params
from graphpar.passes.context import Pass
from graphpar.passes.expert_parallel import expert_parallel
from graphpar.passes.global_router_statistics import global_router_statistics
from graphpar.passes.insert_collectives import insert_collectives
from graphpar.passes.lower_placement import lower_placement
from graphpar.passes.lower_to_rank import lower_to_rank
from graphpar.passes.partition_stages import partition_stages
from graphpar.passes.place_on_host import place_on_host
from graphpar.passes.recompute import recompute
from graphpar.passes.rewrite_parallel_layers import rewrite_parallel_layers
from graphpar.passes.shard_parameters import shard_parameters
from graphpar.passes.split_backward import split_backward
from graphpar.passes.split_stages import split_stages
from graphpar.passes.sync_batch_norm import sync_batch_norm
from graphpar.passes.trace import trace

# unanchored user passes run just before this one (see manager._ordered): after every pass
# that transforms the program, before the two that lower it for the pipeline's runtime
LAST = "split_backward"


def default_passes(strategy=None) -> List[Pass]:
    """The built-in passes for `strategy`, in order, with what each requires and produces."""
    return [
        Pass("trace", trace,
             produces=("program", "record.value", "record.module_path", "record.module_type")),
        Pass("annotate_shards", annotate_shards, requires=("record.value",),
             produces=("tp_plan", "record.spec")),
        Pass("rewrite_parallel_layers", rewrite_parallel_layers, requires=("tp_plan", "record.spec")),
        Pass("insert_collectives", insert_collectives, requires=("tp_plan", "record.spec")),
        Pass("assign_rng_streams", assign_rng_streams, requires=("record.spec",)),
        Pass("global_router_statistics", global_router_statistics, requires=("program", "record.value")),
        Pass("sync_batch_norm", sync_batch_norm, requires=("record.value",)),
        Pass("place_on_host", place_on_host, requires=("record.value",), produces=("record.placement",)),
        Pass("partition_stages", partition_stages, requires=("record.module_path",),
             produces=("stage_plan", "record.stage")),
        Pass("lower_to_rank", lower_to_rank, requires=("tp_plan",), produces=("param_shards", "uninitialized")),
        Pass("expert_parallel", expert_parallel, requires=("record.module_path",), produces=("expert_shards", "expert_owners")),
        Pass("build_update", build_update, requires=("record.placement",), produces=("update",)),
        Pass("lower_placement", lower_placement, requires=("update", "record.placement", "record.stage"),
             produces=("host_tables", "host_table_stages")),
        Pass("cast_params", cast_params, requires=("record.stage",)),
        Pass("recompute", recompute, requires=("record.stage", "record.module_path"), produces=("recompute",)),
        Pass("shard_parameters", shard_parameters, requires=("update", "record.stage"),
             produces=("sharded_readers",)),
        Pass(LAST, split_backward),
        Pass("split_stages", split_stages, requires=("program", "stage_plan", "record.stage"),
             produces=("stages", "crossings", "param_stages", "input_names", "output_meta")),
    ]

"""The built-in passes in pipeline order. Each registers itself with
graphpar.passes.manager.builtin_pass on import; ORDER, not the order in which the modules
happen to be imported (a test may import one pass module first), is the pipeline order."""
from graphpar.passes import (trace, annotate_shards, rewrite_parallel_layers,
                             insert_collectives, assign_rng_streams, sync_batch_norm, place_on_host,
                             partition_stages, lower_to_rank, build_update, lower_placement,
                             cast_params, split_stages)

ORDER = (trace, annotate_shards, rewrite_parallel_layers, insert_collectives, assign_rng_streams,
         sync_batch_norm, place_on_host, partition_stages, lower_to_rank, build_update, lower_placement,
         cast_params, split_stages)

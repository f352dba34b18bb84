"""The built-in passes, imported in pipeline order: each registers itself with
graphpar.passes.manager.builtin_pass on import, so the order of these imports is the order
of the pipeline."""
from graphpar.passes import (trace, annotate_shards, rewrite_parallel_layers,  # noqa: F401
                             insert_collectives, assign_rng_streams, sync_batch_norm, place_on_host,
                             partition_stages, lower_to_rank, build_update, lower_placement,
                             cast_params, split_stages)

"""graphpar's built-in passes, one per file, in pipeline order.

This folder sits at the top of the repository and is installed as the subpackage
``graphpar.passes`` (setup.py: ``package_dir={"graphpar.passes": "passes"}``). Importing it
registers each pass with graphpar.pipeline in the order below, which is the pipeline order.
"""
from graphpar.passes import (trace, annotate_shards, rewrite_parallel_layers,  # noqa: F401
                             insert_collectives, assign_rng_streams, sync_batch_norm, place_on_host,
                             partition_stages, lower_to_rank, build_update, lower_placement,
                             cast_params, split_stages)

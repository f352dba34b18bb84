"""Tensor parallelism: sharding rules, the region solver, collectives and parameter layouts."""

"""What ParallelModule needs of a rank's placed state: master weights and host tables.

With an update program the truth of a parameter is its fp32 master (the device copy may be
bf16), and a host table's rows live only in its HostEmbedding, split over the dp ranks.
State dicts read and write those; the device copies follow the masters.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn as nn

from graphpar.ir.compiled import CompiledRank, replica_axis
from graphpar.runtime.placement.embedding import HostEmbedding, rows_per_rank
from graphpar.runtime.placement.update import MasterWeights, build_optimizer
from graphpar.runtime.zero import (ShardStep, broadcast_initial_masters, build_shard_optimizer, full_optimizer_states,
                                   gather_whole, load_optimizer_states, scatter_whole, sharded_truth)


class PlacedState:
    def __init__(self, compiled: CompiledRank, offload_optimizer: bool):
        self.program = compiled.update
        self.mesh = compiled.mesh
        self.expert_shards = compiled.expert_shards
        self.stage_rank = compiled.strategy.stage_rank
        self.offload_optimizer = offload_optimizer
        self.tables: Dict[str, HostEmbedding] = {t.name: t for t in compiled.host_tables.values()}
        self.table_stages: Mapping[str, int] = compiled.host_table_stages
        self.buckets: List[MasterWeights] = ([m for m in self.program.children() if isinstance(m, MasterWeights)]
                                             if self.program is not None else [])
        # ZeRO (graphpar/runtime/zero.py): each bucket's step over this rank's pieces
        self.shard_steps: List[ShardStep] = ([m for m in self.program.children() if isinstance(m, ShardStep)]
                                             if self.program is not None else [])
        # the weights' truth lives only in shards (fp32 master shards, or zero=3's parameter shards)
        self.sharded_truth = bool(sharded_truth(self.shard_steps))
        self._whole: Dict[str, torch.Tensor] = {}  # sharded weights as masters() last gathered them

    @property
    def has_masters(self) -> bool:
        return bool(self.buckets) or self.sharded_truth

    @property
    def steps_in_program(self) -> bool:
        """The optimizer steps inside the update program (masters or ZeRO shards), not after it."""
        return self.has_masters or bool(self.shard_steps)

    def masters(self) -> Dict[str, nn.Parameter]:
        """Each parameter's truth, whole: its fp32 master, or at zero=3 the weight itself. ZeRO's
        are sharded: gathered here (collective over dp) into copies, which refresh_device_copies
        takes back after a load wrote them."""
        if self.sharded_truth:
            self._whole = gather_whole(self.shard_steps)
            return self._whole
        return {name: p for bucket in self.buckets for name, p in bucket.named_masters().items()}

    def build_optimizer(self, factory: Optional[Callable]) -> Optional[torch.optim.Optimizer]:
        """The user's optimizer over the masters (None: no masters); host tables get theirs."""
        for table in self.tables.values():
            table.bind(factory)
        if self.shard_steps:
            return build_shard_optimizer(factory, self.shard_steps)
        return build_optimizer(factory, self.buckets, host=self.offload_optimizer)

    def tables_follow(self, optimizer: Optional[torch.optim.Optimizer]) -> None:
        """Host tables step with pm.optimizer's scheduled hyperparameters (an LR scheduler on it)."""
        for table in self.tables.values():
            table.follow(optimizer)

    def unsharded_names(self) -> List[str]:
        """The parameters zero=3 holds only as shards (no device tensor of them exists)."""
        return [name for step in self.shard_steps if step.unsharded is not None for name in step.names]

    def named_pieces(self) -> List[Tuple[str, nn.Parameter]]:
        """zero=3: what the optimizer steps, each piece named by its parameter."""
        return [(step.names[piece.index], shard) for step in self.shard_steps if step.unsharded is not None
                for piece, shard in zip(step.pieces, step.shards)]

    # ---- ZeRO: the optimizer state of whole parameters, for checkpoints ----------------------
    def sharded_optimizer_states(self, optimizer, gather: bool) -> Dict[str, Dict]:
        """Per parameter name, its whole optimizer state (gather=True: collective over dp), or
        empty dicts to be filled and handed to install_sharded_optimizer_states."""
        if gather:
            return full_optimizer_states(self.shard_steps, optimizer)
        return {name: {} for step in self.shard_steps for name in step.names}

    def install_sharded_optimizer_states(self, optimizer, states: Dict[str, Dict]) -> None:
        load_optimizer_states(self.shard_steps, optimizer, states)

    def refresh_device_copies(self) -> None:
        """After the masters changed outside a step (loading, broadcast): device copies follow."""
        if self.sharded_truth:
            scatter_whole(self.shard_steps, self._whole)
        for k, bucket in enumerate(self.buckets):
            write = self.program.get_submodule(f"write_{k}")  # build_update's names
            write(bucket.refresh().to(write.params[0].device))

    def broadcast_masters(self) -> None:
        """Every replica's masters from the first replica's (an expert bucket's from the first
        rank of its edp group: build_update never mixes expert and dense weights in a bucket)."""
        broadcast_initial_masters(self.shard_steps)
        for bucket in self.buckets:
            axis = replica_axis(bucket.names[0], self.expert_shards)
            dist.broadcast(bucket.flat, src=self.mesh.ranks_along(axis)[0], group=self.mesh.group(axis))
        if self.buckets:
            self.refresh_device_copies()

    # ---- host tables, whole ---------------------------------------------------------------------
    def table_owner(self, name: str) -> Optional[int]:
        """The pp rank holding a host table, or None if it is not one."""
        stage = self.table_stages.get(name)
        return None if stage is None else self.stage_rank(stage)

    def owned_tables(self) -> Dict[str, HostEmbedding]:
        """The host tables this rank's stages look up (every rank builds all of them)."""
        return {name: t for name, t in self.tables.items() if self.table_owner(name) == self.mesh.pp_rank}

    def full_table(self, name: str) -> torch.Tensor:
        """Gather the table's rows from the dp ranks (collective over dp)."""
        table = self.tables[name]
        rows = table.table.detach()
        if self.mesh.dp == 1:
            return rows.clone()
        # all_gather needs equal pieces: the last rank's shorter piece is padded for the trip
        per_rank = rows_per_rank(table.full_rows, self.mesh.dp)
        padded = rows.new_zeros((per_rank, rows.shape[1]))
        padded[:rows.shape[0]] = rows
        parts = [torch.empty_like(padded) for _ in range(self.mesh.dp)]
        dist.all_gather(parts, padded, group=self.mesh.group("dp"))
        return torch.cat(parts)[:table.full_rows]

    def load_table(self, name: str, full: torch.Tensor) -> None:
        table = self.tables[name]
        with torch.no_grad():
            table.table.copy_(full[table.first_row:table.first_row + table.table.shape[0]])

"""Embedding tables in host memory: row lookups, row gradients, row-wise updates.

A host table is split by rows over the ranks of the data-parallel group (the parameter-
server mode; with dp=1 one rank holds it all). A lookup sends the batch's unique ids to
their owners (all-to-all), the owners gather those rows, and the rows come back; only the
unique looked-up rows cross to the device. The backward sends each unique row's gradient
to its owner, which sums what every dp rank sent and, after backward, applies the update
to those rows only. No dense gradient of the table ever exists.

The update is the user's optimizer applied row-wise: SGD and Adagrad through torch's
sparse-gradient support; Adam and AdamW as lazy Adam (torch.optim.SparseAdam's update on
the touched rows; AdamW's decoupled weight decay on the touched rows too). For SGD without
momentum or weight decay this equals dense training exactly; for Adam it is the usual
large-embedding trade-off (rows not in the batch keep their moments and weights).
The row-wise optimizer takes what LR schedulers change (SCHEDULED) from pm.optimizer's first
param group before every update, so a scheduler on pm.optimizer reaches the tables too, and
a checkpoint (which saves pm.optimizer's groups) restores their rate.
Which tables go to the host is decided at compile time: passes/host_tables.py.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.fx
import torch.nn as nn

from graphpar.runtime import ops
from graphpar.runtime.optimizer import make_optimizer

# what LR schedulers change in a param group: the rate, and momentum or Adam's beta1 (OneCycleLR
# and CyclicLR cycle them); the row-wise optimizer follows these from pm.optimizer
SCHEDULED = ("lr", "momentum", "betas")

# ---- the table and its traffic -----------------------------------------------------------------
def rows_per_rank(num_rows: int, ranks: int) -> int:
    """Rows each rank owns of a table split over `ranks` (the last rank may own fewer)."""
    return -(-num_rows // ranks)


def _exchange(tensor: torch.Tensor, send_counts: List[int], axis: str) -> Tuple[torch.Tensor, List[int]]:
    """all-to-all along `axis`: rows [sum(send_counts), ...] out, what each rank sent us in."""
    size = ops.axis_size(axis)
    if size == 1 or ops.simulating():
        return tensor, send_counts
    group = ops.axis_group(axis)
    counts_in = torch.empty(size, dtype=torch.int64)
    dist.all_to_all_single(counts_in, torch.tensor(send_counts, dtype=torch.int64), group=group)
    received = [int(c) for c in counts_in]
    out = tensor.new_empty((sum(received),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), received, send_counts, group=group)
    return out, received


def _return(tensor: torch.Tensor, received: List[int], send_counts: List[int], axis: str) -> torch.Tensor:
    """The reverse of `_exchange`: answers go back to the ranks that asked."""
    if ops.axis_size(axis) == 1 or ops.simulating():
        return tensor
    out = tensor.new_empty((sum(send_counts),) + tuple(tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), send_counts, received, group=ops.axis_group(axis))
    return out


class HostEmbedding(nn.Module):
    """This rank's rows of one host table (fp32, host memory) and their pending gradients."""

    def __init__(self, name: str, full_rows: int, rows: torch.Tensor, first_row: int, axis: str,
                 ranks: int, compute_dtype: torch.dtype, padding_idx: Optional[int]):
        super().__init__()
        self.name, self.full_rows, self.first_row, self.axis = name, full_rows, first_row, axis
        self.ranks = ranks  # the update runs outside the executor, where the mesh is not set
        self.compute_dtype, self.padding_idx = compute_dtype, padding_idx
        self.__dict__["table"] = nn.Parameter(rows, requires_grad=False)
        self.__dict__["optimizer"] = None
        self.__dict__["row_update"] = None
        self.__dict__["lead"] = None  # the optimizer whose first param group the row update follows
        self.grad_divisor = 1.0  # the post-backward divisor (runtime/grad_divisor.py), divided out of the row gradients
        self._pending: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self._rows: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # row_gradients, once per step

    def bind(self, optimizer_factory: Optional[Callable]) -> None:
        self.__dict__["optimizer"], self.__dict__["row_update"] = row_optimizer(self.table, optimizer_factory)

    def follow(self, lead: Optional[torch.optim.Optimizer]) -> None:
        """Take SCHEDULED hyperparameters from `lead`'s first param group (the group whose
        settings row_optimizer took) at every update. The optimizer is kept, not the group:
        lead.load_state_dict() replaces its group dicts."""
        self.__dict__["lead"] = lead

    def _take_scheduled(self) -> None:
        if self.lead is not None:
            take_scheduled(self.lead, self.optimizer)

    def forward(self, ids: torch.Tensor):
        if ops.simulating():  # the planner's fake run: at most one row per id, no traffic
            return (torch.zeros((ids.numel(), self.table.shape[1]), dtype=self.compute_dtype),
                    torch.zeros(ids.shape, dtype=torch.int64))
        unique, inverse = torch.unique(ids.reshape(-1), return_inverse=True)
        rows = _Lookup.apply(unique, self, torch.empty(0, requires_grad=torch.is_grad_enabled()))
        return rows, inverse.view(ids.shape)

    def _routing(self, ids: torch.Tensor):
        owner = torch.div(ids, rows_per_rank(self.full_rows, self.ranks), rounding_mode="floor")
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=self.ranks).tolist()
        return order, counts

    def pull(self, ids: torch.Tensor) -> torch.Tensor:
        order, counts = self._routing(ids)
        asked, received = _exchange(ids[order], counts, self.axis)
        answers = self.table.detach()[asked - self.first_row].to(self.compute_dtype)
        rows = torch.empty((ids.numel(), self.table.shape[1]), dtype=self.compute_dtype)
        rows[order] = _return(answers, received, counts, self.axis)
        return rows

    def push(self, ids: torch.Tensor, grads: torch.Tensor) -> None:
        order, counts = self._routing(ids)
        mine, _ = _exchange(ids[order], counts, self.axis)
        grad_rows, _ = _exchange(grads[order].float(), counts, self.axis)
        self._pending.append((mine - self.first_row, grad_rows))

    def discard(self) -> None:
        """Drop this step's row gradients (after the update, or an fp16 step that overflowed)."""
        self._pending, self._rows = [], None

    def row_gradients(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(rows, their gradients): this step's gradient of the touched rows this rank owns,
        summed over lookups and averaged over dp ranks, before the post-backward divisor
        (global gradient-norm clipping reads it before the update applies it)."""
        if self._rows is None:
            ids = torch.cat([i for i, _ in self._pending]) if self._pending else torch.zeros(0, dtype=torch.int64)
            grads = (torch.cat([g for _, g in self._pending]) if self._pending
                     else torch.zeros((0, self.table.shape[1]))) / self.ranks
            if self.padding_idx is not None:
                keep = ids != self.padding_idx - self.first_row
                ids, grads = ids[keep], grads[keep]
            unique, inverse = torch.unique(ids, return_inverse=True)
            summed = torch.zeros((unique.numel(), grads.shape[1]), dtype=grads.dtype).index_add_(0, inverse, grads)
            self._rows = (unique, summed)
        return self._rows

    def update(self) -> None:
        """Apply this step's row gradients (averaged over dp ranks) to the touched rows."""
        if not self._pending:
            return
        unique, summed = self.row_gradients()
        self.discard()
        if self.row_update is not None:
            self._take_scheduled()
            self.row_update(self.table, unique, summed / self.grad_divisor)


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, unique, table: HostEmbedding, anchor):
        ctx.table = table
        ctx.save_for_backward(unique)
        return table.pull(unique)

    @staticmethod
    def backward(ctx, grad_rows):
        (unique,) = ctx.saved_tensors
        ctx.table.push(unique, grad_rows)
        return None, None, torch.zeros(0)


class EmbeddingUpdate(nn.Module):
    """The update program's node for one host table: apply its row gradients."""

    def __init__(self, table: HostEmbedding):
        super().__init__()
        self.__dict__["host_table"] = table

    def forward(self) -> None:
        self.host_table.update()


# ---- row-wise optimizers -----------------------------------------------------------------------
def take_scheduled(lead: torch.optim.Optimizer, own: torch.optim.Optimizer) -> None:
    """Copy what LR schedulers change (SCHEDULED) from lead's first param group into own's."""
    lead_group, own_group = lead.param_groups[0], own.param_groups[0]
    for key in SCHEDULED:
        if key in lead_group and key in own_group:
            own_group[key] = lead_group[key]


def row_optimizer(table: nn.Parameter, factory: Optional[Callable]):
    """(optimizer, update(table, rows, grads)) applying the user's optimizer to rows only."""
    if factory is None:
        return None, None
    probe = make_optimizer(factory, [nn.Parameter(torch.zeros(1))])
    group = probe.param_groups[0]
    if isinstance(probe, (torch.optim.Adam, torch.optim.AdamW)):
        decay = group["weight_decay"] if (isinstance(probe, torch.optim.AdamW)
                                          or group.get("decoupled_weight_decay")) else 0.0
        if group["weight_decay"] and not decay:
            raise ValueError(f"a host embedding with {type(probe).__name__}(weight_decay={group['weight_decay']}) "
                             f"(L2 in the gradient) has no row-wise form. Fix: use AdamW or weight_decay=0.")
        optimizer = torch.optim.SparseAdam([table], lr=group["lr"], betas=group["betas"], eps=group["eps"])
        # created now, in AdamW's layout (a tensor step), so a checkpoint holds it from step 0
        # and it moves between a host table and a device AdamW either way
        optimizer.state[table].update(step=torch.zeros(()), exp_avg=torch.zeros_like(table),
                                      exp_avg_sq=torch.zeros_like(table))
        return optimizer, _lazy_adam(optimizer, float(decay))
    if isinstance(probe, (torch.optim.SGD, torch.optim.Adagrad)):
        if group.get("weight_decay"):
            raise ValueError(f"a host embedding with {type(probe).__name__}(weight_decay={group['weight_decay']}) "
                             f"would decay every row each step, which is not row-wise. Fix: weight_decay=0 for "
                             f"the embedding (e.g. a separate optimizer) or keep it on the device.")
        optimizer = type(probe)([table], **{k: v for k, v in group.items() if k != "params"})
        return optimizer, _sparse_step(optimizer)
    raise ValueError(f"a host embedding needs a row-wise update, which graphpar has for SGD, Adagrad, Adam and "
                     f"AdamW, not {type(probe).__name__}. Fix: use one of those, or offload_embedding=False.")


def _sparse_grad(table: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor) -> torch.Tensor:
    # rows are unique and sorted (torch.unique), which is what coalesced means
    return torch.sparse_coo_tensor(rows.unsqueeze(0), grads, table.shape, is_coalesced=True,
                                   check_invariants=False)


def _sparse_step(optimizer):
    def update(table, rows, grads):
        table.grad = _sparse_grad(table, rows, grads)
        optimizer.step()
        table.grad = None
    return update


def _lazy_adam(optimizer, weight_decay: float):
    group = optimizer.param_groups[0]  # read at each step, so LR changes apply

    def update(table, rows, grads):
        if weight_decay:
            with torch.no_grad():
                table[rows] *= 1 - group["lr"] * weight_decay
        _sparse_step(optimizer)(table, rows, grads)
    return update

"""docs/errors.md, Expert parallelism (passes/expert_parallel.py, graphpar/strategy.py):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from graphpar.passes.expert_parallel import ExpertParallelError
from graphpar.passes.global_router_statistics import RouterStatisticsError
from tests.errors.catalogue import entry_test, expect, registrar
from tests.errors.models import mlp, x4
from graphpar.runtime.experts import expert_parallel_class
from tests.targets.ep_targets import (ExpertMLP, FusedExperts, TinyMoE, aux_lm_loss, list_moe, moe_batch, moe_model,
                                      tiny_moe)

CASES = {}
case = registrar(CASES)


def lower_moe(model, strategy, x=None, **options):
    x = torch.randn(6, 8) if x is None else x
    return lower_rank(model, strategy, (x,), rank=0, world_size=strategy.world_size, loss_fn=F.cross_entropy,
                      example_target=torch.randint(0, 5, (x.shape[0],)), **options)


@case("E-strategy-ep-dp")
def _():
    expect(ValueError, lambda: gp.Strategy(dp=3, tp=2, ep=4), r"Strategy\.ep=4 with dp=3, tp=2 is invalid",
           r"ep must divide dp \* tp = 6", r"Fix: use ep=2 or ep=3 or ep=6, or set dp \* tp to a multiple of 4")


@case("E-strategy-ep-capacity")
def _():
    for value in (0, -1.0, float("inf"), "1.25", True):
        expect(ValueError, lambda value=value: gp.Strategy(dp=2, ep=2, expert_capacity_factor=value),
               re.escape(f"Strategy.expert_capacity_factor={value!r} is invalid"),
               r"a finite number > 0: each expert then takes at most ceil\(factor \* T \* K / E\)",
               r"Fix: use expert_capacity_factor=None, or a factor such as 1.25")


@case("E-strategy-ep-capacity-ep1")
def _():
    expect(ValueError, lambda: gp.Strategy(dp=2, expert_capacity_factor=1.25),
           r"Strategy\.expert_capacity_factor=1\.25 with ep=1 is invalid",
           "at ep=1 the experts run the model's own forward, which drops nothing",
           r"Fix: set ep > 1 .*, or expert_capacity_factor=None")


@case("E-ep-no-experts")
def _():
    expect(ExpertParallelError, lambda: lower_rank(mlp(), gp.Strategy(dp=2, ep=2), (x4(),), rank=0, world_size=2),
           r"Strategy\.ep=2 found no mixture-of-experts layer in", "num_experts", "Fix: use ep=1")


@case("E-ep-divisibility")
def _():
    expect(ExpertParallelError, lambda: lower_moe(tiny_moe(experts=6), gp.Strategy(dp=4, ep=4)),
           r"Strategy\.ep=4 cannot split the 6 experts of 'experts'", "ep must divide the number of experts",
           "Fix: use ep=2 or ep=3 or ep=6, or ep=1")


class SelfRouted(FusedExperts):
    """Experts that route inside their own forward: not the (hidden, index, weights) interface."""

    def forward(self, hidden):
        weights, index = hidden[:, :self.num_experts].softmax(dim=-1).topk(2, dim=-1)
        return super().forward(hidden, index, weights)


class SelfRoutedMoE(TinyMoE):
    def forward(self, x):
        return self.head(x + self.experts(x))


@case("E-ep-interface")
def _():
    model = SelfRoutedMoE()
    model.experts.__class__ = SelfRouted
    expect(ExpertParallelError, lambda: lower_moe(model, gp.Strategy(dp=2, ep=2)),
           r"the experts module 'experts' is not called as forward\(hidden \[T, H\], top_k_index \[T, K\]",
           "takes 1 value", "Fix: use ep=1")


class ReadsExpertWeights(TinyMoE):
    def forward(self, x):
        return super().forward(x) + self.experts.down_proj.mean()


@case("E-ep-weight-outside")
def _():
    expect(ExpertParallelError, lambda: lower_moe(ReadsExpertWeights(), gp.Strategy(dp=2, ep=2)),
           "'experts.down_proj' is read outside the experts module 'experts'", "cannot be split",
           "Fix: use ep=1")


@case("E-ep-submodule-parameters")
def _():
    model = tiny_moe()
    model.experts.norm = nn.LayerNorm(8)   # held, never called: its parameters still belong to the experts
    expect(ExpertParallelError, lambda: lower_moe(model, gp.Strategy(dp=2, ep=2)),
           "the experts module 'experts' has submodules with parameters", "Fix: use ep=1")


@case("E-ep-tp-tokens")
def _():
    # the head's 5 classes do not split over tp=2: kept whole, so the tokens' count is what fails
    expect(ExpertParallelError, lambda: lower_moe(tiny_moe(), gp.Strategy(dp=2, tp=2, ep=2), torch.randn(5, 8),
                                                  tp_replicate=["head"]),
           r"Strategy\.ep=2 with tp=2: the experts module 'experts' gets 5 tokens per microbatch",
           "cannot dispatch in equal shares", "Fix: use a batch whose tokens per microbatch are a multiple of 2")


@case("E-strategy-expert-tp")
def _():
    expect(ValueError, lambda: gp.Strategy(dp=2, tp=2, expert_tp=4), r"Strategy\.expert_tp=4 with tp=2 is invalid",
           "expert_tp must be 1 or tp", "Fix: use expert_tp=2 or expert_tp=1")


@case("E-strategy-expert-tp-ep")
def _():
    expect(ValueError, lambda: gp.Strategy(dp=2, tp=2, ep=4, expert_tp=2),
           r"Strategy\.ep=4 with expert_tp=2, dp=2 is invalid", "ep must divide dp = 2",
           r"Fix: use ep=1 or ep=2, or expert_tp=1 \(ep then folds into dp \* tp = 4\)")


class TransposedExperts(FusedExperts):
    is_transposed = True   # transformers' [E, H, 2I] layout: its columns are not the gate's and up's


@case("E-ep-tp-layout")
def _():
    model = tiny_moe()
    model.experts.__class__ = TransposedExperts
    expect(ExpertParallelError, lambda: lower_moe(model, gp.Strategy(dp=2, tp=2, expert_tp=2), tp_replicate=["head"]),
           r"Strategy\.expert_tp=2 cannot split the experts of 'experts' \(TransposedExperts: gate_up_proj \[4, 12, 8\]",
           "without bias or transposed weights", "Fix: use expert_tp=1 for this model")
    x = torch.randn(6, 8)   # gp.plan refuses what compile refuses
    expect(ExpertParallelError, lambda: gp.plan(model, gp.Strategy(dp=2, tp=2, expert_tp=2), (x,),
                                                loss_fn=F.cross_entropy, example_target=torch.randint(0, 5, (6,)),
                                                tp_replicate=["head"]),
           r"Strategy\.expert_tp=2 cannot split the experts of 'experts'", "Fix: use expert_tp=1")


@case("E-ep-tp-intermediate")
def _():
    model = tiny_moe()
    model.experts = FusedExperts(inner=5)
    expect(ExpertParallelError, lambda: lower_moe(model, gp.Strategy(dp=2, tp=2, expert_tp=2), tp_replicate=["head"]),
           r"Strategy\.expert_tp=2 cannot split the experts of 'experts'", "expert_tp must divide 5",
           "Fix: use expert_tp=1")


@case("E-ep-list-count")
def _():
    model = list_moe()
    model.experts.append(nn.Linear(8, 8))   # a fifth module in a container of num_experts=4
    expect(ExpertParallelError, lambda: lower_moe(model, gp.Strategy(dp=2, ep=2)),
           r"the experts container 'experts' \(ExpertList\) has num_experts=4 but holds 5 modules",
           "expert e being the e-th", "Fix: hold exactly the experts in it")


@case("E-ep-list-shapes")
def _():
    model = list_moe()
    model.experts[3] = ExpertMLP(inner=7)
    expect(ExpertParallelError, lambda: lower_moe(model, gp.Strategy(dp=2, ep=2)),
           r"the experts of 'experts' differ: expert '3' \(ExpertMLP: w1.weight \[7, 8\]",
           r"is not like expert '0' \(ExpertMLP: w1.weight \[6, 8\]", "E/ep experts of one structure",
           "Fix: make every expert the same module class with the same parameter shapes")


@case("E-ep-list-state")
def _():
    model = list_moe()
    for expert in model.experts:
        expert.register_buffer("calls", torch.zeros(()))
    expect(ExpertParallelError, lambda: lower_moe(model, gp.Strategy(dp=2, ep=2)),
           r"expert '0' of 'experts' has buffers \['calls'\]", "runs the experts eagerly",
           "Fix: experts holding parameters only")
    model = list_moe()
    for expert in model.experts:
        expert.drop = nn.Dropout(0.1)
    expect(ExpertParallelError, lambda: lower_moe(model, gp.Strategy(dp=2, ep=2)),
           r"expert '0' of 'experts' has dropout with p > 0 at \['drop'\]", "random streams",
           "with dropout p=0 inside them")


@case("E-ep-list-no-parameters")
def _():
    model = list_moe()
    for i in range(4):
        model.experts[i] = nn.SiLU()
    expect(ExpertParallelError, lambda: lower_moe(model, gp.Strategy(dp=2, ep=2)),
           "the experts of 'experts' have no parameters: nothing to split", "Fix: use ep=1")


@case("E-ep-list-mask")
def _():
    experts = list_moe().experts
    experts.__class__ = expert_parallel_class(type(experts), listed=True)
    mask = torch.zeros(3, 1, 4, dtype=torch.long)
    mask[1, 0, 1:3] = 1   # token 1's pair routed to experts 1 and 2 at once
    expect(ValueError, lambda: experts(torch.randn(3, 8), mask, torch.ones(3, 1)),
           r"the routing mask of shape \[3, 1, 4\] has a pair \(token, k\) with 2 experts",
           "routes each pair to at most one expert", "Fix: route each pair to one expert")


def load_balancing_loss_func(probabilities):
    """Not the Switch loss: one per-expert mean, squared."""
    return (probabilities.sum(dim=0) / probabilities.shape[0]).square().sum()


class OneStatistic(nn.Module):
    def __init__(self):
        super().__init__()
        self.router = nn.Linear(8, 4)

    def forward(self, x):
        probabilities = self.router(x).softmax(dim=-1)
        return probabilities + load_balancing_loss_func(probabilities)


@case("E-router-statistics-form")
def _():
    # torch.export records where each node was called from (symbolic_trace does not)
    expect(RouterStatisticsError, lambda: lower_rank(OneStatistic(), gp.Strategy(dp=2), (torch.randn(6, 8),), rank=0,
                                                     world_size=2, tracer="export"),
           r"the load-balancing loss \(load_balancing_loss_func, output_router_logits=True\) of OneStatistic at dp=2",
           "has 1 divisions of a per-expert sum", "Fix: use dp=1")


def _lower_mixtral_aux(strategy, loss_fn):
    x, y = moe_batch(batch=4)
    return lower_rank(moe_model("mixtral_aux"), strategy, (x,), rank=0, world_size=strategy.world_size,
                      loss_fn=loss_fn, example_target=y)


@case("E-router-statistics-microbatches")
def _():
    expect(RouterStatisticsError, lambda: _lower_mixtral_aux(gp.Strategy(dp=2, microbatches=2), aux_lm_loss),
           r"of MixtralForCausalLM with microbatches=2", "would be of its rows only", "Fix: use microbatches=1")


def _token_weighted_aux_loss(output, target):
    count = (target >= 0).sum()
    return aux_lm_loss(output, target) * count, count


@case("E-router-statistics-token-weighted")
def _():
    expect(RouterStatisticsError, lambda: _lower_mixtral_aux(gp.Strategy(dp=2), _token_weighted_aux_loss),
           r"in a token-weighted loss \(\(loss_sum, count\)\)", "Fix: return the mean loss from loss_fn")


test_entry = entry_test(CASES)

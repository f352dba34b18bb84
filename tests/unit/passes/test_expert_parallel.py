"""passes/expert_parallel.py on one process: lower_rank compiles any rank of an ep world
without a process group, so what each rank's program holds and calls is checked here (the
runs themselves, against single-device training: tests/multiprocess/runtime/test_experts.py)."""
import pytest
import torch
import torch.nn.functional as F

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from graphpar.passes.build_update import zero3_runs
from graphpar.ir import record
from graphpar.runtime.experts import ExpertParallel, ExpertParallelList
from graphpar.distributed.mesh import experts_stage
from graphpar.runtime.zero3 import expert_runs
from tests.targets import ep_targets


def lowered(model, strategy, rank, x, y, loss_fn):
    return lower_rank(model, strategy, (x,), rank=rank, world_size=strategy.world_size, loss_fn=loss_fn,
                      example_target=y).compiled


@pytest.mark.parametrize("dp, ep", [(2, 2), (4, 2), (4, 4)])
def test_each_rank_holds_its_block_of_experts(dp, ep):
    model = ep_targets.tiny_moe()
    x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))
    for rank in range(dp):
        compiled = lowered(model, gp.Strategy(dp=dp, ep=ep), rank, x, y, F.cross_entropy)
        share, first = 4 // ep, rank % ep * (4 // ep)
        assert dict(compiled.expert_shards) == {"experts.gate_up_proj": 4, "experts.down_proj": 4}
        for name in ("gate_up_proj", "down_proj"):
            held = compiled.gm.get_parameter(f"experts.{name}")
            assert torch.equal(held, getattr(model.experts, name)[first:first + share])
        assert isinstance(compiled.gm.experts, ExpertParallel) and compiled.gm.experts.num_experts == share
        assert compiled.gm.experts.global_experts == 4
        # the experts' traced code is gone: one call of the rank's experts module remains
        calls = [n for n in compiled.gm.graph.nodes if n.op == "call_module"]
        assert [n.target for n in calls] == ["experts"]
        assert not any("einsum" in str(n.target) for n in compiled.gm.graph.nodes)


def test_ep_1_leaves_the_experts_whole():
    model = ep_targets.tiny_moe()
    compiled = lowered(model, gp.Strategy(dp=2), 1, torch.randn(6, 8), torch.randint(0, 5, (6,)), F.cross_entropy)
    assert dict(compiled.expert_shards) == {}
    assert compiled.gm.get_parameter("experts.gate_up_proj").shape == (4, 12, 8)


def test_transformers_mixtral_experts_are_found_and_its_router_is_not():
    pytest.importorskip("transformers", reason="transformers is in the test extra")
    model = ep_targets.moe_model("mixtral")
    x, y = ep_targets.moe_batch(batch=2)
    compiled = lowered(model, gp.Strategy(dp=2, ep=2), 0, x, y, ep_targets.logits_loss)
    layers = [f"model.layers.{i}.mlp.experts" for i in range(2)]
    assert dict(compiled.expert_shards) == {f"{p}.{w}": 4 for p in layers for w in ("gate_up_proj", "down_proj")}
    assert [n.target for n in compiled.gm.graph.nodes if n.op == "call_module"] == layers
    assert compiled.gm.get_parameter("model.layers.0.mlp.gate.weight").shape == (4, 32)
    assert compiled.gm.get_parameter("model.layers.0.mlp.experts.gate_up_proj").shape == (2, 96, 32)


def test_zero3_buckets_dense_weights_by_stage_and_expert_weights_apart():
    # zero=3 with ep: the dense weights in bucket_runs' runs (one stage's each, a weight tied
    # across pp ranks alone), then the expert weights (a bucket is reduced over dp or edp, never
    # both): at edp > 1 one run per experts module, which zero=3 shards over edp and gathers
    # around the module's call; at edp = 1 one run, left whole and sharded as zero=2 does
    names = ["head", "l1.experts.up", "l1.experts.down", "b.1", "l0.experts.up", "b.0", "emb"]
    readers = {"head": [1], "b.1": [1], "b.0": [0], "emb": [0, 1], "l1.experts.up": [1], "l1.experts.down": [1],
               "l0.experts.up": [0]}
    experts = {"l1.experts.up": 4, "l1.experts.down": 4, "l0.experts.up": 4}
    stage_rank = gp.Strategy(dp=2, pp=2).stage_rank   # stage s on pp rank s
    dense = [["head", "b.1"], ["b.0"], ["emb"]]
    assert zero3_runs(names, readers, stage_rank, experts, edp=2) == dense + [["l1.experts.up", "l1.experts.down"],
                                                                             ["l0.experts.up"]]
    assert zero3_runs(names, readers, stage_rank, experts, edp=1) == dense + [["l1.experts.up", "l1.experts.down",
                                                                               "l0.experts.up"]]
    assert zero3_runs(["l0.experts.up"], readers, stage_rank, experts, edp=2) == [["l0.experts.up"]]
    # a list's expert modules are one call's: one run per container, not one per module
    listed = ["l0.experts.0.w1.weight", "l0.experts.0.w2.weight", "l0.experts.1.w1.weight", "l1.experts.up"]
    assert expert_runs(listed, 2, ["l0.experts"]) == [listed[:3], listed[3:]]
    assert expert_runs(listed, 2) == [[name] for name in listed]   # (by each weight's module)
    assert [experts_stage(zero, 2) for zero in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert [experts_stage(zero, 1) for zero in (0, 1, 2, 3)] == [0, 1, 2, 2]


@pytest.mark.parametrize("dp, ep", [(2, 2), (4, 4)])
def test_each_rank_holds_its_expert_modules_of_a_list(dp, ep):
    # the list layout: the container's dense trace replaced by one call of the rank's copy,
    # which holds its E/ep expert modules whole, the user's own tensors' values under their names
    model = ep_targets.list_moe()
    x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))
    for rank in range(dp):
        compiled = lowered(model, gp.Strategy(dp=dp, ep=ep), rank, x, y, F.cross_entropy)
        mine = [str(e) for e in range(rank % ep * 4 // ep, (rank % ep + 1) * 4 // ep)]
        names = [f"experts.{e}.{w}.weight" for e in mine for w in ("w1", "w3", "w2")]
        assert sorted(compiled.expert_shards) == sorted(names)
        assert dict(compiled.expert_owners) == {f"experts.{e}.{w}.weight": e // (4 // ep)
                                                for e in range(4) for w in ("w1", "w3", "w2")}
        local = compiled.gm.experts
        assert isinstance(local, ExpertParallelList) and [k for k, _ in local.named_children()] == mine
        assert (local.num_experts, local.global_experts) == (4 // ep, 4)
        for name in names:
            assert torch.equal(compiled.gm.get_parameter(name), model.get_parameter(name))
        assert [n.target for n in compiled.gm.graph.nodes if n.op == "call_module"] == ["experts"]
        assert len(model.experts) == 4   # the user's container is untouched


def test_switch_transformers_expert_dicts_are_found():
    pytest.importorskip("transformers", reason="transformers is in the test extra")
    model = ep_targets.switch_model()
    x, y = ep_targets.moe_batch(batch=2)
    compiled = lowered(model, gp.Strategy(dp=2, ep=2), 1, x, y, ep_targets.sequence_loss)
    layers = [f"model.{stack}.block.{i}.layer.{at}.mlp.experts" for stack, at in (("encoder", 1), ("decoder", 2))
              for i in range(2)]
    # the call takes the one-hot [T, 1, E] routing mask
    calls = [n for n in compiled.gm.graph.nodes if n.op == "call_module"]
    assert sorted(n.target for n in calls) == sorted(layers)
    assert all(record(n.args[1]).value.shape == (16, 1, 4) for n in calls)
    assert sorted(compiled.expert_shards) == sorted(f"{p}.expert_{e}.{w}.weight" for p in layers for e in (2, 3)
                                                    for w in ("wi", "wo"))


def test_tensor_parallelism_leaves_a_list_of_experts_whole():
    # the experts' traced linears (a gated MLP each) would be a column- then row-parallel
    # region; split experts of the list layout stay whole on every tp rank instead
    model = ep_targets.list_moe()
    x, y = torch.randn(6, 8), torch.randint(0, 5, (6,))
    strategy = gp.Strategy(dp=2, tp=2, ep=2)
    for rank in range(strategy.world_size):
        compiled = lower_rank(model, strategy, (x,), rank=rank, world_size=4, loss_fn=F.cross_entropy,
                              example_target=y, tp_replicate=["head"]).compiled
        mine = [str(e) for e in range(rank % 2 * 2, rank % 2 * 2 + 2)]
        assert not any(name.startswith("experts.") for name in compiled.param_shards)
        for e in mine:
            for w in ("w1", "w3", "w2"):
                name = f"experts.{e}.{w}.weight"
                assert torch.equal(compiled.gm.get_parameter(name), model.get_parameter(name))


def test_a_capacity_counts_only_the_pairs_a_routing_mask_kept():
    # a one-hot mask's all-zero pair (the router dropped it: Switch's own capacity) is neither
    # sent nor counted against Strategy.expert_capacity_factor's capacity of its argmax expert
    local = ExpertParallelList()
    local.global_experts, local.dropped_pairs = 2, 0
    index, routed = torch.tensor([[0], [0], [0], [1]]), torch.tensor([False, True, True, True])
    local.capacity_factor = 1.0   # ceil(1.0 * 4 * 1 / 2) = 2 pairs per expert: all three kept
    assert local._kept(index, routed).tolist() == [False, True, True, True] and local.dropped_pairs == 0
    local.capacity_factor = 0.5   # 1 pair per expert: the second of expert 0's is dropped
    assert local._kept(index, routed).tolist() == [False, True, False, True] and local.dropped_pairs == 1


def test_a_stage_cut_keeps_a_list_of_experts_whole():
    # the ModuleList of experts is one unit, not one per expert: its dense trace (the region the
    # experts call replaces) lies in one stage, where gp.plan counts its expert modules too
    model, strategy = ep_targets.list_moe(), gp.Strategy(dp=2, pp=2, ep=2, microbatches=2)
    x, y = torch.randn(4, 8), torch.randint(0, 5, (4,))
    traced = lower_rank(model, strategy, (x,), rank=0, world_size=4, loss_fn=F.cross_entropy, example_target=y,
                        until="partition_stages").gm
    computing = [n for n in traced.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    stages = {record(n).stage for n in computing if record(n).module_path.startswith("experts")}
    assert stages == {0}
    planned = gp.plan(model, strategy, (x,), loss_fn=F.cross_entropy, example_target=y)
    expert = sum(p.nbytes for p in model.experts[0].parameters())
    assert [rank.expert_bytes for rank in planned.ranks] == [2 * expert] * 2 + [0] * 2
    for rank in range(4):   # the compile's call is on stage 0: pp rank 0's ranks hold E/ep experts
        compiled = lowered(model, strategy, rank, x, y, F.cross_entropy)
        held = {name for stage in compiled.stages.values() for name, _ in stage.gm.named_parameters()
                if name.startswith("experts.")}
        assert len(held) == (6 if rank < 2 else 0), rank   # two experts' w1, w3, w2

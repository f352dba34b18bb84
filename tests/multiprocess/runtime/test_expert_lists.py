"""Expert parallelism of the list layout (passes/tracing/expert_lists.py: experts as E modules
of a container) on gloo, against single-device eager training of the same model on the
global batch: a user's nn.ModuleList MoE (fx-traced) and transformers' SwitchTransformers
(its nn.ModuleDict of experts, export-traced)."""
import pytest
import torch

import graphpar as gp
from graphpar.distributed.launch import launch
from tests.helpers import adamw
from tests.multiprocess.runtime.test_experts import (DROPPING, STEPS, capped_reference, check_dense_split,
                                                    check_expert_split, check_parity, reference, sgd)
from tests.targets import ep_targets
from tests.targets.cases import SharedLaunches

pytest.importorskip("transformers", reason="transformers is in the test extra")

LISTED = [
    # a user's ModuleList, looped over as transformers 4.x Mixtral did (top-2)
    ("list_moe", dict(dp=2, ep=2), adamw), ("list_moe", dict(dp=2, ep=2), sgd),
    ("list_moe", dict(dp=4, ep=2), adamw),   # edp pairs: an expert's gradient from two replicas' tokens
    ("list_moe", dict(dp=4, ep=4), adamw),
    # experts 2 and 3 never get a token: eager gives them no gradient and AdamW leaves them be
    ("starved_list_moe", dict(dp=2, ep=2), adamw),
    # transformers' SwitchTransformers (encoder and decoder, top-1, a one-hot routing mask)
    ("switch", dict(dp=2, ep=2), adamw), ("switch", dict(dp=2, ep=2), sgd), ("switch", dict(dp=4, ep=4), adamw),
    # recomputation replays the blocks around the experts call, which runs once (as for the
    # fused layout); the embedding table on the host
    ("switch", dict(dp=2, ep=2, recompute="full"), adamw), ("switch", dict(dp=2, ep=2, recompute="selective"), adamw),
    ("switch", dict(dp=2, ep=2, offload_embedding=True), adamw),
    # a router capacity of 3 tokens per sequence and expert: the router drops pairs (zero mask rows)
    ("switch_capped", dict(dp=2, ep=2), adamw),
    # bf16 compute weights with fp32 masters: the expert modules cast with the rank's copy of
    # the container, the all-to-alls carrying bf16 rows
    ("list_moe", dict(dp=2, ep=2, param_dtype=torch.bfloat16), adamw),
    # ZeRO: the expert modules' optimizer state sharded over their edp pair; experts without a
    # gradient in a step have no usage flag on either rank of the pair and are not stepped;
    # zero=3: the dense weights sharded over dp; at edp 1 the experts whole on their ranks, at
    # edp 2 sharded over the pair and gathered around the call (the starved pair's experts
    # never run: its buckets are still reduced with the other's, with no usage flag)
    ("list_moe", dict(dp=4, ep=2, zero=1), adamw), ("list_moe", dict(dp=4, ep=2, zero=2), adamw),
    ("list_moe", dict(dp=2, ep=2, zero=3), adamw), ("starved_list_moe", dict(dp=4, ep=2, zero=2), adamw),
    ("list_moe", dict(dp=4, ep=2, zero=3), adamw), ("starved_list_moe", dict(dp=4, ep=2, zero=3), adamw),
    # pipeline stages: each stage's ranks hold E/ep experts of its own layers' containers (the
    # encoder's on stage 0, the decoder's on stage 1), full_state_dict sends them from there
    ("switch", dict(dp=2, pp=2, ep=2, microbatches=2), adamw),
    # tensor parallelism leaves the expert modules whole (their linears are not cut): each tp
    # rank dispatches its half of the tokens; with stages (Switch's attention split over tp;
    # SGD: AdamW's normalised step turns the tp sums' reordering into weight noise of up to
    # 5e-5, which four blocks carry into the logits past LOGITS_TOL), and the ep group over all
    # four ranks of dp2 x tp2 (the tiny MoE's 5 classes do not split over tp=2: its head whole)
    ("switch", dict(tp=2, pp=2, ep=2, microbatches=2), sgd),
    ("list_moe", dict(dp=2, tp=2, ep=4), adamw, dict(tp_replicate=["head"])),
    # the optimizer on the host: each rank's host holds its expert modules' masters and states
    # (reduced over their edp pair first); with ZeRO-1 and ZeRO-3 its share of them
    ("list_moe", dict(dp=4, ep=2, offload_optimizer=True), adamw),
    ("list_moe", dict(dp=4, ep=2, zero=1, offload_optimizer=True), adamw),
    ("list_moe", dict(dp=4, ep=2, zero=3, offload_optimizer=True), adamw),
]


# Strategy.expert_capacity_factor=DROPPING on the ModuleList MoE: each expert takes the first
# ceil(0.75 * T * 2 / 4) pairs of a replica's T tokens (2 of 8 at dp2: 3 of a replica's pairs
# dropped in every step), with tp after the drop (each tp rank sends its half of the kept pairs);
# on Switch whose router drops pairs too (switch_capped): 6 of a replica's 32 per expert, the
# router's drops taking no place (17 to 24 of a replica's pairs dropped per step)
CAPPED = [("list_moe", dict(dp=2, ep=2)), ("list_moe", dict(dp=2, tp=2, ep=2)), ("switch_capped", dict(dp=2, ep=2))]


def _options(index):
    """compile's options of LISTED[index] (its fourth entry, if any)."""
    return LISTED[index][3] if len(LISTED[index]) > 3 else {}


def _id(arch, strategy, optimizer, *_):
    return f"{arch}-" + "-".join(f"{k}{n}" for k, n in strategy.items()) + f"-{optimizer.__name__}"


def _head_whole(arch):
    """The tiny MoE's 5 classes do not split over tp=2: its head stays whole."""
    return dict(tp_replicate=["head"]) if arch == "list_moe" else {}


@pytest.fixture(scope="module")
def launched():
    return SharedLaunches({index: (gp.Strategy(**strategy).world_size, ep_targets.train_moe,
                                   (arch, gp.Strategy(**strategy).to_dict(), STEPS, optimizer()),
                                   dict(planned=True, options=_options(index)))
                           for index, (arch, strategy, optimizer, *_) in enumerate(LISTED)} |
                          {("capped", index): (gp.Strategy(**strategy).world_size, ep_targets.train_moe,
                                               (arch, {**strategy, "expert_capacity_factor": DROPPING}, STEPS,
                                                adamw()), dict(planned=True, options=_head_whole(arch)))
                           for index, (arch, strategy) in enumerate(CAPPED)})



def expert_of(key):
    """(the experts container's path, the expert's name) of an expert module's weight."""
    parts = key.split(".")
    at = parts.index("experts")
    return ".".join(parts[:at + 1]), parts[at + 1]


def check_split(results, state, ep, pp=1, param_dtype=None):
    """Each rank holds exactly E/ep experts, whole, of every container of its stages: those of
    its ep rank (rank r of an ep group: experts r * E/ep ..; the world's rank modulo ep, the
    pp ranks being outermost and dp x tp a multiple of ep), measured on its programs; the ranks
    of each pp rank hold the same containers, and together every one; gp.plan's expert_bytes
    for the rank equal the bytes it holds (in the compute dtype)."""
    size = torch.finfo(param_dtype or torch.float32).bits // 8
    experts = {}
    for key in state:
        if ep_targets.expert_weight(key):
            container, expert = expert_of(key)
            experts.setdefault(container, {})[expert] = None   # (in expert order)
    experts = {container: list(names) for container, names in experts.items()}
    stages = [set() for _ in range(pp)]
    for rank, run in enumerate(results):
        held, names = {}, {**run["held"], **run["expert_split"]["shapes"]}   # (zero=3 over edp: gathered)
        for key in names:
            container, expert = expert_of(key)
            held.setdefault(container, set()).add(expert)
        share = {container: experts[container][(rank % ep) * len(experts[container]) // ep:
                                               (rank % ep + 1) * len(experts[container]) // ep] for container in held}
        assert held and held == {container: set(names) for container, names in share.items()}, rank
        assert all(len(names) == len(experts[c]) // ep for c, names in share.items())
        stage = rank * pp // len(results)
        assert not stages[stage] or stages[stage] == set(held), rank
        stages[stage] = set(held)
        whole = sum(state[key].value.numel() * size for key in names)
        # (held in its programs, or gathered by its zero=3 buckets; gp.plan's expert_bytes)
        measured = run["expert_bytes"][0] + run["expert_split"]["gathered"] * size
        assert (measured, run["expert_bytes"][1]) == (whole, whole), rank
    assert set().union(*stages) == set(experts) and sum(map(len, stages)) == len(experts)


@pytest.mark.parametrize("index", range(len(LISTED)), ids=[_id(*case) for case in LISTED])
def test_expert_list_matches_single_device(launched, index):
    arch, degrees, optimizer, *_ = LISTED[index]
    strategy = gp.Strategy(**degrees)
    ref = reference(arch, strategy, optimizer())
    results = launched(index)
    check_parity(results, ref, strategy.dp, strategy.ep, strategy.tp, param_dtype=strategy.param_dtype, listed=True)
    check_split(results, ref[1], strategy.ep, strategy.pp, strategy.param_dtype)
    if strategy.zero == 3:   # no program holds a dense weight, nor at edp > 1 an expert weight: shards
        check_dense_split(results, strategy.dp)
        check_expert_split(results, strategy.dp * strategy.tp // strategy.ep)
    assert [run["programs"] for run in results] == [1] * strategy.world_size


@pytest.mark.parametrize("index", range(len(CAPPED)),
                         ids=[f"{arch}-" + "-".join(f"{k}{n}" for k, n in s.items()) for arch, s in CAPPED])
def test_a_capacity_drops_list_experts_pairs_as_single_device(launched, index):
    # against eager training whose experts take each expert's first pairs per replica's block
    # of tokens (ep_targets.CappedExperts, a plain count apart from graphpar's rule)
    arch, degrees = CAPPED[index]
    strategy = gp.Strategy(**degrees, expert_capacity_factor=DROPPING)
    ref, dropped = capped_reference(DROPPING, strategy.dp, strategy.microbatches, arch=arch)
    assert all(sum(step) > 0 for step in dropped), "every step drops pairs"
    results = launched(("capped", index))
    check_parity(results, ref, strategy.dp, strategy.ep, strategy.tp, listed=True)
    check_split(results, ref[1], strategy.ep)
    # each rank counts its replica's drops (every tp rank of a replica the same)
    assert [run["dropped"] for run in results] == [[step[rank // strategy.tp % strategy.dp] for step in dropped]
                                                   for rank in range(strategy.world_size)]


@pytest.mark.parametrize("index", [i for i, case in enumerate(LISTED) if case[1].get("offload_optimizer")],
                         ids=lambda i: _id(*LISTED[i]))
def test_the_host_of_each_rank_holds_its_expert_modules_state(launched, index):
    arch, degrees, *_ = LISTED[index]
    built = ep_targets.build(arch).state_dict()
    for rank, run in enumerate(launched(index)):
        host = run["host"]
        assert host["moved"]["to_host"] > 0 and host["moved"]["to_device"] > 0
        if degrees.get("zero"):   # (the state of a never-stepped expert is in no rank's share)
            assert 0 < host["held"] <= host["planned"], rank
            continue
        # each expert master on the host is one of the rank's E/ep expert modules, as on its device
        assert host["expert_masters"] == run["held"], rank
        # masters, states, compute copies and the step's gradients on the host, measured, are
        # the plan's but for the AdamW state of the rank's experts that no token reached in the
        # three steps (no gradient, never stepped, as in eager: they keep their built weights),
        # which the plan counts: two moments and a 0-d float32 step per weight
        unstepped = [key for key in run["held"] if torch.equal(run["state"][key], built[key])]
        assert host["held"] == host["planned"] - sum(2 * built[key].nbytes + 4 for key in unstepped) > 0, rank


def test_an_expert_without_tokens_gets_no_gradient_and_is_not_stepped(launched):
    # eager: experts 2 and 3 get no token, so no gradient, and three AdamW steps (weight decay
    # included) leave them as built; graphpar matched that above (ep rank 1 received no row)
    x, y = ep_targets.tiny_batch(8)
    model = ep_targets.starved_list_moe()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    assert all(p.grad is None for e in (2, 3) for p in model.experts[e].parameters())
    assert all(p.grad is not None for e in (0, 1) for p in model.experts[e].parameters())
    built = ep_targets.starved_list_moe().state_dict()
    index = next(i for i, case in enumerate(LISTED) if case[0] == "starved_list_moe")
    for run in launched(index):
        for key, value in run["state"].items():
            if key.startswith(("experts.2.", "experts.3.")):
                assert torch.equal(value, built[key]), key
            elif key.startswith(("experts.0.", "experts.1.")):
                assert not torch.equal(value, built[key]), key


def test_the_capped_switch_router_drops_pairs():
    # switch_capped's parity above runs with dropped pairs: with 3 tokens per sequence and
    # expert, some expert gets more than 3 of a sequence's 8 tokens in the first step
    x, _ = ep_targets.moe_batch()
    model = ep_targets.switch_model(capacity=3)
    masks = []
    for module in model.modules():
        if type(module).__name__ == "SwitchTransformersExperts":
            module.register_forward_pre_hook(lambda m, args: masks.append(args[1]))
    with torch.no_grad():
        model(x)
    assert masks and any(int((mask.sum(dim=-1) == 0).sum()) > 0 for mask in masks)


@pytest.mark.parametrize("arch", ["list_moe", "switch"])
def test_load_full_state_dict_gives_each_rank_its_experts(arch):
    # a state unlike the built model's (every tensor moved by 0.5): each rank keeps its own
    # experts' weights whole, full_state_dict gives the loaded state back, and pm(x) is eager's
    model = ep_targets.BUILDERS[arch]()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    state = model.state_dict()
    results = launch(ep_targets.load_and_evaluate, world_size=2, args=(arch, dict(dp=2, ep=2), state))
    (x, _), _, logits_of = ep_targets.task(arch)
    with torch.no_grad():
        logits = logits_of(model.eval()(x))
    rows = x.shape[0] // 2
    for rank, (full, out, held) in enumerate(results):
        assert set(full) == set(state)
        for key, value in state.items():
            assert torch.equal(full[key], value), key
        assert held and all(torch.equal(value, state[key]) for key, value in held.items())
        assert all(expert_of(key)[1] in (("2", "3", "expert_2", "expert_3") if rank else ("0", "1", "expert_0",
                                                                                          "expert_1"))
                   for key in held)
        # the same weights, the rank's rows: only the order of sums differs (float32, ~1e-7)
        torch.testing.assert_close(out, logits[rank * rows:(rank + 1) * rows], atol=1e-5, rtol=0)

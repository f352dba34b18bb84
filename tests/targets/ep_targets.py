"""Per-rank functions for the expert-parallel tests (run in processes started by graphpar.launch)."""
import functools
import logging
import math
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphpar as gp
from graphpar.checkpoint.sharded import CheckpointError
from graphpar.planner.expert_plan import record_routing
from graphpar.runtime.placement.transfers import bytes_moved, reset_bytes_moved
from tests.helpers import adamw, held_parameters, hf_causal_lm_loss, peak_saved_bytes
from tests.targets.plan_targets import counted_transfers, held_bytes


class FusedExperts(torch.nn.Module):
    """transformers' fused experts interface (forward(hidden [T, H], top_k_index [T, K],
    top_k_weights [T, K]), weights [E, 2I, H] and [E, H, I]) computed densely: every expert on
    every token, the routing weights picking. No data-dependent shape, so symbolic_trace
    follows it: a small MoE layer for the pass's unit tests and error cases."""

    def __init__(self, experts=4, hidden=8, inner=6):
        super().__init__()
        self.num_experts = experts
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inner, hidden) / hidden ** 0.5)
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inner) / inner ** 0.5)

    def forward(self, hidden, top_k_index, top_k_weights):
        weights = hidden.new_zeros(hidden.shape[0], self.num_experts).scatter_add(1, top_k_index, top_k_weights)
        gate, up = torch.einsum("th,eoh->teo", hidden, self.gate_up_proj).chunk(2, dim=-1)
        out = torch.einsum("tei,ehi->teh", F.silu(gate) * up, self.down_proj)
        return (out * weights.unsqueeze(-1)).sum(dim=1)


class TinyMoE(torch.nn.Module):
    """A router (top-k of a softmax), FusedExperts and a classifier head over [T, H] rows."""

    def __init__(self, experts=4, k=2, hidden=8, classes=5):
        super().__init__()
        self.k = k
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.experts = FusedExperts(experts, hidden)
        self.head = torch.nn.Linear(hidden, classes)

    def forward(self, x):
        weights, index = self.router(x).softmax(dim=-1).topk(self.k, dim=-1)
        return self.head(x + self.experts(x, index, weights))


def tiny_moe(**kwargs):
    torch.manual_seed(0)
    return TinyMoE(**kwargs)


class ExpertMLP(torch.nn.Module):
    """One expert of the list layout: a gated MLP (transformers 4.x Mixtral's expert)."""

    def __init__(self, hidden=8, inner=6):
        super().__init__()
        self.w1 = torch.nn.Linear(hidden, inner, bias=False)
        self.w3 = torch.nn.Linear(hidden, inner, bias=False)
        self.w2 = torch.nn.Linear(inner, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ExpertList(torch.nn.ModuleList):
    """A user's experts as an nn.ModuleList, looped over as transformers 4.x Mixtral did: for
    each expert that got tokens, torch.where on its mask, then index_add_ of its weighted
    output. An expert without tokens is not called (its parameters get no gradient)."""

    def __init__(self, experts=4, hidden=8, inner=6):
        super().__init__(ExpertMLP(hidden, inner) for _ in range(experts))
        self.num_experts = experts

    def forward(self, hidden, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden)
        mask = F.one_hot(top_k_index, self.num_experts).permute(2, 1, 0)   # [E, K, T]
        for expert in (mask.sum(dim=(1, 2)) > 0).nonzero().squeeze(1).tolist():
            k, tokens = torch.where(mask[expert])
            out.index_add_(0, tokens, self[expert](hidden[tokens]) * top_k_weights[tokens, k, None])
        return out


class ListMoE(TinyMoE):
    """TinyMoE with its experts in the list layout (ExpertList)."""

    def __init__(self, experts=4, k=2, hidden=8, classes=5):
        super().__init__(experts, k, hidden, classes)
        self.experts = ExpertList(experts, hidden)


def list_moe(**kwargs):
    torch.manual_seed(0)
    return ListMoE(**kwargs)


def starved_list_moe():
    """ListMoE with top-1 routing that never picks experts 2 and 3 (ep rank 1's at ep=2; the
    router's rows u, -u, 0, 0, as starved_mixtral's): eager gives their parameters no gradient,
    so AdamW leaves them as they are (no weight decay either)."""
    model = list_moe(k=1)
    with torch.no_grad():
        model.router.weight[1] = -model.router.weight[0]
        model.router.weight[2:] = 0
    return model


class SwitchLM(torch.nn.Module):
    """transformers' SwitchTransformersForConditionalGeneration on one input: the tokens are
    the encoder's input and the decoder's (an all-ones attention mask, which the encoder
    needs under torch.export); returns the logits."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(input_ids=x, attention_mask=torch.ones_like(x), decoder_input_ids=x).logits


def switch_model(experts=4, capacity=64):
    """A small random-init SwitchTransformers: 2 encoder and 2 decoder blocks, every block's
    MLP sparse (its experts an nn.ModuleDict, SwitchTransformersExperts), top-1 routing; no
    dropout or router jitter (random streams of their own), an expert capacity of `capacity`
    tokens per sequence (64: none of the 8 tokens of a sequence is dropped)."""
    import transformers
    torch.manual_seed(0)
    config = transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
        num_experts=experts, expert_capacity=capacity, encoder_sparse_step=1, decoder_sparse_step=1,
        dropout_rate=0.0, router_jitter_noise=0.0, decoder_start_token_id=0, pad_token_id=0, use_cache=False)
    return SwitchLM(transformers.SwitchTransformersForConditionalGeneration(config))

AUX_COEF = 0.5

# transformers mixture-of-experts architecture -> (model class, config class, config): 2
# layers, hidden 32, 4 experts of which each token takes 2, vocab 64; every MoE layer in the
# fused experts layout of transformers 5 (one [E, 2I, H] and one [E, H, I] weight)
MOE_ARCHITECTURES = {
    "mixtral": ("MixtralForCausalLM", "MixtralConfig",
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                  dict(intermediate_size=48, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                       num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, norm_topk_prob=False)),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(intermediate_size=48, num_experts=4, num_experts_per_tok=2)),
    # Mixtral returning its load-balancing loss (aux_loss), trained with it (aux_lm_loss); a
    # coefficient that makes it matter: a rank's own batch moves the loss by ~4e-4 at dp = 2
    "mixtral_aux": ("MixtralForCausalLM", "MixtralConfig",
                    dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
                         output_router_logits=True, router_aux_loss_coef=AUX_COEF)),
}
_DECODER = dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=32, vocab_size=64, use_cache=False, pad_token_id=0)


def moe_model(arch="mixtral", **overrides):
    """A small random-init `transformers` MoE model of MOE_ARCHITECTURES[arch]."""
    import transformers
    model_class, config_class, config = MOE_ARCHITECTURES[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**_DECODER, **config, **overrides})
    return getattr(transformers, model_class)(config)


def starved_mixtral():
    """Mixtral with top-1 routing that never picks experts 2 and 3 (ep rank 1's at ep=2): the
    router's rows are u, -u, 0, 0, so one of the first two logits, +-u.h, is >= the others' 0
    for every token. With one expert per token the routing weight is p / p = 1, the router
    gets no gradient, and (AdamW's decay scaling u and -u alike) the routing stays so."""
    model = moe_model("mixtral", num_experts_per_tok=1)
    with torch.no_grad():
        for layer in model.model.layers:
            weight = layer.mlp.gate.weight
            weight[1] = -weight[0]
            weight[2:] = 0
    return model


class CappedExperts:
    """Put in front of an experts class called with (hidden, top_k_index, top_k_weights)
    (transformers' fused experts, ExpertList; or Switch's one-hot mask for the indices): the eager single-device reference of
    Strategy(expert_capacity_factor=factor), written here apart from graphpar's: the tokens
    are cut into `blocks` equal blocks (the replicas' microbatches), in each an expert takes
    its first ceil(factor * T * K / E) pairs (t, k) of the block's T tokens in token order (a
    plain count), and a dropped pair's routing weight becomes 0 (its output adds nothing; no
    gradient reaches the router or the expert through it). `dropped` gets each call's drops
    per block."""

    factor: float
    blocks: int
    dropped: list

    def forward(self, hidden, top_k_index, top_k_weights):
        # a one-hot routing mask [T, K, E] (Switch): a pair of zeros (the router dropped it)
        # neither is kept nor takes a place
        masked = top_k_index.dim() == 3
        index = top_k_index.argmax(dim=-1) if masked else top_k_index
        routed = top_k_index.sum(dim=-1) > 0 if masked else torch.ones_like(index, dtype=torch.bool)
        keeps = [self._first_come(block, mine) for block, mine in
                 zip(index.chunk(self.blocks), routed.chunk(self.blocks))]
        self.dropped.append([int((mine & ~keep).sum()) for keep, mine in zip(keeps, routed.chunk(self.blocks))])
        return super().forward(hidden, top_k_index, top_k_weights * torch.cat(keeps))

    def _first_come(self, block, routed):
        capacity = math.ceil(self.factor * block.numel() / self.num_experts)
        taken = [0] * self.num_experts
        keep = []
        for expert, mine in zip(block.reshape(-1).tolist(), routed.reshape(-1).tolist()):
            keep.append(mine and taken[expert] < capacity)
            taken[expert] += mine
        return torch.tensor(keep).view_as(block)


def capped(arch, factor, blocks):
    """build(arch) whose experts drop pairs past capacity in each of `blocks` equal blocks of
    tokens (CappedExperts); every layer's experts log into one list, model.capped_dropped."""
    model = build(arch)
    model.capped_dropped = []
    for path, experts in list(model.named_modules()):
        if path.rpartition(".")[2] == "experts":
            experts.__class__ = type(f"Capped{type(experts).__name__}", (CappedExperts, type(experts)), {})
            experts.factor, experts.blocks, experts.dropped = factor, blocks, model.capped_dropped
    return model


BUILDERS = {"starved_mixtral": starved_mixtral, "tiny_moe": tiny_moe, "list_moe": list_moe,
            "starved_list_moe": starved_list_moe, "switch": switch_model,
            "switch_capped": lambda: switch_model(capacity=3)}
LISTED = ("list_moe", "starved_list_moe", "switch", "switch_capped")   # the list layout


def build(arch):
    """A fresh model of `arch`: a builder of BUILDERS, or moe_model's transformers model."""
    return BUILDERS[arch]() if arch in BUILDERS else moe_model(arch)


def expert_weight(name):
    """Whether a state key is an experts module's weight (its module, or the container of its
    expert modules, is named `experts`)."""
    return "experts" in name.split(".")[:-1]


def sequence_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def task(arch, batch=8):
    """(the global batch (x, y), the loss, the logits of an output) of `arch`'s training:
    TinyMoE (symbolic_trace) classifies rows, the rest are transformers causal LMs."""
    if arch in ("tiny_moe", "list_moe", "starved_list_moe"):
        return tiny_batch(batch), F.cross_entropy, lambda output: output
    if arch.startswith("switch"):
        return moe_batch(batch), sequence_loss, lambda output: output
    if arch == "mixtral_aux":
        return moe_batch(batch), aux_lm_loss, lambda output: output.logits
    return moe_batch(batch), hf_causal_lm_loss, lambda output: output.logits


def moe_batch(batch=8, seq=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=g), torch.randint(0, 64, (batch, seq), generator=g)


def aux_lm_loss(output, target):
    """The causal LM loss plus the router's load-balancing loss, as MixtralForCausalLM adds them."""
    return hf_causal_lm_loss(output, target) + AUX_COEF * output.aux_loss


def logits_loss(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def train_moe(arch, strategy, steps, optimizer, overrides=None, batch=8, options=None, planned=False):
    """Train `arch` under `strategy` (and compile's `options`) on this rank's rows of moe_batch:
    the losses, the global gradient norms (pm.last_grad_norm), the full state, this rank's
    evaluation logits, the shapes of the expert weights it holds and the number of programs it
    compiled; with `planned`, the bytes of the expert weights it holds and gp.plan's
    expert_bytes for it."""
    strategy = gp.Strategy.coerce(strategy)
    (x, y), loss_fn, logits_of = task(arch, batch)
    local = batch // strategy.dp
    rank = dist.get_rank() // strategy.tp % strategy.dp
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    model = build(arch) if not overrides else moe_model(arch, **overrides)
    # the model's dense elements are the rank's only without tp and pp
    dense = (sum(p.numel() for name, p in model.named_parameters() if p.requires_grad and not expert_weight(name))
             if strategy.tp == strategy.pp == 1 else None)
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=optimizer, **(options or {}))
    losses, norms, dropped = [], [], []
    for _ in range(steps):
        reset_bytes_moved()   # the last step's transfers to and from the host stay counted
        losses.append(pm.train_step(xs, target=ys))
        norms.append(pm.last_grad_norm)
        dropped.append(pm.last_dropped_pairs)
    host = host_held(pm, bytes_moved()) if strategy.offload_optimizer else None
    programs = len(pm._programs.keys())
    held = {name: tuple(p.shape) for gm in pm.graph_modules for name, p in gm.named_parameters()
            if expert_weight(name)}
    logits = logits_of(pm(xs))
    expert_bytes = None
    if planned:
        held_bytes = sum(p.nbytes for gm in pm.graph_modules for name, p in gm.named_parameters()
                         if expert_weight(name))
        expert_bytes = (held_bytes, pm.report().ranks[dist.get_rank()].expert_bytes)
    return dict(losses=losses, expert_bytes=expert_bytes, norms=norms, dropped=dropped, state=pm.full_state_dict(), logits=logits, held=held,
                programs=programs, expert_state=expert_optimizer_elements(pm), host=host,
                dense_split=dense_split(pm, dense), expert_split=expert_split(pm), tables=host_tables(pm))


def _zero3_buckets(pm, axis):
    """zero=3's buckets of the rank sharded over `axis` (dp: dense weights; edp: expert weights)."""
    return [b for b in getattr(pm._placed.program, "unsharded", []) if b.axis == axis]


def host_tables(pm):
    """Where each embedding table the rank holds on the host lives (offload_embedding), and
    whether one of its programs holds an embedding weight on the device."""
    return dict(host={name: str(table.table.device) for name, table in pm._compiled.host_tables.items()},
                device=any("embed_tokens" in name for gm in pm.graph_modules for name, _ in gm.named_parameters()))


def dense_split(pm, dense):
    """The model's trained dense (not expert) elements (None: not known here), those the rank's
    programs hold whole, and zero=3's: the elements of the rank's shards of its buckets and the
    number of buckets."""
    shards = _zero3_buckets(pm, "dp")
    whole = sum(p.numel() for gm in pm.graph_modules for name, p in gm.named_parameters()
                if p.requires_grad and not expert_weight(name))
    return dict(dense=dense, whole=whole, shard=sum(b.shard.numel() for b in shards), buckets=len(shards))


def expert_split(pm):
    """zero=3's expert weights sharded over edp: the expert elements the rank's programs hold
    whole, the elements of its shards of its expert buckets, the elements of the experts those
    buckets gather (the rank's E/ep experts), their shapes when gathered, the number of buckets."""
    shards = _zero3_buckets(pm, "edp")
    whole = sum(p.numel() for gm in pm.graph_modules for name, p in gm.named_parameters() if expert_weight(name))
    return dict(whole=whole, shard=sum(b.shard.numel() for b in shards), buckets=len(shards),
                gathered=sum(b.layout.total for b in shards),
                shapes={name: shape for b in shards for name, shape in zip(b.names, b.shapes)})


def host_held(pm, moved):
    """With offload_optimizer, what this rank keeps on the host (measured on its update
    program: fp32 masters, or ZeRO's master shards, optimizer states, compute copies of the
    masters, and the gradients moved there in one step), gp.plan's host bytes for the rank,
    and the shapes of the expert weights' masters."""
    placed = pm._placed
    masters = sum(b.flat.nbytes for b in placed.buckets) + \
        sum(step.flat.nbytes for step in placed.shard_steps if step.flat is not None)
    copies = sum(b.compute.nbytes for b in placed.buckets if b.compute is not b.flat)
    states = sum(t.nbytes for state in pm.optimizer.state.values() for t in state.values())  # 0-d steps too
    expert_masters = {name: tuple(p.shape) for bucket in placed.buckets
                      for name, p in bucket.named_masters().items() if expert_weight(name)}
    return dict(held=masters + copies + states + moved.get("to_host", 0), moved=moved,
                planned=pm.report().ranks[dist.get_rank()].host_bytes, expert_masters=expert_masters)


def expert_optimizer_elements(pm):
    """The elements of the optimizer state (per-element tensors: Adam's moments, SGD's
    momentum) this rank keeps for expert weights, those weights' elements on the rank (its
    E/ep experts, whole or gathered), ZeRO's expert buckets and the rank's edp group."""
    state = pm.optimizer.state
    if pm._placed.shard_steps:   # ZeRO: the optimizer steps this rank's pieces of each bucket
        held = [(step.names[piece.index], shard) for step in pm._placed.shard_steps
                for piece, shard in zip(step.pieces, step.shards)]
    else:
        named = {id(p): name for gm in pm.graph_modules for name, p in gm.named_parameters()}
        held = [(named.get(id(p), ""), p) for group in pm.optimizer.param_groups for p in group["params"]]
    kept = sum(v.numel() for name, p in held if expert_weight(name) for v in state.get(p, {}).values()
               if torch.is_tensor(v) and v.dim() > 0)
    # at zero=3 with edp > 1 the programs hold none of them: the experts the rank's buckets gather
    weights = (sum(p.numel() for gm in pm.graph_modules for name, p in gm.named_parameters() if expert_weight(name))
               + sum(b.layout.total for b in _zero3_buckets(pm, "edp")))
    buckets = sum(1 for step in pm._placed.shard_steps if step.axis == "edp")
    return dict(kept=kept, weights=weights, buckets=buckets, group=pm.mesh.ranks_along("edp"))


def measure_moe(cases, batch=8):
    """Per (arch, strategy dict): every transfer of one training step of `arch` after a warm-up
    step (counted on torch.distributed), the bytes the rank holds after it and the routing that
    step's weights give the global batch on one device (the weights gathered with
    full_state_dict, outside the count)."""
    results = []
    for arch, strategy_dict in cases:
        strategy = gp.Strategy.from_dict(strategy_dict)
        (x, y), loss_fn, _ = task(arch, batch)
        local = batch // strategy.dp
        rank = dist.get_rank() // strategy.tp % strategy.dp
        xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        pm = gp.compile(build(arch), strategy, example_inputs=(xs,), example_target=ys,
                        loss_fn=loss_fn, optimizer=adamw())
        pm.train_step(xs, target=ys)
        reference = build(arch)
        reference.load_state_dict(pm.full_state_dict())
        with counted_transfers() as counts:
            pm.train_step(xs, target=ys)
        results.append(dict(counts=counts, routing=record_routing(reference, x, strategy=strategy), **held_bytes(pm)))
    return results


def round_trip_moe(strategy, steps, path):
    """Train Mixtral under `strategy`, save its full_state_dict (rank 0, torch.save: sharded
    checkpoints refuse expert blocks), load the file into a freshly compiled one (whose weights
    are the untrained ones): both modules' full states and logits, the loaded one's first loss,
    the trained one's next loss, and the expert weight elements the rank's programs hold."""
    strategy = gp.Strategy.coerce(strategy)
    (x, y), loss_fn, logits_of = task("mixtral")
    local = x.shape[0] // strategy.dp
    rank = dist.get_rank() // strategy.tp % strategy.dp
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]

    def compiled():
        return gp.compile(moe_model("mixtral"), strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                          optimizer=adamw())
    trained = compiled()
    for _ in range(steps):
        trained.train_step(xs, target=ys)
    state = trained.full_state_dict()
    if dist.get_rank() == 0:
        torch.save(state, path)
    dist.barrier()
    loaded = compiled()
    untrained = loaded.full_state_dict()
    loaded.load_full_state_dict(torch.load(path))
    out = dict(saved=state, untrained=untrained, loaded=loaded.full_state_dict(),
               logits=(logits_of(trained(xs)), logits_of(loaded(xs))), split=expert_split(loaded))
    # the next step from equal weights (the loaded one's AdamW starts afresh: only its loss compares)
    out["losses"] = (trained.train_step(xs, target=ys), loaded.train_step(xs, target=ys))
    return out


def reshaped_moe(strategy, cut):
    """Train Mixtral one step under `strategy`, then run it on inputs of another shape (the
    first `cut` tokens of each row: traced and compiled again, sharing the first program's
    tensors): the full state after the step, the logits of the rank's rows cut, the loss of a
    training step on them and the number of programs compiled."""
    strategy = gp.Strategy.coerce(strategy)
    (x, y), loss_fn, logits_of = task("mixtral")
    local = x.shape[0] // strategy.dp
    rank = dist.get_rank() // strategy.tp % strategy.dp
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    pm = gp.compile(moe_model("mixtral"), strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=adamw())
    pm.train_step(xs, target=ys)
    state = pm.full_state_dict()
    logits = logits_of(pm(xs[:, :cut]))
    return dict(state=state, logits=logits, loss=pm.train_step(xs[:, :cut], target=ys[:, :cut]),
                programs=len(pm._programs.keys()))


class _Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, log_record):
        self.messages.append(log_record.getMessage())


def measure_recompute(cases, batch=8):
    """Per strategy dict (Mixtral): the most bytes autograd held saved at once in a training
    step after a warm-up step (parameters left out), gp.plan's activation_peak_bytes for this
    rank, the plan's note on recomputation and the one compile logged (None without)."""
    results = []
    logger = logging.getLogger("graphpar")
    for strategy_dict in cases:
        strategy = gp.Strategy.from_dict(strategy_dict)
        (x, y), loss_fn, _ = task("mixtral", batch)
        local = batch // strategy.dp
        rank = dist.get_rank() // strategy.tp % strategy.dp
        xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        logged, level = _Logged(), logger.level
        logger.addHandler(logged)
        logger.setLevel(logging.INFO)
        try:
            pm = gp.compile(moe_model(), strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                            optimizer=adamw())
        finally:
            logger.removeHandler(logged)
            logger.setLevel(level)
        pm.train_step(xs, target=ys)
        peak = peak_saved_bytes(functools.partial(pm.train_step, xs, target=ys), held_parameters(pm))
        report = gp.plan(moe_model(), strategy, example_inputs=(xs,), loss_fn=loss_fn, example_target=ys,
                         world_size=strategy.world_size, optimizer=adamw())
        notes = [n for n in report.notes if n.startswith("recompute=")]
        compiled = [m for m in logged.messages if m.startswith("recompute=")]
        results.append(dict(peak=peak, planned=report.ranks[dist.get_rank()].activation_peak_bytes,
                            note=notes[0] if notes else None, compiled=compiled[0] if compiled else None))
    return results


def train_tiny_moe(strategy, steps, optimizer, checkpoint_dir, batch=12):
    """TinyMoE (symbolic_trace) under `strategy` on this rank's rows of a fixed batch; then
    the message of save_checkpoint's refusal (None: it saved)."""
    strategy = gp.Strategy.coerce(strategy)
    x, y = tiny_batch(batch)
    local = batch // strategy.dp
    rank = dist.get_rank() % strategy.dp
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    pm = gp.compile(tiny_moe(), strategy, example_inputs=(xs,), example_target=ys, loss_fn=F.cross_entropy,
                    optimizer=optimizer)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    try:
        pm.save_checkpoint(os.path.join(checkpoint_dir, "ckpt"))
        refused = None
    except CheckpointError as error:
        refused = str(error)
    return dict(losses=losses, state=pm.full_state_dict(), logits=pm(xs), front_end=pm.front_end,
                checkpoint_refused=refused)


def tiny_batch(batch=12, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 8, generator=g), torch.randint(0, 5, (batch,), generator=g)


def load_and_evaluate(arch, strategy, state, batch=8):
    """Compile `arch` under `strategy`, load the full `state` into it (load_full_state_dict:
    each rank keeps its experts), then (full_state_dict, this rank's evaluation output, the
    expert weights the rank holds)."""
    strategy = gp.Strategy.coerce(strategy)
    (x, y), loss_fn, logits_of = task(arch, batch)
    local = batch // strategy.dp
    rank = dist.get_rank() // strategy.tp % strategy.dp
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    pm = gp.compile(BUILDERS[arch](), strategy, example_inputs=(xs,), example_target=ys, loss_fn=loss_fn,
                    optimizer=torch.optim.SGD)
    pm.load_full_state_dict(state)
    held = {name: p.detach().clone() for gm in pm.graph_modules for name, p in gm.named_parameters()
            if expert_weight(name)}
    return pm.full_state_dict(), logits_of(pm(xs)), held

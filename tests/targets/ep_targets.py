"""Per-rank functions for the expert-parallel tests (run in processes started by graphpar.launch)."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

import graphpar as gp
from tests.helpers import hf_causal_lm_loss

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


BUILDERS = {"starved_mixtral": starved_mixtral}


def moe_batch(batch=8, seq=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 64, (batch, seq), generator=g), torch.randint(0, 64, (batch, seq), generator=g)


def logits_loss(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def train_moe(arch, strategy, steps, optimizer, overrides=None, batch=8):
    """Train `arch` under `strategy` on this rank's rows of moe_batch: the losses, the full
    state, this rank's evaluation logits, the shapes of the expert weights it holds and the
    number of programs it compiled."""
    strategy = gp.Strategy.coerce(strategy)
    x, y = moe_batch(batch)
    local = batch // strategy.dp
    rank = dist.get_rank() // strategy.tp % strategy.dp
    xs, ys = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
    model = BUILDERS[arch]() if arch in BUILDERS else moe_model(arch, **(overrides or {}))
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys, loss_fn=hf_causal_lm_loss,
                    optimizer=optimizer)
    losses = [pm.train_step(xs, target=ys) for _ in range(steps)]
    programs = len(pm._programs.keys())
    held = {name: tuple(p.shape) for gm in pm.graph_modules for name, p in gm.named_parameters() if ".experts." in name}
    logits = pm(xs).logits
    return dict(losses=losses, state=pm.full_state_dict(), logits=logits, held=held,
                programs=programs)

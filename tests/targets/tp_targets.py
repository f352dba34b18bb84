"""Per-rank functions for the tensor-parallel tests (run under graphpar.launch)."""
import torch
import torch.distributed as dist

import graphpar as gp
from tests import helpers


def build(name, tp=2):
    """Models nobody here wrote (transformers) and our own GPT in the layouts TP must find.
    Grouped-query models keep kv heads = tp < heads, so each rank holds one kv head."""
    builders = {
        "gpt": lambda: (helpers.tiny_gpt(), helpers.lm_loss),
        "gpt_fused_qkv": lambda: (helpers.tiny_gpt(fused_qkv=True), helpers.lm_loss),
        "gpt_gqa_swiglu": lambda: (helpers.tiny_gpt(n_kv_head=tp, mlp="swiglu", n_head=8), helpers.lm_loss),
        "hf_gpt2": lambda: (helpers.hf_gpt2(), helpers.hf_causal_lm_loss),
        "hf_llama": lambda: (helpers.hf_llama(n_head=8, n_kv_head=tp), helpers.hf_causal_lm_loss),
        "hf_bert": lambda: (helpers.hf_bert(), helpers.hf_causal_lm_loss),
        "hf_falcon": lambda: (helpers.hf_model("falcon", num_attention_heads=8, num_kv_heads=tp),
                              helpers.hf_causal_lm_loss),
        "hf_falcon_old": lambda: (helpers.hf_model("falcon_old"), helpers.hf_causal_lm_loss),
        "hf_gptj": lambda: (helpers.hf_model("gptj"), helpers.hf_causal_lm_loss),
        "hf_bloom": lambda: (helpers.hf_model("bloom"), helpers.hf_causal_lm_loss),
        "hf_falcon_mq": lambda: (helpers.hf_model("falcon_mq"), helpers.hf_causal_lm_loss),
    }
    return builders[name]()


def train_tp(name, steps, dp=1, with_target=True):
    """Train with tp = world / dp; return losses, each rank's local gradients after step 1
    with the shard specs needed to compare them, the final full state and pm(x).
    `with_target=False` compiles without example_target, as API.md's example does."""
    world = dist.get_world_size()
    model, loss_fn = build(name, world // dp)
    x, y = helpers.token_batch(batch=4)
    strategy = gp.Strategy(dp=dp, tp=world // dp)
    xs, ys = helpers.dp_slice(x, strategy), helpers.dp_slice(y, strategy)
    pm = gp.compile(model, strategy, example_inputs=(xs,), example_target=ys if with_target else None,
                    loss_fn=loss_fn, optimizer=helpers.adamw())
    opt = pm.optimizer
    pm.optimizer = None  # first step: gradients only, to compare them before any update
    losses = [pm.train_step(xs, target=ys)]
    grads = {n: p.grad.clone() for n, p in pm.named_parameters()}
    pm.optimizer = opt
    opt.step()
    losses += [pm.train_step(xs, target=ys) for _ in range(steps - 1)]
    out = pm(xs)
    out = out.logits if hasattr(out, "logits") else out
    return {"losses": losses, "grads": grads, "shards": dict(pm._shards()), "tp_rank": pm.mesh.tp_rank,
            "dp_rank": pm.mesh.dp_rank, "tp": pm.mesh.tp, "state": helpers.loadable_state(pm, model), "out": out,
            "counts": _collective_counts(pm),
            "param_bytes": sum(p.numel() * p.element_size() for _, p in pm.named_parameters())}


def train_tp_with_and_without_target(name, steps, dp=1):
    """train_tp compiled with example_target, then without (one launch: start-up dominates)."""
    return [train_tp(name, steps, dp, with_target) for with_target in (True, False)]


def _collective_counts(pm):
    counts = {}
    for node in pm.graph_modules[0].graph.nodes:
        name = getattr(node.target, "__name__", "")
        if node.op == "call_function" and node.target.__module__ == "graphpar.runtime.collectives":
            counts[name] = counts.get(name, 0) + 1
    return counts


class DropoutMLP(torch.nn.Module):
    """Dropout inside a TP region (on the sharded hidden) and on a replicated value."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.up = torch.nn.Linear(16, 64)
        self.inner = torch.nn.Dropout(0.5)
        self.down = torch.nn.Linear(64, 16)
        self.outer = torch.nn.Dropout(0.5)

    def forward(self, x):
        return self.outer(self.down(self.inner(torch.nn.functional.gelu(self.up(x)))))


def dropout_losses(seed, masks, steps=3):
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(5))
    y = torch.randn(8, 16, generator=torch.Generator().manual_seed(6))
    world = dist.get_world_size() if dist.is_initialized() else 1
    pm = gp.compile(DropoutMLP(), gp.Strategy(tp=world, seed=seed), example_inputs=(x,), example_target=y,
                    loss_fn=torch.nn.functional.mse_loss, optimizer=helpers.adamw(), dropout_masks=masks)
    return [pm.train_step(x, target=y) for _ in range(steps)]


def smoothed_loss(output, target):
    return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten(), ignore_index=-100,
                                             label_smoothing=0.1)


def cross_entropy_options():
    """Parallel cross entropy with ignored targets and label smoothing over the full vocab."""
    model = helpers.tiny_gpt()
    x, y = helpers.token_batch(batch=4)
    y = y.clone()
    y[:, :5] = -100  # padding positions, ignored by the loss
    pm = gp.compile(model, gp.Strategy(tp=dist.get_world_size()), example_inputs=(x,), example_target=y,
                    loss_fn=smoothed_loss)
    loss = pm.train_step(x, target=y)
    roles = set(pm.compiled.tp_plan.roles.values())
    return loss, {n: p.grad.clone() for n, p in pm.named_parameters()}, dict(pm._shards()), pm.mesh.tp_rank, roles


def reference(name, tp, steps):
    """Single-device truth for the tp parity tests: losses, one step's gradients, the state
    after `steps` AdamW steps and the trained model's output, from tp's initial weights."""
    model, loss_fn = build(name, tp)
    x, y = helpers.token_batch(batch=4)
    model.zero_grad()
    loss_fn(model(x), y).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    trained, losses = helpers.train_reference(model, [(x, y)], loss_fn, helpers.adamw(), steps)
    out = trained.eval()(x)
    return losses, grads, trained.state_dict(), out.logits if hasattr(out, "logits") else out

"""Tiny models, batches and the single-device reference every parity test compares with."""
from __future__ import annotations

import copy
import functools
import itertools
import pathlib
import sys

import pytest
import torch
import torch.nn.functional as F

from graphpar.distributed.mesh import Mesh
from graphpar.models.gpt import GPT, GPTConfig, lm_loss

# The bytes a step saves for backward are measured by benchmarks/_memory.py, which
# bench_recompute.py uses too (a benchmark does not import tests/): one measurement for both.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
from _memory import LiveBytes, SavedBytes, peak_saved_bytes  # noqa: E402,F401  (benchmarks/ is not a package)


def tiny_gpt(**overrides) -> GPT:
    torch.manual_seed(0)
    config = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
    config.update(overrides)
    return GPT(GPTConfig(**config))


def token_batch(batch=8, seq=16, vocab=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def hf_causal_lm_loss(output, target):
    return F.cross_entropy(output.logits.flatten(0, 1), target.flatten())


def hf_gpt2(n_layer=2, **overrides):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    torch.manual_seed(0)
    config = dict(n_layer=n_layer, n_embd=32, n_head=4, vocab_size=64, n_positions=16,
                  use_cache=False, bos_token_id=0, eos_token_id=0,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config, **overrides}))


def hf_llama(n_layer=2, n_head=4, n_kv_head=2, **overrides):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    torch.manual_seed(0)
    config = dict(num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64,
                  num_attention_heads=n_head, num_key_value_heads=n_kv_head, vocab_size=64,
                  max_position_embeddings=16, use_cache=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config, **overrides}))


def hf_bert(n_layer=2):
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    torch.manual_seed(0)
    config = transformers.BertConfig(num_hidden_layers=n_layer, hidden_size=32, intermediate_size=64,
                                     num_attention_heads=4, vocab_size=64, max_position_embeddings=16,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                     pad_token_id=0)
    return transformers.BertForMaskedLM(config)


_DECODER = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16, pad_token_id=0)
_ENCODER = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
_NO_DROPOUT = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
# transformers architecture -> (model class, config class, config): 2 layers, hidden 32, 4
# heads, vocab 64, no dropout, so that tensor parallelism meets each family's own layout
HF_ARCHITECTURES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DECODER),
    "mistral": ("MistralForCausalLM", "MistralConfig", _DECODER),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _DECODER),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(_DECODER, head_dim=8)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(n_layer=2, n_embd=32, n_head=4, n_positions=16, **_NO_DROPOUT)),
    "gpt_neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig",
                 dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                      max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0)),
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(n_layer=2, n_embd=32, n_head=4, n_positions=16, rotary_dim=4,
                                                   bos_token_id=0, eos_token_id=0, **_NO_DROPOUT)),
    "phi": ("PhiForCausalLM", "PhiConfig",
            dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 max_position_embeddings=16, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "opt": ("OPTForCausalLM", "OPTConfig", dict(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=4,
                                                max_position_embeddings=16, word_embed_proj_dim=32, dropout=0.0,
                                                attention_dropout=0.0, pad_token_id=1)),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(n_layer=2, hidden_size=32, n_head=4, hidden_dropout=0.0,
                                                      attention_dropout=0.0)),
    # Falcon-40B/180B layout: one fused query_key_value, per kv group [its q heads, k, v]
    "falcon": ("FalconForCausalLM", "FalconConfig",
               dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_kv_heads=2,
                    new_decoder_architecture=True, hidden_dropout=0.0, attention_dropout=0.0)),
    # Falcon-RW layout (per head [q, k, v]) with rotary positions
    "falcon_old": ("FalconForCausalLM", "FalconConfig",
                   dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, new_decoder_architecture=False,
                        multi_query=False, hidden_dropout=0.0, attention_dropout=0.0)),
    # Falcon-7B layout: [q heads, one k head, one v head] fused, the k/v head shared by every q head
    "falcon_mq": ("FalconForCausalLM", "FalconConfig",
                  dict(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, new_decoder_architecture=False,
                       multi_query=True, hidden_dropout=0.0, attention_dropout=0.0)),
    "bert": ("BertForMaskedLM", "BertConfig", dict(_ENCODER, pad_token_id=0)),
    "roberta": ("RobertaForMaskedLM", "RobertaConfig", dict(_ENCODER, pad_token_id=1)),
    "electra": ("ElectraForMaskedLM", "ElectraConfig", dict(_ENCODER, embedding_size=32, pad_token_id=0)),
    "distilbert": ("DistilBertForMaskedLM", "DistilBertConfig",
                   dict(n_layers=2, dim=32, hidden_dim=64, n_heads=4, max_position_embeddings=16, dropout=0.0,
                        attention_dropout=0.0, pad_token_id=0)),
}


def hf_model(arch, **overrides):
    """A small random-init `transformers` model of HF_ARCHITECTURES[arch] (config overrides)."""
    transformers = pytest.importorskip("transformers", reason="transformers is in the test extra")
    model_class, config_class, config = HF_ARCHITECTURES[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{"vocab_size": 64, "use_cache": False, **config, **overrides})
    return getattr(transformers, model_class)(config)


def adamw(lr=1e-2):
    """The parity tests' optimizer. eps=1e-6 instead of 1e-8: Adam divides by sqrt(v) + eps,
    so an entry whose true gradient is ~0 (rounding noise, |g| ~ 1e-9, which any change of
    summation order alters) would move by up to lr per step with eps=1e-8; with 1e-6 it moves
    by at most lr * |g| / eps ~ 1e-5, while real gradients (|g| >> eps) still take lr steps,
    so a wrong gradient still shows as an O(lr) parameter difference."""
    return functools.partial(torch.optim.AdamW, lr=lr, eps=1e-6)


def dp_slice(t, strategy):
    """This rank's share of a global batch under `strategy` (in a launched process; without a
    process group, a world of one takes it all)."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    mesh = Mesh(strategy.dp, strategy.tp, strategy.pp, rank)
    local = t.shape[0] // strategy.dp
    return t[mesh.dp_rank * local:(mesh.dp_rank + 1) * local]


def loadable_state(pm, model):
    """pm.full_state_dict(), checked to load into (a copy of) the user's model with strict=True."""
    state = pm.full_state_dict()
    copy.deepcopy(model).load_state_dict(state, strict=True)
    return state


def held_parameters(pm):
    """The parameter tensors the rank's programs hold: their own parameters, and at zero=3 each
    bucket's shard (padding included; a parameter of no program, pm.parameters() being the
    pieces of it the optimizer steps)."""
    own = [p for gm in pm.graph_modules for p in gm.parameters()]
    return own + [bucket.shard for bucket in getattr(pm._placed.program, "unsharded", [])]


def low_precision_copy(model, dtype, grad_dtype=torch.float32):
    """A copy of `model` computing in `dtype`, as graphpar's Strategy(param_dtype=dtype) does,
    whose gradients accumulate in `grad_dtype` (its reduce_dtype: fp32 unless it is `dtype`),
    as autograd casts them into p.grad (Tensor.grad_dtype)."""
    compute = copy.deepcopy(model).to(dtype).train()
    if grad_dtype != dtype:
        for p in compute.parameters():
            p.grad_dtype = grad_dtype
    return compute


def train_reference(model, batches, loss_fn, optimizer, steps):
    """Eager single-device training: the ground truth every parity test compares with."""
    model, losses, _ = train_reference_clipped(model, batches, loss_fn, optimizer, steps, max_grad_norm=None)
    return model, losses


def train_reference_clipped(model, batches, loss_fn, optimizer, steps, max_grad_norm):
    """train_reference with torch.nn.utils.clip_grad_norm_(max_grad_norm) before each step
    (None: none): (model, losses, the total norms clip_grad_norm_ returned)."""
    model = copy.deepcopy(model).train()
    opt = optimizer(model.parameters())
    losses, norms = [], []
    for step in range(steps):
        x, y = batches[step % len(batches)]
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)))
        opt.step()
        losses.append(loss.item())
    return model, losses, norms


def assert_trains_as(run, ref_losses, ref_state, loss_rtol, param_atol):
    """A run's losses ({"losses": [...], "state": {...}}) and final state against the
    single-device reference's, within the caller's explained tolerances."""
    assert run["losses"] == pytest.approx(ref_losses, rel=loss_rtol, abs=0)
    for key, value in ref_state.items():
        torch.testing.assert_close(run["state"][key], value, atol=param_atol, rtol=0, msg=key)


def largest_difference(state, ref_state) -> float:
    """The largest elementwise difference between two state dicts."""
    return max(float((state[key] - value).abs().max()) for key, value in ref_state.items())


def best_splits(n, stages, stage_weight):
    """Brute force over every split of n units into `stages` non-empty contiguous runs:
    (the least heaviest-stage weight, every split reaching it as its list of start indices).
    `stage_weight(start, end)` weighs the run units[start:end]."""
    scored = []
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = [0, *cuts]
        scored.append((max(stage_weight(a, b) for a, b in zip(bounds, [*cuts, n])), bounds))
    best = min(s for s, _ in scored)
    return best, [b for s, b in scored if s == best]


def held_elements(reads, start, end):
    """Parameter elements a stage made of units[start:end] holds, given each unit's reads
    ({name: elements}): every parameter one of them reads, once (a tied weight read by two
    stages is held by both)."""
    return sum({name: size for unit in reads[start:end] for name, size in unit.items()}.values())


__all__ = ["tiny_gpt", "token_batch", "lm_loss", "hf_gpt2", "hf_llama", "hf_bert", "hf_model", "adamw",
           "train_reference", "train_reference_clipped", "hf_causal_lm_loss", "best_splits", "held_elements",
           "assert_trains_as", "largest_difference"]


class AlexNet(torch.nn.Module):
    """torchvision's AlexNet layout (features, avgpool, classifier), written out here."""

    def __init__(self, num_classes=10, width=1):
        super().__init__()
        c = [64 // width, 192 // width, 384 // width, 256 // width, 256 // width]
        nn = torch.nn
        self.features = nn.Sequential(
            nn.Conv2d(3, c[0], 11, 4, 2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(c[0], c[1], 5, padding=2), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2),
            nn.Conv2d(c[1], c[2], 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c[2], c[3], 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c[3], c[4], 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2))
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        hidden = 4096 // width
        self.classifier = nn.Sequential(
            nn.Dropout(0.0), nn.Linear(c[4] * 36, hidden), nn.ReLU(inplace=True),
            nn.Dropout(0.0), nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def alexnet(width=16):
    torch.manual_seed(0)
    return AlexNet(width=width)

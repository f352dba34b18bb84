"""A small decoder-only transformer (GPT-2 layout), written as a user would write it.

Nothing in it knows about graphpar: it is the single-device model that graphpar compiles.
Options cover the layouts the tensor-parallel rules must recognise: separate or fused QKV
projections, grouped-query attention (fewer kv heads), a GELU or a gated (SwiGLU) MLP, and
an LM head tied to the token embedding or not.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_kv_head: Optional[int] = None      # None: same as n_head
    n_embd: int = 64
    dropout: float = 0.0
    fused_qkv: bool = False
    mlp: str = "gelu"                    # "gelu" or "swiglu"
    tie_weights: bool = True

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = c.n_head, c.kv_heads, c.n_embd // c.n_head
        kv_dim = self.n_kv_head * self.head_dim
        if c.fused_qkv:
            self.qkv = nn.Linear(c.n_embd, c.n_embd + 2 * kv_dim)
        else:
            self.q = nn.Linear(c.n_embd, c.n_embd)
            self.k = nn.Linear(c.n_embd, kv_dim)
            self.v = nn.Linear(c.n_embd, kv_dim)
        self.proj = nn.Linear(c.n_embd, c.n_embd)
        self.fused = c.fused_qkv
        self.kv_dim = kv_dim
        self.dropout = c.dropout
        self.resid_drop = nn.Dropout(c.dropout)

    def forward(self, x):
        b, t, d = x.size()
        if self.fused:
            q, k, v = self.qkv(x).split([d, self.kv_dim, self.kv_dim], dim=2)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q = q.view(b, t, self.n_head, self.head_dim).transpose(1, 2)
        k = k.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = v.view(b, t, self.n_kv_head, self.head_dim).transpose(1, 2)
        if self.n_kv_head != self.n_head:
            repeat = self.n_head // self.n_kv_head
            k = k.repeat_interleave(repeat, dim=1)
            v = v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(b, t, d)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        hidden = 4 * c.n_embd
        self.gated = c.mlp == "swiglu"
        self.fc = nn.Linear(c.n_embd, hidden)
        if self.gated:
            self.gate = nn.Linear(c.n_embd, hidden)
        self.proj = nn.Linear(hidden, c.n_embd)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        h = F.silu(self.gate(x)) * self.fc(x) if self.gated else F.gelu(self.fc(x))
        return self.drop(self.proj(h))


class Block(nn.Module):
    def __init__(self, c: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c.n_embd)
        self.attn = CausalSelfAttention(c)
        self.ln_2 = nn.LayerNorm(c.n_embd)
        self.mlp = MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx):
        positions = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(positions))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy: the loss_fn the examples pass to graphpar.compile."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def flops_per_token(config: GPTConfig) -> float:
    """Approximate training FLOPs per token (6N rule plus attention), for throughput reports."""
    n = 12 * config.n_layer * config.n_embd ** 2
    return 6 * n + 12 * config.n_layer * config.n_embd * config.block_size


__all__ = ["GPT", "GPTConfig", "lm_loss", "num_parameters", "flops_per_token"]

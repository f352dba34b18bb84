"""The small models and builders the catalogue cases of several areas share."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp
from graphpar.frontend.compile import lower_rank
from tests.targets import catalogue_targets as targets


def mlp() -> nn.Module:
    return targets.mlp()


def x4(batch=4):
    return torch.randn(batch, 4)


def mse_pm(batch=4, **strategy):
    return gp.compile(mlp(), gp.Strategy(**strategy), (x4(batch),), loss_fn=F.mse_loss,
                      example_target=torch.randn(batch, 2))


class Gate(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # Python control flow on a tensor value: untraceable
            return x
        return -x


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


class CumsumMLP(nn.Module):
    """A column and a row layer with an op between them that has no sharding rule."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.mix = Mix()
        self.down = nn.Linear(8, 4)

    def forward(self, x):
        return self.down(self.mix(self.up(x)))


class Mix(nn.Module):
    def forward(self, x):
        return torch.cumsum(x, dim=-1)


class FusedQKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(4, 12)
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        qkv = self.qkv(x)
        q, k, v = qkv.split(4, dim=-1)
        return self.proj(q * k + v), qkv


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, a, b):
        return self.fc(a) + self.fc(b).sum()


class ScalarOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x).sum()


class Bare(nn.Module):
    """Parameters but no submodule: nothing to split into pipeline units."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return (x @ self.w) @ self.w


class WithSize(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return h, h.size(0)


class SizeAcrossCut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = WithSize()
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        h, n = self.a(x)
        return self.b(h).reshape(n, -1)


def lower(model, strategy, world_size, example=None, **options):
    return lower_rank(model, strategy, (example if example is not None else x4(),), rank=0,
                      world_size=world_size, **options)


def identity_pass(gm, ctx):
    return gm


def compile_mse(model, loss_fn=F.mse_loss, **options):
    return gp.compile(model, gp.Strategy(), (x4(),), loss_fn=loss_fn, example_target=torch.randn(4, 2), **options)


SGD = functools.partial(torch.optim.SGD, lr=0.1)

"""Pipeline-parallel AlexNet, balanced by parameter count (DeepSpeed's pipeline tutorial).

What it shows
    DeepSpeed's pipeline-parallelism tutorial trains torchvision's AlexNet on CIFAR-10 with
    two stages and ``partition_method="parameters"``. Here the same network (torchvision's
    layout, written out below so nothing is downloaded or imported from torchvision) is an
    ordinary nn.Module, compiled with ``gp.Strategy(pp=2, microbatches=4,
    partition="parameters")`` and trained on 2 local processes with the 1F1B schedule.
    graphpar cuts the model into layers ("units"), balances their parameter counts over the
    stages and prints the plan. AlexNet's parameters sit mostly in its classifier (fc6 alone
    is two thirds of them), so the balanced cut puts the convolutions and fc6 on stage 0 and only
    fc7 and fc8 on stage 1, as DeepSpeed's partition_balanced does.

What it checks
    The last two Linear layers (fc7, fc8) are on stage 1 and everything before them on
    stage 0; the pipelined losses and final parameters match the same model trained eagerly
    on one device from the same weights on the same batches. Exits 1 otherwise.

How to run
    python examples/alexnet_pipeline.py              # full-width AlexNet, 224x224 images, 3 steps
    python examples/alexnet_pipeline.py --small      # 1/16 width, 63x63 images (CI)
"""
from __future__ import annotations

import argparse
import copy
import functools
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import graphpar as gp

BATCH, CLASSES = 8, 10


class AlexNet(nn.Module):
    """torchvision.models.AlexNet's layout (features, avgpool, classifier); `width` divides
    every channel count, so width=1 is the real network (57M parameters at 10 classes)."""

    def __init__(self, num_classes: int = CLASSES, width: int = 1, dropout: float = 0.0):
        super().__init__()
        c = [64 // width, 192 // width, 384 // width, 256 // width, 256 // width]
        self.features = nn.Sequential(
            nn.Conv2d(3, c[0], kernel_size=11, stride=4, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c[0], c[1], kernel_size=5, padding=2), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(c[1], c[2], kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c[2], c[3], kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(c[3], c[4], kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2))
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        hidden = 4096 // width
        # Dropout p=0 here so the comparison with eager training is exact (torchvision: 0.5)
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(c[4] * 6 * 6, hidden), nn.ReLU(inplace=True),   # fc6
            nn.Dropout(p=dropout), nn.Linear(hidden, hidden), nn.ReLU(inplace=True),         # fc7
            nn.Linear(hidden, num_classes))                                                  # fc8

    def forward(self, x):
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def make_model(width: int) -> AlexNet:
    torch.manual_seed(0)
    return AlexNet(width=width)


def data(image: int, steps: int):
    """CIFAR-10-shaped random batches (images upsampled to `image` pixels, as in the tutorial)."""
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(BATCH, 3, image, image, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
            for _ in range(steps)]


def optimizer(lr: float):
    return functools.partial(torch.optim.AdamW, lr=lr, eps=1e-6)


def train_rank(width: int, image: int, steps: int, lr: float):
    batches = data(image, steps)
    x, y = batches[0]
    strategy = gp.Strategy(pp=2, microbatches=4, schedule="1f1b", partition="parameters")
    pm = gp.compile(make_model(width), strategy, example_inputs=(x,), example_target=y,
                    loss_fn=F.cross_entropy, optimizer=optimizer(lr))
    losses = [pm.train_step(x, target=y) for x, y in batches]
    plan = pm.compiled.stage_plan   # the partition this compile chose
    return {"losses": losses, "state": pm.full_state_dict(), "description": plan.description,
            "stage_of_unit": dict(plan.stage_of_unit), "pp_rank": pm.mesh.pp_rank,
            "local_params": sum(p.numel() for p in pm.parameters())}


def train_eager(width: int, image: int, steps: int, lr: float):
    model = copy.deepcopy(make_model(width)).train()
    opt = optimizer(lr)(model.parameters())
    losses = []
    for x, y in data(image, steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="1/16 width, 63x63 images, 2 steps (CI)")
    parser.add_argument("--width", type=int, default=1, help="divide every channel count by this")
    parser.add_argument("--image", type=int, default=224)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=1e-4)
    args = parser.parse_args(argv)
    if args.small:
        args.width, args.image, args.steps, args.lr = 16, 63, 2, 1e-3

    params = sum(p.numel() for p in make_model(args.width).parameters())
    print(f"AlexNet (width 1/{args.width}, {params:,} parameters), pp=2, microbatches=4, 1F1B, "
          f"partition='parameters', {args.image}x{args.image} images")
    results = gp.launch(train_rank, world_size=2, args=(args.width, args.image, args.steps, args.lr))
    print(results[0]["description"])
    for r in results:
        print(f"  pp rank {r['pp_rank']} holds {r['local_params']:,} parameters")

    ref_losses, ref_state = train_eager(args.width, args.image, args.steps, args.lr)
    print("| step | graphpar pp=2 | single device | diff |\n|---:|---:|---:|---:|")
    for step, (a, b) in enumerate(zip(results[0]["losses"], ref_losses)):
        print(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b):.1e} |")

    failures = []
    stage_of = results[0]["stage_of_unit"]
    linears = [name for name, m in make_model(args.width).named_modules() if isinstance(m, nn.Linear)]
    fc6, fc7, fc8 = linears
    print(f"stages: {fc6} (fc6) -> {stage_of.get(fc6)}, {fc7} (fc7) -> {stage_of.get(fc7)}, "
          f"{fc8} (fc8) -> {stage_of.get(fc8)}")
    if (stage_of.get(fc7), stage_of.get(fc8)) != (1, 1):
        failures.append(f"the last two Linear layers are on stages {stage_of.get(fc7)}, {stage_of.get(fc8)}, not 1")
    if stage_of.get(fc6) != 0 or stage_of.get("features.0") != 0:
        failures.append(f"the convolutions and fc6 should be on stage 0: {stage_of}")
    if results[1]["losses"] != results[0]["losses"]:
        failures.append("the two ranks report different losses")
    loss_diff = max(abs(a - b) for a, b in zip(results[0]["losses"], ref_losses))
    if loss_diff > 1e-4:
        failures.append(f"losses differ from single-device training by {loss_diff:.2e} > 1e-4")
    param_tol = 0.02 * args.lr * args.steps   # AdamW moves an element by <= ~lr per step
    param_diff = max((results[0]["state"][k] - v).abs().max().item() for k, v in ref_state.items())
    print(f"largest parameter difference {param_diff:.1e} (tolerance {param_tol:.1e})")
    if param_diff > param_tol:
        failures.append(f"parameters differ from single-device training by {param_diff:.2e} > {param_tol:.1e}")
    if failures:
        print("FAIL: " + "; ".join(failures))
        return 1
    print("PASS: fc7 and fc8 form stage 1, and pipelined training matches single-device training")
    return 0


if __name__ == "__main__":
    sys.exit(main())

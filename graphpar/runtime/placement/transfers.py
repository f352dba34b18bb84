"""Moves between the device and the host, as autograd-correct graph ops with byte counters.

A transfer always copies, also when the host and the device are the same (the CPU tests):
the bytes it reports are the bytes a real device would move, and the source can be freed
or overwritten independently of the destination.
"""
from __future__ import annotations

import threading
from typing import Dict

import torch

HOST = torch.device("cpu")

_lock = threading.Lock()
_moved: Dict[str, int] = {"to_host": 0, "to_device": 0}


def _count(direction: str, tensor: torch.Tensor) -> None:
    with _lock:  # the host-step worker thread moves tensors too
        _moved[direction] += tensor.numel() * tensor.element_size()


def bytes_moved() -> Dict[str, int]:
    """Bytes copied each way since the last reset (this process)."""
    with _lock:
        return dict(_moved)


def reset_bytes_moved() -> None:
    with _lock:
        for key in _moved:
            _moved[key] = 0


def _copy(tensor: torch.Tensor, device: torch.device, direction: str) -> torch.Tensor:
    _count(direction, tensor)
    return tensor.to(device, copy=True)


class _Transfer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, device, direction, back):
        ctx.source, ctx.back = tensor.device, back
        return _copy(tensor, device, direction)

    @staticmethod
    def backward(ctx, grad):
        return _copy(grad, ctx.source, ctx.back), None, None, None


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Copy to host memory; the gradient flows back to where the tensor came from."""
    return _Transfer.apply(tensor, HOST, "to_host", "to_device")


def to_device(tensor: torch.Tensor, device: str) -> torch.Tensor:
    """Copy to the rank's device (named in the graph, e.g. "cuda:0"); gradients go back."""
    return _Transfer.apply(tensor, torch.device(device), "to_device", "to_host")

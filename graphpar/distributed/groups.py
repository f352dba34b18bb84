"""Small torch.distributed helpers shared across graphpar.

Everything here works whether or not torch.distributed has been initialised,
so library code can call :func:`rank` / :func:`world_size` unconditionally
and behave as a single process (rank 0 of 1) when run without a launcher.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Dict, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "set_timeout",
    "check_timeout",
    "world_size",
    "rank",
    "find_free_port",
    "ShapeMismatchError",
    "check_shapes",
    "collective_backend",
    "default_backend",
    "has_reduce_scatter",
]

_TIMEOUT_ENV = "GRAPHPAR_TIMEOUT_S"
# gloo counts timeouts in whole milliseconds (less rounds to none) and its clock overflows near
# 9e12 s; a billion seconds (about 32 years) is past any real wait.
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 0.001, 1e9
_RANGE = f"between {MIN_TIMEOUT_S} and {MAX_TIMEOUT_S:.0e}"


def _in_range(seconds: float) -> bool:
    # also false for NaN
    return MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S


def _timeout_from_env() -> float:
    raw = os.environ.get(_TIMEOUT_ENV, "").strip()
    if not raw:
        # torch's own default (30 min for gloo) turns a single mismatched
        # collective into a half-hour hang; 2 minutes is ample for one
        # collective on one machine and still generous for a cluster.
        return 120.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not _in_range(value):
        # Fail loudly: silently ignoring a typo would bring back hangs the
        # user explicitly tried to bound.
        raise ValueError(
            f"{_TIMEOUT_ENV}={raw!r} is not a positive number of seconds {_RANGE}. Fix: set it to "
            f"e.g. {_TIMEOUT_ENV}=120, or unset it for the default of 120 s."
        )
    return value


#: Timeout, in seconds, for every collective and every process group graphpar
#: creates (and for process-group rendezvous). 120 s unless the environment
#: variable ``GRAPHPAR_TIMEOUT_S`` says otherwise (read when graphpar is
#: imported); :func:`set_timeout` and ``launch.init_process_group_from_env(timeout_s=)``
#: change it. Library code reads it at the time of use, never copies it at import.
DEFAULT_TIMEOUT_S: float = _timeout_from_env()


def check_timeout(seconds: float) -> float:
    """``seconds`` as a float, or ValueError if it is not a usable timeout."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not _in_range(seconds):
        raise ValueError(
            f"timeout must be a positive, finite number of seconds, got {seconds!r} (it must be {_RANGE}). "
            f"Fix: pass e.g. timeout=120."
        )
    return float(seconds)


def set_timeout(seconds: float) -> None:
    """Make ``seconds`` the timeout of every group and collective graphpar
    creates from now on (groups that already exist keep theirs)."""
    global DEFAULT_TIMEOUT_S
    DEFAULT_TIMEOUT_S = check_timeout(seconds)

def world_size() -> int:
    """Number of ranks, or 1 when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


def rank() -> int:
    """This process's rank, or 0 when torch.distributed is not initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def default_backend() -> str:
    """The backend a launch picks when none is named: nccl where CUDA is available, gloo elsewhere."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def collective_backend(group=None) -> str:
    """The backend graphpar's collectives run on: the process group's once torch.distributed
    is initialised; before that (``gp.plan`` ahead of a launch) the one a launch picks
    (default_backend)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_backend(group)
    return default_backend()


def has_reduce_scatter(backend: str) -> bool:
    """Whether graphpar calls the backend's own reduce-scatter. gloo runs its reduce-scatter as
    an all-reduce of a copy of the whole input and then copies the rank's part out (measured
    1.3 to 1.8 times an all-reduce of the same buffer on the 2-core machine), so graphpar
    reduces otherwise there: ZeRO's gradient rows by point-to-point messages
    (graphpar/runtime/zero.py, _exchange_rows), sequence parallelism's tensors by an all-reduce
    (graphpar/runtime/collectives.py). The plan names what runs (docs/zero.md)."""
    return backend == "nccl"


def find_free_port(host: str = "") -> int:
    """A TCP port that was free a moment ago (for ``MASTER_PORT``).

    Another process can grab it before it is used; acceptable for local
    launches, where the window is a few hundred milliseconds.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ShapeMismatchError(ValueError):
    """Ranks hold a tensor graphpar is about to exchange between them in different shapes."""


Shape = Tuple[int, ...]


def check_shapes(what: str, held: Dict[str, Shape], expected: Dict[str, Shape], group=None) -> None:
    """Before a batch of collectives over ``group``: the full shape each rank's tensors imply
    (``held``) and the one its model gives (``expected``) must be one shape per tensor on
    every rank of the group.

    gloo answers a collective whose sizes differ between ranks with a connection reset (or
    waits until the timeout), naming nothing. One all_gather_object of the shapes, bounded
    by the group's timeout, lets every rank decide on the same data and raise the same
    error, naming the tensor, the shapes and the ranks, before any rank sends it."""
    mine = ({k: tuple(v) for k, v in held.items()}, {k: tuple(v) for k, v in expected.items()})
    everyone, ranks = [mine], [rank()]
    if group is not None and dist.get_world_size(group) > 1:
        everyone = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        ranks = dist.get_process_group_ranks(group)
    for name in dict.fromkeys(k for pair in everyone for part in pair for k in part):
        holding = {r: h[name] for r, (h, _) in zip(ranks, everyone) if name in h}
        models = {r: e[name] for r, (_, e) in zip(ranks, everyone) if name in e}
        if len(set(holding.values()) | set(models.values())) > 1:
            raise ShapeMismatchError(_shape_mismatch(what, name, holding, models))


def _by_shape(shapes: Dict[int, Shape]) -> str:
    ranks: Dict[Shape, list] = {}
    for r, shape in shapes.items():
        ranks.setdefault(shape, []).append(r)
    return "; ".join(f"{list(shape)} on rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}"
                     for shape, rs in ranks.items())


def _shape_mismatch(what: str, name: str, holding: Dict[int, Shape], models: Dict[int, Shape]) -> str:
    return (f"{what}: tensor {name!r} does not have one full shape on every rank: the ranks' shards make "
            f"{_by_shape(holding) or 'nothing (no rank holds it)'}, the ranks' models give {_by_shape(models)}; "
            f"they must be one shape, so nothing was sent (a collective of it would fail). Fix: compile the "
            f"same model with the same Strategy on every rank and load the same state on each; if they "
            f"were, this is a graphpar bug: report it with each rank's pm.dump(directory).")

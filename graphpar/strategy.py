"""The parallelisation strategy: what to split, how far, and how to schedule it.

A ``Strategy`` is a frozen, validated description of one compile. Every
invalid setting is rejected at construction with a ``ValueError`` of the form::

    Strategy.<field>=<value> is invalid: <rule>. Fix: <suggestion>.

The rules, briefly:

* ``dp``, ``tp``, ``pp``, ``microbatches`` and ``virtual_stages`` are ints >= 1
  and ``dp * tp * pp`` must equal the world size (checked later, by
  ``check_world_size``, because the world size is only known at launch).
* ``schedule`` is ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zero-bubble"``
  (ZB-H1) or ``"zbv"``. The interleaved schedule and ``virtual_stages > 1`` go
  together, need ``pp > 1``, and need ``microbatches`` to be a multiple of ``pp``
  (Megatron-LM's rule). ``"zero-bubble"`` needs ``pp > 1`` and ``virtual_stages=1``;
  ``"zbv"`` needs ``pp > 1`` and exactly ``virtual_stages=2`` (two chunks per rank in
  a V: rank r holds stages r and 2*pp-1-r, see ``stage_rank``).
* ``partition`` is ``"uniform"``, ``"parameters"``, ``"profile"``,
  ``"type:<regex>"``, or a list of the module paths where stages 2..N begin,
  i.e. exactly ``pp * virtual_stages - 1`` unique paths.
* ``sequence_parallel=True`` needs ``tp > 1``.
* ``param_dtype`` is None or float32 / bfloat16 / float16 (strings accepted).
* ``reduce_dtype`` (the gradients' accumulation and reduction dtype) is None (fp32),
  float32, or the ``param_dtype`` itself.
* ``offload_embedding`` is a bool or a list of module paths.
* ``zero`` is 0, 1, 2 or 3; ``zero > 0`` shards over the dp ranks (of every pipeline
  stage) and does not combine with ``offload_embedding`` yet.
* ``ep`` (the expert-parallel degree) is an int >= 1 that divides ``dp * tp``: the experts
  of each mixture-of-experts layer are split over groups of ``ep`` consecutive ranks of the
  dp x tp ranks of a stage (docs/expert-parallel.md).
* ``expert_capacity_factor`` is None (dropless) or a finite number > 0, and needs ``ep > 1``:
  each expert takes at most ceil(factor * T * K / E) of a replica's microbatch's T * K pairs.
* ``expert_tp`` (expert tensor parallelism) is 1 (every expert a rank holds is whole) or
  ``tp``: each expert's matrices are then split over the rank's tp group (Megatron's
  expert_tensor_parallel_size = tp), ``ep`` must divide ``dp`` (the ep group is made of the
  dp ranks at one tp rank), and ``offload_optimizer`` is not built with it
  yet (even at ``ep = 1``).
* ``recompute`` is None, ``"full"``, ``"selective"`` or a float in (0, 1] (a budget for the
  saved activations as a fraction of the no-recompute figure).
* ``passes`` holds callables, ``"package.module:function"`` strings, or pass
  objects (anything with ``.name`` and ``.fn``).

Lists are normalised to tuples so that equal strategies compare equal however
they were spelled, and ``to_dict``/``from_dict`` round-trip through JSON.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import re
import sys
from collections.abc import Mapping
from typing import Any

import torch

from graphpar.errors import closest, invalid, is_int_at_least

__all__ = ["Strategy"]

# the one list of pipeline schedules (graphpar/runtime/pipeline/schedules.py builds them)
GPIPE, ONE_F_ONE_B, INTERLEAVED = "gpipe", "1f1b", "interleaved-1f1b"
ZERO_BUBBLE, ZBV = "zero-bubble", "zbv"
SCHEDULES = (GPIPE, ONE_F_ONE_B, INTERLEAVED, ZERO_BUBBLE, ZBV)
# schedules that run each backward as two instructions: the input gradient (`backward`) and,
# later, the weight gradient (`backward_weight`); passes/split_backward.py splits the program
SPLIT_BACKWARD = (ZERO_BUBBLE, ZBV)
# schedules whose stages run on their ranks in a V (stage_rank); the others loop
V_SHAPED = (ZBV,)
#: torch seeds generators with unsigned 64-bit ints
SEED_LIMIT = 2 ** 64
PARTITION_POLICIES = ("uniform", "parameters", "profile")
TYPE_PREFIX = "type:"

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}

_POSITIVE_INTS = {
    # field: (what it is, how to turn it off)
    "dp": ("data-parallel degree", "use dp=1 to disable data parallelism"),
    "tp": ("tensor-parallel degree", "use tp=1 to disable tensor parallelism"),
    "pp": ("pipeline-parallel degree", "use pp=1 to disable pipeline parallelism"),
    "ep": ("expert-parallel degree", "use ep=1 to keep every expert on every rank"),
    "expert_tp": ("expert tensor-parallel degree", "use expert_tp=1 to keep each expert's matrices whole"),
    "microbatches": (
        "number of pipeline microbatches per train_step",
        "use microbatches=1 to run the whole local batch as one microbatch",
    ),
    "virtual_stages": (
        "number of model chunks per pipeline rank",
        "use virtual_stages=1 (one chunk per rank) unless you use the interleaved-1f1b or zbv schedule",
    ),
}
_BOOLS = ("sequence_parallel", "offload_optimizer", "strict")
ZERO_STAGES = (0, 1, 2, 3)
_PASS_DICT_KEYS = ("name", "target", "after", "before")


# --------------------------------------------------------------------------- #
# Message helpers
# --------------------------------------------------------------------------- #


# a bad Strategy field: "Strategy.<field>=<value> is invalid: <rule>. Fix: <fix>."
invalid_setting = functools.partial(invalid, owner="Strategy.")


def _show(value: Any) -> str:
    # repr() of a dtype is already "torch.bfloat16", which is what users type.
    return repr(value)


def _type_name(value: Any) -> str:
    return type(value).__name__


# --------------------------------------------------------------------------- #
# Single-field checks; each returns the normalised value or raises.
# --------------------------------------------------------------------------- #


def _check_positive_int(field: str, value: Any) -> int:
    what, disable = _POSITIVE_INTS[field]
    subject = f"{field}={_show(value)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        guess = _int_guess(value)
        fix = f"use {field}={guess}" if guess is not None and guess >= 1 else disable
        raise invalid_setting(subject, f"{what} must be a positive int, got {_type_name(value)}", fix)
    if value < 1:
        raise invalid_setting(subject, f"{what} must be a positive int", disable)
    return int(value)  # numpy ints would otherwise leak into to_dict()


def _int_guess(value: Any) -> int | None:
    # Offer the int the user most likely meant (2.0 -> 2, "4" -> 4).
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def _check_bool(field: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    is_flag = isinstance(value, numbers.Number) and value in (0, 1)
    fix = f"use {field}={bool(value)}" if is_flag else f"use {field}=True or {field}=False"
    raise invalid_setting(f"{field}={_show(value)}", f"{field} must be a bool, got {_type_name(value)}", fix)


def check_schedule_name(value: Any, owner: str = "Strategy.") -> str:
    """`value` if it names a schedule in SCHEDULES; else the error (`owner` starts its subject)."""
    subject = f"{owner}schedule={_show(value)}"
    allowed = ", ".join(repr(s) for s in SCHEDULES)
    if not isinstance(value, str):
        raise invalid(subject, f"schedule must be a str, one of {allowed}, got {_type_name(value)}",
                      "use schedule='1f1b' (the default)")
    if value in SCHEDULES:
        return value
    near = closest(value, SCHEDULES)
    fix = f"use schedule={near!r} (the closest allowed value; did you mean it?)" if near else f"use one of {allowed}"
    raise invalid(subject, f"unknown schedule; schedule must be one of {allowed}", fix)


def check_schedule_rules(schedule: str, pp: int, microbatches: int, virtual_stages: int,
                         owner: str = "Strategy.") -> None:
    """The rules tying a schedule to pp, microbatches and virtual_stages (Strategy and
    build_schedule both check them); `owner` starts the error's subject."""
    if schedule == ZBV:
        _check_zbv(pp, virtual_stages, owner)
        return
    interleaved = schedule == INTERLEAVED
    if interleaved and virtual_stages == 1:
        raise invalid(f"{owner}schedule={schedule!r} with virtual_stages=1",
                      "the interleaved schedule splits each pipeline rank's layers into several chunks, "
                      "so it needs virtual_stages > 1",
                      "set virtual_stages=2 (or more), or use schedule='1f1b'")
    if virtual_stages > 1 and not interleaved:
        raise invalid(f"{owner}virtual_stages={virtual_stages} with schedule={schedule!r}",
                      f"virtual_stages > 1 is only used by schedule={INTERLEAVED!r} (any number of chunks) "
                      f"and schedule={ZBV!r} (two)",
                      f"use schedule={INTERLEAVED!r}, or virtual_stages=1")
    if (interleaved or schedule == ZERO_BUBBLE) and pp == 1:
        kind = "an interleaved pipeline" if interleaved else "a zero-bubble pipeline (its weight gradients fill the idle time between ranks)"
        raise invalid(f"{owner}schedule={schedule!r} with pp=1", f"{kind} needs at least two pipeline ranks",
                      "set pp > 1, or use schedule='1f1b' with virtual_stages=1")
    if interleaved and microbatches % pp:
        lower = microbatches // pp * pp
        options = [m for m in (lower, lower + pp) if m >= 1]
        raise invalid(f"{owner}microbatches={microbatches} with pp={pp} and virtual_stages={virtual_stages}",
                      "the interleaved schedule needs microbatches to be a multiple of pp "
                      "(the same rule as Megatron-LM's interleaved 1F1B: microbatches go through the "
                      "chunks in groups of pp)",
                      "use microbatches=" + " or microbatches=".join(map(str, options)))


def _check_zbv(pp: int, virtual_stages: int, owner: str) -> None:
    if virtual_stages != 2:
        raise invalid(f"{owner}schedule={ZBV!r} with virtual_stages={virtual_stages}",
                      "the zbv schedule runs exactly two chunks of the model on every pipeline rank, in a V "
                      "(rank r holds stage r and stage 2*pp-1-r)",
                      "set virtual_stages=2, or use schedule='interleaved-1f1b' for other chunk counts")
    if pp == 1:
        raise invalid(f"{owner}schedule={ZBV!r} with pp=1",
                      "a V of two chunks needs at least two pipeline ranks",
                      "set pp > 1, or use schedule='1f1b' with virtual_stages=1")


def stage_rank(stage: int, pp: int, schedule: str = ONE_F_ONE_B) -> int:
    """The pp rank that holds global stage `stage` (the one home of the placement rule).

    Every schedule but zbv loops, Megatron's interleaved layout: rank r holds stages r, r + pp,
    r + 2pp, ... A V-shaped schedule (V_SHAPED) turns back at every chunk: rank r holds stage
    r and stage 2pp - 1 - r, so the first and the last stage are both on rank 0."""
    chunk, offset = divmod(stage, pp)
    return pp - 1 - offset if schedule in V_SHAPED and chunk % 2 else offset


def rank_stages(pp_rank: int, pp: int, num_stages: int, schedule: str = ONE_F_ONE_B) -> list[int]:
    """The global stages pp rank `pp_rank` holds, in increasing order (stage_rank's inverse)."""
    return [s for s in range(num_stages) if stage_rank(s, pp, schedule) == pp_rank]


def stream_offsets(tp_rank: int, pp_rank: int) -> dict[str, int]:
    """What each dropout stream adds to Strategy.seed on a rank (graphpar/runtime/rng.py)."""
    return {"global": 1000 * pp_rank, "tp_local": 2718 + tp_rank + 1000 * pp_rank}


def largest_seed(tp: int, pp: int) -> int:
    """The largest Strategy.seed whose every rank's stream seeds fit in 64 bits."""
    return SEED_LIMIT - 1 - max(stream_offsets(tp - 1, pp - 1).values())


def _check_seed(value: Any) -> int:
    subject = f"seed={_show(value)}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        guess = _int_guess(value)
        fix = f"use seed={guess}" if guess is not None else "use an int such as seed=0"
        raise invalid_setting(subject, f"seed must be a non-negative int, got {_type_name(value)}", fix)
    if value < 0:
        raise invalid_setting(subject, "seed must be a non-negative int", f"use seed={-int(value)} or seed=0")
    return int(value)


def _check_dtype(field: str, value: Any, fix: str) -> torch.dtype | None:
    """param_dtype and reduce_dtype: None, one of the three dtypes, or a name of one."""
    if value is None or (isinstance(value, torch.dtype) and value in _DTYPE_NAMES):
        return value
    subject = f"{field}={_show(value)}"
    rule = (
        f"{field} must be None, torch.float32, torch.bfloat16 or torch.float16 "
        f"(or one of the strings {', '.join(repr(k) for k in _DTYPES)})"
    )
    if isinstance(value, str):
        if value in _DTYPES:
            return _DTYPES[value]
        near = closest(value.removeprefix("torch."), list(_DTYPES))
        if near:
            raise invalid_setting(subject, rule, f"use {field}={near!r} (the closest allowed value)")
    raise invalid_setting(subject, rule, fix)


def _check_zero(value: Any) -> int:
    subject = f"zero={_show(value)}"
    meaning = "0 (nothing sharded), 1 (optimizer states), 2 (+ gradients) or 3 (+ parameters)"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value not in ZERO_STAGES:
        guess = _int_guess(value)
        fix = f"use zero={guess}" if guess in ZERO_STAGES else "use zero=0 (the default), 1, 2 or 3"
        raise invalid_setting(subject, f"zero must be the int {meaning}", fix)
    return int(value)


RECOMPUTE_MODES = ("full", "selective")


def _check_recompute(value: Any) -> str | float | None:
    if value is None or value in RECOMPUTE_MODES:
        return value
    subject = f"recompute={_show(value)}"
    rule = ("recompute must be None (keep every activation), 'full' (keep each block's input), 'selective' "
            "(keep matmul and attention outputs) or a float in (0, 1]: the saved activations' budget as a "
            "fraction of what training saves without recomputation")
    if isinstance(value, str):
        near = closest(value, list(RECOMPUTE_MODES))
        fix = f"use recompute={near!r}" if near else "use recompute='full', 'selective', a fraction such as 0.5, or None"
        raise invalid_setting(subject, rule, fix)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and 0 < value <= 1:
        return float(value)
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and 1 < value <= 100:
        fix = f"use recompute={value / 100:g} ({value:g}% as a fraction)"
    else:
        fix = "use a fraction such as recompute=0.5, or recompute='full'"
    raise invalid_setting(subject, rule, fix)


def _check_capacity_factor(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0:
        return float(value)
    raise invalid_setting(
        f"expert_capacity_factor={_show(value)}",
        "expert_capacity_factor must be None (dropless: every token reaches its experts, as on one device) or "
        "a finite number > 0: each expert then takes at most ceil(factor * T * K / E) of the T tokens' K "
        "choices per layer and microbatch of a replica, and drops the rest",
        "use expert_capacity_factor=None, or a factor such as 1.25 (Switch Transformer's)")


def _check_partition(value: Any) -> str | tuple[str, ...]:
    if isinstance(value, str):
        return check_partition_policy(value)
    if isinstance(value, (list, tuple)):
        return _check_module_paths("partition", value, "the module paths where stages 2..N begin")
    raise invalid_setting(
        f"partition={_show(value)}",
        "partition must be a policy name ('uniform', 'parameters', 'profile', 'type:<regex>') "
        f"or a list of module paths, got {_type_name(value)}",
        "use partition='parameters' (the default)",
    )


def check_partition_policy(value: str) -> str:
    """`value` if it names a partition policy (passes/partition_policies.py balances by it)."""
    subject = f"partition={value!r}"
    if value in PARTITION_POLICIES:
        return value
    if value.startswith(TYPE_PREFIX):
        _check_type_regex(subject, value[len(TYPE_PREFIX):])
        return value
    rule = "a string partition must be 'uniform', 'parameters', 'profile' or 'type:<regex>'"
    near = closest(value, PARTITION_POLICIES + ("type:",))
    if near:
        fix = f"use partition={near!r} (the closest policy name)"
    elif "." in value or value.isidentifier():
        # Looks like a single module path: the user probably meant a boundary list.
        fix = f"to start a stage at module {value!r}, pass a list: partition=[{value!r}]"
    else:
        fix = "use partition='parameters' (balance stages by parameter count)"
    raise invalid_setting(subject, rule, fix)


def _check_type_regex(subject: str, pattern: str) -> None:
    if not pattern:
        raise invalid_setting(
            subject,
            "'type:' must be followed by a regex matching the module class names that start a stage",
            "write e.g. partition='type:TransformerBlock|DecoderLayer'",
        )
    try:
        re.compile(pattern)
    except re.error as exc:
        raise invalid_setting(
            subject,
            f"the regex {pattern!r} after 'type:' does not compile ({exc})",
            "escape special characters with re.escape() or fix the pattern",
        ) from None


def _check_module_paths(field: str, value: list | tuple, meaning: str) -> tuple[str, ...]:
    subject = f"{field}={_show(value)}"
    if not value:
        raise invalid_setting(subject, f"a list {field} must be non-empty ({meaning})", _empty_list_fix(field))
    seen: set[str] = set()
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            got = "an empty string" if isinstance(item, str) else f"{item!r} of type {_type_name(item)}"
            raise invalid_setting(
                subject,
                f"every entry must be a non-empty module path string such as 'layers.12', but entry {i} is {got}",
                "use the dotted names printed by model.named_modules()",
            )
        if item in seen:
            raise invalid_setting(subject, f"module path {item!r} appears more than once", "list each module path once")
        seen.add(item)
    return tuple(value)


def _empty_list_fix(field: str) -> str:
    if field == "partition":
        return "use a policy such as partition='parameters' when there is nothing to place by hand"
    return f"use {field}=False to offload nothing"


def _check_offload_embedding(value: Any) -> bool | tuple[str, ...]:
    if isinstance(value, bool):
        return value
    if isinstance(value, (list, tuple)):
        return _check_module_paths("offload_embedding", value, "the embedding modules to keep on the CPU")
    raise invalid_setting(
        f"offload_embedding={_show(value)}",
        f"offload_embedding must be True, False, or a list of module paths, got {_type_name(value)}",
        "use offload_embedding=True to offload every nn.Embedding, or e.g. offload_embedding=['embed_tokens']",
    )


# --------------------------------------------------------------------------- #
# Passes
# --------------------------------------------------------------------------- #


def _is_import_path(text: str) -> bool:
    module, sep, attr = text.partition(":")
    if not sep:
        return False
    return all(p.isidentifier() for p in module.split(".")) and all(p.isidentifier() for p in attr.split("."))


def _import_path_fix(text: str) -> str:
    # "pkg.mod.fn" is the commonest slip: the last dot should be a colon.
    if ":" not in text and "." in text:
        head, _, tail = text.strip().rpartition(".")
        candidate = f"{head}:{tail}"
        if _is_import_path(candidate):
            return f"use {candidate!r}"
    return "write it as 'package.module:function', e.g. 'mypkg.passes:fuse_norms'"


def _is_pass_object(item: Any) -> bool:
    return hasattr(item, "name") and hasattr(item, "fn")


def _check_passes(value: Any) -> tuple:
    subject = f"passes={_show(value)}"
    if not isinstance(value, (list, tuple)):
        raise invalid_setting(
            subject,
            f"passes must be a tuple or list of passes, got {_type_name(value)}",
            f"wrap it in a tuple: passes=({_show(value)},)",
        )
    return tuple(_check_pass(subject, i, item) for i, item in enumerate(value))


def _check_pass(subject: str, i: int, item: Any) -> Any:
    if isinstance(item, str):
        if not _is_import_path(item):
            raise invalid_setting(
                subject,
                f"passes[{i}]={item!r} is not an importable path of the form 'package.module:function'",
                _import_path_fix(item),
            )
        return item
    if isinstance(item, Mapping):
        return _check_pass_dict(subject, i, item)
    if _is_pass_object(item) or callable(item):
        return item
    raise invalid_setting(
        subject,
        f"passes[{i}]={item!r} has type {_type_name(item)}; each pass must be a callable, a "
        "'package.module:function' string, or a pass object with .name and .fn",
        "pass the function itself, or its import path as a string",
    )


def _check_pass_dict(subject: str, i: int, item: Mapping) -> dict:
    """Validate the serialised form of a pass object, as written by ``to_dict``."""
    where = f"passes[{i}]"
    unknown = sorted(set(item) - set(_PASS_DICT_KEYS))
    if unknown:
        raise invalid_setting(
            subject,
            f"{where} has unknown key(s) {unknown}; a serialised pass has keys {list(_PASS_DICT_KEYS)}",
            "remove the unknown keys",
        )
    name, target = item.get("name"), item.get("target")
    if not isinstance(name, str) or not name:
        raise invalid_setting(subject, f"{where}['name'] must be a non-empty str, got {name!r}", "give the pass a name")
    if not isinstance(target, str) or not _is_import_path(target):
        fix = _import_path_fix(target) if isinstance(target, str) else "set 'target': 'package.module:function'"
        raise invalid_setting(subject, f"{where}['target'] must be a 'package.module:function' string, got {target!r}", fix)
    return {
        "name": name,
        "target": target,
        "after": _order_ref(subject, f"{where}['after']", item.get("after")),
        "before": _order_ref(subject, f"{where}['before']", item.get("before")),
    }


def _order_ref(subject: str, where: str, value: Any) -> str | list[str] | None:
    # after/before name other passes; lists (not tuples) so JSON round-trips compare equal.
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise invalid_setting(
        subject,
        f"{where} must be None, a pass name, or a list of pass names, got {value!r}",
        "name the pass(es) this one must run after/before, e.g. 'after': 'fuse_norms'",
    )


def _callable_path(fn: Any, where: str) -> str:
    """Return ``module:qualname`` for ``fn``, or explain why it cannot be named."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    label = f"{where} ({qualname or _type_name(fn)})"
    only = "only module-level functions can be serialised, because other ranks re-import them by path"
    if not module or not qualname:
        reason = f"{_type_name(fn)} objects have no import path"
    elif "<lambda>" in qualname:
        reason = "it is a lambda"
    elif "<locals>" in qualname:
        reason = "it is a nested function (defined inside another function)"
    elif not _resolves_to(module, qualname, fn):
        reason = f"{module}:{qualname} does not resolve back to it"
    else:
        return f"{module}:{qualname}"
    raise ValueError(
        f"Strategy.to_dict cannot serialise {label}: {reason}; {only}. "
        "Fix: move it to the top level of a module and pass it (or 'package.module:function') in passes."
    )


def _resolves_to(module: str, qualname: str, fn: Any) -> bool:
    # Only look at already-imported modules: serialising must not import user code.
    obj: Any = sys.modules.get(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    # "==" as well as "is": a classmethod fetched from its class is a fresh bound method each time.
    return obj is fn or (obj is not None and obj == fn)


def _pass_to_json(i: int, item: Any) -> Any:
    where = f"passes[{i}]"
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        return {k: list(v) if isinstance(v, list) else v for k, v in item.items()}
    if _is_pass_object(item):
        fn = item.fn
        target = fn if isinstance(fn, str) and _is_import_path(fn) else _callable_path(fn, f"{where}.fn")
        subject = f"passes[{i}]"
        return {
            "name": item.name,
            "target": target,
            "after": _order_ref(subject, f"{where}.after", getattr(item, "after", None)),
            "before": _order_ref(subject, f"{where}.before", getattr(item, "before", None)),
        }
    return _callable_path(item, where)


# --------------------------------------------------------------------------- #
# The dataclass
# --------------------------------------------------------------------------- #


@dataclasses.dataclass(frozen=True)
class Strategy:
    """How to parallelise one compile. See the module docstring for the rules."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    partition: Any = "parameters"
    sequence_parallel: bool = False
    offload_optimizer: bool = False
    offload_embedding: Any = False
    param_dtype: Any = None
    reduce_dtype: Any = None
    zero: int = 0
    recompute: Any = None
    ep: int = 1
    seed: int = 0
    passes: Any = ()
    strict: bool = False
    # fields beyond the public contract's (../shared/API.md) come after them, so a Strategy
    # built positionally keeps its meaning
    expert_tp: int = 1
    expert_capacity_factor: Any = None

    def __post_init__(self) -> None:
        for field, value in self._normalised_fields().items():
            # frozen=True forbids plain assignment; normalising is part of construction.
            object.__setattr__(self, field, value)
        check_schedule_rules(self.schedule, self.pp, self.microbatches, self.virtual_stages)
        self._check_partition_length()
        self._check_sequence_parallel()
        self._check_seed_range()
        self._check_zero_rules()
        self._check_reduce_dtype()
        self._check_expert_rules()

    def _normalised_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {f: _check_positive_int(f, getattr(self, f)) for f in _POSITIVE_INTS}
        out.update({f: _check_bool(f, getattr(self, f)) for f in _BOOLS})
        out["schedule"] = check_schedule_name(self.schedule)
        out["partition"] = _check_partition(self.partition)
        out["offload_embedding"] = _check_offload_embedding(self.offload_embedding)
        out["param_dtype"] = _check_dtype(
            "param_dtype", self.param_dtype,
            "use param_dtype=torch.bfloat16 for mixed-precision weights, or None to keep the model's dtype")
        out["reduce_dtype"] = _check_dtype(
            "reduce_dtype", self.reduce_dtype,
            "use reduce_dtype=None (fp32 gradients), or the param_dtype for low-precision gradients")
        out["zero"] = _check_zero(self.zero)
        out["recompute"] = _check_recompute(self.recompute)
        out["expert_capacity_factor"] = _check_capacity_factor(self.expert_capacity_factor)
        out["seed"] = _check_seed(self.seed)
        out["passes"] = _check_passes(self.passes)
        return out

    # -- cross-field rules ------------------------------------------------- #

    def _check_partition_length(self) -> None:
        if not isinstance(self.partition, tuple):
            return
        stages = self.pp * self.virtual_stages
        need = stages - 1
        if len(self.partition) == need:
            return
        explain = (
            f"a list partition names the module where each stage after the first begins (the first stage "
            f"begins at the model start), so pp*virtual_stages={self.pp}*{self.virtual_stages}={stages} "
            f"stages need exactly {need} {'entry' if need == 1 else 'entries'}, got {len(self.partition)}"
        )
        if need == 0:
            fix = "with a single stage there is nothing to split: use partition='parameters', or set pp > 1"
        elif len(self.partition) == stages:
            fix = f"drop the first entry ({self.partition[0]!r}): the first stage always begins at the model start"
        else:
            fix = f"list exactly {need} module paths, or set pp so that pp*virtual_stages = {len(self.partition) + 1}"
        raise invalid_setting(f"partition={list(self.partition)!r} with pp={self.pp}", explain, fix)

    def _check_sequence_parallel(self) -> None:
        if self.sequence_parallel and self.tp == 1:
            raise invalid_setting(
                "sequence_parallel=True with tp=1",
                "sequence parallelism shards activations across the tensor-parallel group, so it needs tp > 1",
                "set tp > 1, or sequence_parallel=False",
            )

    def _check_seed_range(self) -> None:
        largest = largest_seed(self.tp, self.pp)
        if self.seed > largest:
            raise invalid_setting(
                f"seed={self.seed}",
                f"torch seeds take 64 bits, and each rank's dropout streams seed with Strategy.seed plus "
                f"an offset of up to {SEED_LIMIT - 1 - largest} at tp={self.tp}, pp={self.pp}, so seed must be "
                f"at most {largest}",
                f"use seed={self.seed % 2 ** 63} (its low 63 bits), or any smaller non-negative int",
            )

    def _check_zero_rules(self) -> None:
        if self.zero and self.offload_embedding:
            raise invalid_setting(
                f"zero={self.zero} with offload_embedding={_show(self.offload_embedding)}",
                "ZeRO with host embedding tables is not built yet",
                "use offload_embedding=False with zero, or zero=0 with offload_embedding",
            )

    def _check_reduce_dtype(self) -> None:
        compute = self.param_dtype or torch.float32
        if self.reduce_dtype in (None, torch.float32, compute):
            return
        raise invalid_setting(
            f"reduce_dtype={_show(self.reduce_dtype)} with param_dtype={_show(self.param_dtype)}",
            f"gradients accumulate over microbatches and reduce over dp in fp32 or in the compute dtype, "
            f"param_dtype (here {_show(compute)}); another dtype is not built",
            f"use reduce_dtype=None (fp32 gradients), or set param_dtype={_show(self.reduce_dtype)} as well to "
            f"compute and reduce in it",
        )
    @property
    def splits_experts(self) -> bool:
        """Whether the experts of mixture-of-experts layers are split over ranks: over ep
        groups (ep > 1), or each expert's matrices over tp (expert_tp > 1)."""
        return self.ep > 1 or self.expert_tp > 1

    def _check_expert_rules(self) -> None:
        if self.ep == 1 and self.expert_capacity_factor is not None:
            raise invalid_setting(
                f"expert_capacity_factor={_show(self.expert_capacity_factor)} with ep=1",
                "the capacity is applied where expert parallelism dispatches tokens to the experts' ranks; "
                "at ep=1 the experts run the model's own forward, which drops nothing",
                "set ep > 1 (a divisor of dp * tp and of the number of experts), or "
                "expert_capacity_factor=None")
        if not self.splits_experts:
            return
        self._check_expert_tp()
        ranks = self.dp * self.tp
        if ranks % self.ep:
            options = " or ".join(f"ep={d}" for d in _divisors(ranks) if d > 1) or "ep=1"
            raise invalid_setting(
                f"ep={self.ep} with dp={self.dp}, tp={self.tp}",
                "expert parallelism folds into the data- and tensor-parallel ranks of a stage (each group of "
                "ep consecutive ones splits every mixture-of-experts layer's experts), so ep must divide "
                f"dp * tp = {ranks}",
                f"use {options}, or set dp * tp to a multiple of {self.ep}")

    def _check_expert_tp(self) -> None:
        if self.expert_tp not in (1, self.tp):
            raise invalid_setting(
                f"expert_tp={self.expert_tp} with tp={self.tp}",
                "expert tensor parallelism splits each expert's matrices over the tensor-parallel group of its "
                "rank (the layout of Megatron's expert_tensor_parallel_size = tp, docs/expert-parallel.md), so "
                "expert_tp must be 1 or tp",
                f"use expert_tp={self.tp}" + (" or expert_tp=1" if self.tp > 1 else "")
                + (f", or tp={self.expert_tp} with expert_tp={self.expert_tp}" if self.tp == 1 else ""))
        if self.expert_tp > 1 and self.dp % self.ep:
            options = " or ".join(f"ep={d}" for d in _divisors(self.dp))
            raise invalid_setting(
                f"ep={self.ep} with expert_tp={self.expert_tp}, dp={self.dp}",
                "with expert tensor parallelism the tp ranks of a replica hold pieces of the same experts, so "
                f"the ep group is made of dp ranks at one tp rank and ep must divide dp = {self.dp}",
                f"use {options}, or expert_tp=1 (ep then folds into dp * tp = {self.dp * self.tp})")

    # -- public API --------------------------------------------------------- #

    @property
    def world_size(self) -> int:
        """The number of ranks this strategy needs: ``dp * tp * pp``."""
        return self.dp * self.tp * self.pp

    @property
    def gradient_dtype(self) -> torch.dtype:
        """The dtype gradients accumulate over microbatches and reduce over dp in: ``reduce_dtype``,
        or fp32 when it is None (Megatron's fp32 main_grad, FSDP2's reduce_dtype)."""
        return self.reduce_dtype or torch.float32

    def check_world_size(self, world_size: int) -> None:
        """Raise ``ValueError`` unless ``dp * tp * pp == world_size``."""
        if not is_int_at_least(world_size, 1):
            raise invalid(f"world_size={world_size!r}", "it must be a positive int",
                          "pass torch.distributed.get_world_size()")
        if self.world_size == world_size:
            return
        model = self.tp * self.pp
        if world_size % model == 0:
            fix = f"use dp={world_size // model} (world_size // (tp*pp) = {world_size} // {model})"
        else:
            divisors = ", ".join(str(d) for d in _divisors(world_size))
            fix = (
                f"tp*pp={model} does not divide {world_size}; choose tp and pp whose product is one of "
                f"{divisors}, then set dp = {world_size} // (tp*pp)"
            )
        raise ValueError(
            f"Strategy(dp={self.dp}, tp={self.tp}, pp={self.pp}) does not fit the world size: "
            f"dp*tp*pp = {self.dp}*{self.tp}*{self.pp} = {self.world_size}, but world_size={world_size}; "
            f"every rank must hold exactly one (dp, tp, pp) coordinate. Fix: {fix}."
        )

    def stage_rank(self, stage: int) -> int:
        """The pp rank holding global stage `stage` under this strategy's schedule."""
        return stage_rank(stage, self.pp, self.schedule)

    def check_batch(self, local_batch: int) -> None:
        """Raise ``ValueError`` unless the local batch splits evenly into microbatches."""
        if not is_int_at_least(local_batch, 1):
            raise invalid(f"local_batch={local_batch!r}", "it must be a positive int (the per-rank batch size)",
                          "pass the batch dimension of one rank's input")
        if local_batch % self.microbatches == 0:
            return
        rule = (
            f"local batch {local_batch} is not divisible by microbatches={self.microbatches}; "
            "every microbatch must have the same size"
        )
        raise invalid_setting(f"microbatches={self.microbatches}", rule, self._batch_fix(local_batch))

    def _batch_fix(self, local_batch: int) -> str:
        # Interleaved schedules additionally need a multiple of pp, so only suggest values that pass both rules.
        step = self.pp if self.schedule == INTERLEAVED else 1
        valid = [m for m in _divisors(local_batch) if m % step == 0]
        near = sorted(valid, key=lambda m: (abs(m - self.microbatches), m))[:2]
        down = local_batch // self.microbatches * self.microbatches
        up = down + self.microbatches
        batch_fix = f"change the local batch to {up}" + (f" or {down}" if down else "")
        if not near:
            return f"no microbatch count that is a multiple of pp={self.pp} divides {local_batch}; {batch_fix}"
        options = " or ".join(f"microbatches={m}" for m in sorted(near))
        return f"use {options} (nearest values that divide {local_batch}), or {batch_fix}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; callables in ``passes`` become ``module:qualname`` paths."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for field in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, field)
            out[field] = _DTYPE_NAMES[dtype] if dtype is not None else None
        if isinstance(self.partition, tuple):
            out["partition"] = list(self.partition)
        if isinstance(self.offload_embedding, tuple):
            out["offload_embedding"] = list(self.offload_embedding)
        out["passes"] = [_pass_to_json(i, p) for i, p in enumerate(self.passes)]
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Strategy":
        """Inverse of ``to_dict``. Pass strings and dicts are validated but not imported."""
        if not isinstance(d, Mapping):
            raise TypeError(
                f"Strategy.from_dict expected a dict, got {_type_name(d)}. Fix: pass the dict from Strategy.to_dict()."
            )
        _check_keys(d)
        return cls(**d)

    @classmethod
    def coerce(cls, obj: Any) -> "Strategy":
        """Accept a ``Strategy`` as-is or build one from a dict."""
        if isinstance(obj, Strategy):
            return obj
        if isinstance(obj, Mapping):
            return cls.from_dict(obj)
        raise TypeError(
            f"Strategy.coerce expected a graphpar.Strategy or a dict, got {_type_name(obj)} ({obj!r}). "
            "Fix: pass graphpar.Strategy(dp=..., tp=..., pp=...) or a dict such as {'dp': 2, 'pp': 2}."
        )


def _field_names() -> list[str]:
    return [f.name for f in dataclasses.fields(Strategy)]


def _check_keys(d: Mapping[str, Any]) -> None:
    names = _field_names()
    unknown = [k for k in d if k not in names]
    if not unknown:
        return
    hints = []
    for key in unknown:
        near = _closest_field(str(key), names)
        hints.append(f"rename {key!r} to {near!r}" if near else f"remove {key!r}")
    raise ValueError(
        f"Strategy.from_dict got unknown key(s) {', '.join(repr(k) for k in unknown)}; "
        f"valid fields are {', '.join(names)}. Fix: {'; '.join(hints)}."
    )


def _closest_field(key: str, names: list[str]) -> str | None:
    near = difflib.get_close_matches(key.lower(), names, n=1)
    if near:
        return near[0]
    # difflib misses short fields inside long keys ("tp_degree" -> "tp"); prefer the longest contained name.
    contained = [n for n in names if n in key.lower()]
    return max(contained, key=len) if contained else None


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))

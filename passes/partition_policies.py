"""Pipeline partition policies: where each pipeline stage begins.

The model's layers, in execution order, arrive as a list of ``Unit``s; a policy
(the value of ``Strategy.partition``) turns them into the start index of every
stage, so that stage ``k`` is ``units[bounds[k]:bounds[k + 1]]``. A unit is the
granularity of partitioning: no cut falls inside one. It is one child of an
``nn.ModuleList`` / ``nn.Sequential`` with everything inside it (a transformer
block), or any other module that runs ops (an embedding, a final norm, an LM
head); passes/partition_stages.py extracts them. These are pure functions:
extracting units from the traced graph and applying the result live elsewhere.

Policies:

* ``"uniform"``: balance the number of repeated units (children of an
  ``nn.ModuleList`` / ``nn.Sequential``, "the model's repeated blocks"). With
  no repeated units every unit counts 1.
* ``"parameters"``: balance the parameter elements each stage holds (DeepSpeed's
  ``partition_balanced``). A stage holds every parameter its units read, so a
  tied weight (an embedding shared with the LM head) counts on every stage that
  reads it, and once within a stage however many of its units read it.
* ``"type:<regex>"``: balance the units whose class name matches the regex
  (``re.search``, case-insensitive, as DeepSpeed does).
* ``"profile"``: balance the measured ``seconds``.
* a list of module paths: stage ``k`` (``k >= 1``) begins at the first unit whose
  path is ``paths[k - 1]`` or lies under it.

Balancing is exact: it returns a contiguous partition whose heaviest stage is as
light as possible (a stage weighs the sum of its units' weights, plus each tied
weight it reads, once), every stage holding at least one unit. Ties are broken
deterministically: among all optimal partitions the one whose boundaries are
all as LATE as possible is returned. Such a partition exists and is unique (see
``balance``), and it keeps zero-weight units (ReLU, Dropout, pooling, norms) with
the layer before them rather than pushing them to the start of the next stage.

Weights are compared exactly: ints stay ints and floats (``seconds``) are
scaled to exact ints, so rounding can never change which partition wins.
"""

from __future__ import annotations

import bisect
import difflib
import math
import numbers
import re
from collections import Counter
from collections.abc import Sequence
from typing import Any

from graphpar.ir.compiled import Unit
from graphpar.errors import invalid, is_int_at_least
from graphpar.strategy import TYPE_PREFIX, check_partition_policy, invalid_setting

__all__ = ["Unit", "partition", "balance", "unit_weights", "describe_partition"]



# --------------------------------------------------------------------------- #
# Public entry points
# --------------------------------------------------------------------------- #


def partition(units: Sequence[Unit], stages: int, policy: Any) -> list[int]:
    """Return the start index of each of ``stages`` stages in ``units``.

    The result has length ``stages``, begins with 0 and strictly increases.
    ``policy`` is a ``Strategy.partition`` value; see the module docstring.
    Raises ``ValueError`` with a ``Fix:`` for every misuse.
    """
    units = list(units)
    _check_stages(units, stages)
    if isinstance(policy, (list, tuple)):
        return _explicit_bounds(units, stages, policy)
    return _balanced(_stage_weight(units, policy).exact(), stages)


def unit_weights(units: Sequence[Unit], policy: str) -> list[int] | list[float]:
    """The weight of every unit under a named policy (not a path list). Under
    ``"parameters"`` the tied weights are left out: a stage adds each one it reads once."""
    if not isinstance(policy, str):
        raise invalid_setting(
            f"partition={policy!r}",
            f"a partition policy is a str or a list of module paths, got {type(policy).__name__}",
            "use partition='parameters' (the default)",
        )
    check_partition_policy(policy)
    if policy == "uniform":
        return _uniform_weights(units)
    if policy == "parameters":
        return _parameter_weights(units)
    if policy == "profile":
        return _profile_weights(units)
    return _type_weights(units, policy[len(TYPE_PREFIX):])  # the one policy left (check_partition_policy)


def balance(weights: Sequence[int | float], stages: int) -> list[int]:
    """Split ``weights`` into ``stages`` non-empty contiguous runs minimising the heaviest run.

    Returns the start index of each run. Among optimal splits the one with every
    boundary as late as possible is returned. It is well defined because for a
    cap ``B`` the greedy split that lets each stage take as many units as fit
    under ``B`` (leaving one unit for each later stage) has every boundary at or
    after the matching boundary of ANY split whose stages all weigh <= B:
    induction on the boundary, using that weights are non-negative, so a stage
    starting later but ending at the other split's end weighs no more. With
    ``B`` the optimum, greedy is therefore the component-wise latest optimal split.

    The optimum is the smallest ``B`` for which greedy succeeds, found by binary
    search over exact integer weights: O(log(total) * stages * log(n) * (1 + tied weights)).

    All of this holds for any stage weight that never grows when a run shrinks,
    so ``partition`` balances tied weights (counted once per stage) the same way.
    """
    return _balanced(_StageWeight(_exact_ints(weights)), stages)


def describe_partition(units: Sequence[Unit], bounds: Sequence[int], policy: Any) -> str:
    """A small table of the stages, for printing the resulting balance."""
    units = list(units)
    _check_bounds(units, bounds)
    weight = None if isinstance(policy, (list, tuple)) else _stage_weight(units, policy)
    held = _stage_weight(units, "parameters")
    ends = list(bounds[1:]) + [len(units)]
    loads = None if weight is None else [weight(a, b) for a, b in zip(bounds, ends)]
    rows = [_stage_row(k, units, start, end, held(start, end), None if loads is None else loads[k])
            for k, (start, end) in enumerate(zip(bounds, ends))]
    header = ("stage", "units", "first", "last", "count", "params", "weight")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [f"partition {_policy_name(policy)} into {len(bounds)} stage(s) over {len(units)} units"]
    lines += ["  ".join(cell.ljust(w) if i in (1, 2, 3) else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
              for row in [header, *rows]]
    if loads is not None:
        lines.append(_imbalance_line(loads))
    return "\n".join(lines)


# --------------------------------------------------------------------------- #
# Balancing
# --------------------------------------------------------------------------- #


def _exact_ints(values: Sequence[int | float]) -> list[int]:
    # A finite float is m / 2**e exactly; scaling every value by the largest 2**e
    # turns them all into ints with the same ratios, so sums compare exactly and
    # rounding cannot flip a tie.
    ratios = []
    for i, v in enumerate(values):
        if isinstance(v, numbers.Integral) and not isinstance(v, bool):
            v = int(v)  # numpy ints too
        elif isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v):
            v = float(v)
        else:
            raise ValueError(f"weight {i} is {v!r}; weights must be finite, non-negative numbers")
        if v < 0:
            raise ValueError(f"weight {i} is {v!r}; weights must be finite, non-negative numbers")
        ratios.append(v.as_integer_ratio())
    if not ratios:
        raise ValueError("cannot partition an empty list of weights")
    scale = max(den for _, den in ratios)
    return [num * (scale // den) for num, den in ratios]


class _StageWeight:
    """The weight of a run of units ``[start, end)``: the sum of their own weights plus
    the size of every tied weight (``(size, indices of the units reading it)``) that one
    of them reads, once. It never grows when the run shrinks, which ``balance`` needs."""

    def __init__(self, weights: Sequence[int | float], tied: Sequence[tuple[int, Sequence[int]]] = ()):
        self.weights = list(weights)
        self.tied = [(size, sorted(readers)) for size, readers in tied]
        self.prefix = [0]
        for w in self.weights:
            self.prefix.append(self.prefix[-1] + w)

    def __len__(self) -> int:
        return len(self.weights)

    def __call__(self, start: int, end: int) -> int | float:
        total = self.prefix[end] - self.prefix[start]
        for size, readers in self.tied:
            first = bisect.bisect_left(readers, start)
            if first < len(readers) and readers[first] < end:
                total += size
        return total

    def exact(self) -> "_StageWeight":
        """The same weights as exact ints (see ``_exact_ints``), for balancing."""
        exact = _exact_ints(self.weights + [size for size, _ in self.tied])
        n = len(self.weights)
        return _StageWeight(exact[:n], [(size, readers) for size, (_, readers) in zip(exact[n:], self.tied)])


def _balanced(weight: _StageWeight, stages: int) -> list[int]:
    """``balance`` over any ``_StageWeight`` of exact ints (see ``balance`` for why it is optimal)."""
    n = len(weight)
    if not 1 <= stages <= n:
        raise ValueError(f"balance needs 1 <= stages <= len(weights), got stages={stages}, len(weights)={n}")
    total = weight(0, n)  # a tied weight counts at least once, so the stages together weigh >= total
    lo = max(max(weight(i, i + 1) for i in range(n)), -(-total // stages))  # no stage can weigh less
    hi = total
    while lo < hi:
        mid = (lo + hi) // 2
        if _latest_bounds(weight, stages, mid) is None:
            lo = mid + 1
        else:
            hi = mid
    bounds = _latest_bounds(weight, stages, lo)
    assert bounds is not None  # lo == total at worst, which always fits
    return bounds


def _latest_bounds(weight: _StageWeight, stages: int, cap: int) -> list[int] | None:
    """Greedy split under ``cap`` with every boundary as late as possible, or None if none fits."""
    n = len(weight)
    bounds = [0]
    start = 0
    for k in range(1, stages):
        end = _last_end_under(weight, start, n - (stages - k), cap)  # leave a unit for each later stage
        if end <= start:
            return None  # the unit at `start` alone exceeds the cap
        bounds.append(end)
        start = end
    return bounds if weight(start, n) <= cap else None


def _last_end_under(weight: _StageWeight, start: int, limit: int, cap: int) -> int:
    """The largest ``end <= limit`` with ``weight(start, end) <= cap`` (``start`` if none):
    the latest, so trailing zero-weight units join this stage."""
    lo, hi = start, limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if weight(start, mid) <= cap:
            lo = mid
        else:
            hi = mid - 1
    return lo


# --------------------------------------------------------------------------- #
# Weights per policy
# --------------------------------------------------------------------------- #


def _uniform_weights(units: Sequence[Unit]) -> list[int]:
    if not any(u.repeated for u in units):
        # No repeated blocks to balance: fall back to counting units.
        return [1] * len(units)
    return [1 if u.repeated else 0 for u in units]


def _stage_weight(units: Sequence[Unit], policy: str) -> _StageWeight:
    weights = unit_weights(units, policy)
    return _StageWeight(weights, _tied_weights(units) if policy == "parameters" else ())


def _parameter_weights(units: Sequence[Unit]) -> list[int]:
    for u in units:
        if isinstance(u.params, bool) or not isinstance(u.params, int) or u.params < 0:
            raise ValueError(f"unit {u.path!r} has params={u.params!r}; it must be a non-negative int")
    return [u.params - sum(size for _, size in u.tied) for u in units]


def _tied_weights(units: Sequence[Unit]) -> list[tuple[int, list[int]]]:
    """(elements, indices of the units reading it) of every tied weight."""
    readers: dict[str, tuple[int, list[int]]] = {}
    for i, u in enumerate(units):
        for name, size in u.tied:
            readers.setdefault(name, (size, []))[1].append(i)
    return list(readers.values())


def _profile_weights(units: Sequence[Unit]) -> list[float]:
    seconds = []
    for u in units:
        s = u.seconds
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
            raise invalid_setting(
                "partition='profile'",
                f"every unit needs a finite, non-negative measured time, but unit {u.path!r} has seconds={s!r}",
                "re-run the profiling step, or use partition='parameters'",
            )
        seconds.append(float(s))
    if not any(seconds):
        # All zeros means nothing was measured; balancing nothing would be arbitrary.
        raise invalid_setting(
            "partition='profile'",
            f"all {len(units)} units have seconds == 0, so there is no measured time to balance",
            "profile the model first so each unit carries its seconds, or use partition='parameters'",
        )
    return seconds


def _type_weights(units: Sequence[Unit], pattern: str) -> list[int]:
    subject = f"partition={TYPE_PREFIX + pattern!r}"
    # a non-empty regex that compiles (check_partition_policy); case-insensitive, as DeepSpeed's type: policy
    regex = re.compile(pattern, re.IGNORECASE)
    weights = [1 if regex.search(u.module_type) else 0 for u in units]
    if not any(weights):
        present = ", ".join(dict.fromkeys(u.module_type for u in units))
        raise invalid_setting(
            subject,
            f"the regex {pattern!r} matches none of the module types present ({present})",
            f"use a regex that matches the layers to balance, e.g. "
            f"partition={TYPE_PREFIX + _suggest_type(units, pattern)!r}",
        )
    return weights


def _suggest_type(units: Sequence[Unit], pattern: str = "") -> str:
    """A regex worth trying: a near miss of ``pattern``, else the repeated layers' types."""
    types = list(dict.fromkeys(u.module_type for u in units))
    near = difflib.get_close_matches(pattern.lower(), [t.lower() for t in types], n=1) if pattern else []
    if near:
        return next(t for t in types if t.lower() == near[0])
    # Repeated blocks that hold parameters are what users mean to balance (not the
    # ReLUs between them); fall back to any parameterised type, then any type.
    for pool in ([u for u in units if u.repeated and u.params], [u for u in units if u.params], units):
        counts = Counter(u.module_type for u in pool)
        if counts:
            return "|".join(t for t, _ in counts.most_common(3))
    return types[0]


# --------------------------------------------------------------------------- #
# Explicit module-path lists
# --------------------------------------------------------------------------- #


def _explicit_bounds(units: list[Unit], stages: int, paths: Sequence[Any]) -> list[int]:
    subject = f"partition={list(paths)!r}"
    _check_path_count(subject, stages, paths)
    index = _first_index_by_prefix(units)
    starts = [_resolve_path(subject, units, index, path) for path in paths]
    for k, (path, start) in enumerate(zip(paths, starts), start=1):
        if start == 0:
            raise invalid_setting(
                subject,
                f"{path!r} is the first unit, so stage {k} would begin where stage 0 does and stage 0 would be "
                "empty (the list names where stages 1..N-1 begin; stage 0 always begins at the model start)",
                f"drop {path!r} and name a later module",
            )
        if k > 1 and start <= starts[k - 2]:
            raise _out_of_order(subject, units, paths, starts, k)
    return [0, *starts]


def _check_path_count(subject: str, stages: int, paths: Sequence[Any]) -> None:
    need = stages - 1
    if len(paths) == need:
        return
    rule = (f"a list partition names the module where each stage after the first begins, so {stages} stages "
            f"need exactly {need} {'entry' if need == 1 else 'entries'}, got {len(paths)}")
    if need == 0:
        fix = "with a single stage there is nothing to split: pass an empty list or a policy such as 'parameters'"
    elif len(paths) == stages:
        fix = f"drop the first entry ({paths[0]!r}): the first stage always begins at the model start"
    else:
        fix = f"list exactly {need} module paths, or use {len(paths) + 1} stages"
    raise invalid_setting(subject, rule, fix)


def _first_index_by_prefix(units: list[Unit]) -> dict[str, int]:
    # Every path and each of its dotted ancestors maps to the first unit under it,
    # so an entry resolves in O(1) and "blocks.3" also finds "blocks.3.attn".
    index: dict[str, int] = {}
    for i, u in enumerate(units):
        parts = u.path.split(".")
        for j in range(1, len(parts) + 1):
            index.setdefault(".".join(parts[:j]), i)
    return index


def _resolve_path(subject: str, units: list[Unit], index: dict[str, int], path: Any) -> int:
    if not isinstance(path, str) or not path:
        raise invalid_setting(subject, f"every entry must be a non-empty module path string, got {path!r}",
                              "use the dotted names printed by model.named_modules()")
    if path in index:
        return index[path]
    near = difflib.get_close_matches(path, list(index), n=3)
    if near:
        fix = "did you mean " + " or ".join(repr(p) for p in near) + "?"
    else:
        sample = ", ".join(repr(u.path) for u in units[:3])
        fix = f"use one of the unit paths ({sample}, ... {units[-1].path!r})"
    raise invalid_setting(subject, f"{path!r} is not the path of any pipeline unit (nor a module containing one)", fix)


def _out_of_order(subject: str, units: list[Unit], paths: Sequence[str], starts: list[int], k: int) -> ValueError:
    prev, cur = paths[k - 2], paths[k - 1]
    i, j = starts[k - 2], starts[k - 1]
    if i == j:
        return invalid_setting(
            subject,
            f"{prev!r} and {cur!r} both begin at unit {i} ({units[i].path!r}), which would leave a stage empty",
            "drop one of them and name another module",
        )
    ordered = [p for _, p in sorted(zip(starts, paths))]
    return invalid_setting(
        subject,
        f"entries must follow execution order, but {cur!r} (unit {j}) comes before {prev!r} (unit {i})",
        f"reorder them: partition={ordered!r}",
    )


# --------------------------------------------------------------------------- #
# Checks and reporting helpers
# --------------------------------------------------------------------------- #


def _check_stages(units: list[Unit], stages: Any) -> None:
    if not is_int_at_least(stages, 1):
        raise invalid(f"stages={stages!r}", "the number of pipeline stages must be an int >= 1",
                      "pass pp * virtual_stages")
    if not units:
        raise ValueError("cannot partition a model with no units (no layers were found). "
                         "Fix: check that the model has modules with parameters, or use pp=1")
    if len(units) < stages:
        raise invalid(f"stages={stages} with {len(units)} units",
                      f"every pipeline stage needs at least one unit, so {len(units)} units fill at most "
                      f"{len(units)} stages", f"use at most {len(units)} stages (lower pp or virtual_stages)")


def _check_bounds(units: list[Unit], bounds: Sequence[int]) -> None:
    ok = (len(bounds) >= 1 and bounds[0] == 0 and all(a < b for a, b in zip(bounds, bounds[1:]))
          and bounds[-1] < len(units))
    if not ok:
        raise ValueError(f"bounds={list(bounds)!r} is invalid for {len(units)} units: it must start at 0 and "
                         f"strictly increase below {len(units)}. Fix: pass the list returned by partition()")


def _policy_name(policy: Any) -> str:
    return f"by paths {list(policy)!r}" if isinstance(policy, (list, tuple)) else f"by {policy!r}"


def _stage_row(k: int, units: list[Unit], start: int, end: int, params: int,
               load: int | float | None) -> tuple[str, ...]:
    return (
        str(k),
        f"{start}-{end - 1}",
        units[start].path,
        units[end - 1].path,
        str(end - start),
        f"{params:,}",
        "-" if load is None else _fmt_weight(load),
    )


def _fmt_weight(w: int | float) -> str:
    return f"{w:,}" if isinstance(w, int) else f"{w:.4g}"


def _imbalance_line(loads: list) -> str:
    mean = sum(loads) / len(loads)
    heaviest = max(range(len(loads)), key=loads.__getitem__)
    ratio = f"{loads[heaviest] / mean:.2f}x the mean" if mean else "all stages weigh 0"
    return f"heaviest: stage {heaviest} with weight {_fmt_weight(loads[heaviest])} ({ratio})"

"""How graphpar refuses bad input: one message form naming the value, the rule and a fix.

    invalid("Strategy.pp=0", "pp must be a positive int", "use pp=1")
    -> ValueError("Strategy.pp=0 is invalid: pp must be a positive int. Fix: use pp=1.")

Every module that validates arguments words its refusals through these helpers, so the
form is written once (docs/errors.md lists the messages).
"""
from __future__ import annotations

import difflib
import numbers
from typing import Any, Optional, Sequence


def invalid(subject: str, rule: str, fix: str, owner: str = "") -> ValueError:
    """The error for `subject` (what the user wrote, e.g. "schedule='1F1B'") breaking `rule`;
    `owner` names where the value was given (e.g. "Strategy.")."""
    return ValueError(f"{owner}{subject} is invalid: {rule}. Fix: {fix.rstrip('.')}.")


def closest(word: str, choices: Sequence[str]) -> Optional[str]:
    """The choice nearest to `word`, compared case- and whitespace-insensitively ("1F1B",
    "gpipe " are near misses), in its canonical spelling; None when none is near."""
    lowered = {c.lower(): c for c in choices}
    hits = difflib.get_close_matches(word.strip().lower(), list(lowered), n=1, cutoff=0.6)
    return lowered[hits[0]] if hits else None


def is_int_at_least(value: Any, minimum: int) -> bool:
    """An int >= `minimum` (numpy ints count; a bool does not: pp=True is a bug, not 1)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= minimum

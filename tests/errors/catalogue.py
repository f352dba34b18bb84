"""What every catalogue file in tests/errors/ shares: the `case` registrar and `test_entry` of
an area file, `expect` (and `expect_untouched`) to check a message, and the ids of
docs/errors.md that tests/errors/test_catalogue.py compares with the cases of every area."""
from __future__ import annotations

import pathlib
import re

import pytest
import torch

from tests.errors.models import mlp


DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "errors.md"
# Sections other engineers append and own; their rows need no id here.
OTHERS_SECTIONS = ("Checkpoints", "Faults")


def registrar(cases):
    """The @case(entry_id) decorator of one area file: it registers the decorated function as
    the test of that catalogue id in the file's `cases`."""
    def case(entry_id):
        def register(fn):
            assert entry_id not in cases, entry_id
            cases[entry_id] = fn
            return fn
        return register
    return case


def entry_test(cases):
    """The `test_entry` of an area file, made once all its cases are registered: one run per id.
    A case's arguments are pytest fixtures, or `messages`: this entry's message on each rank of
    the two-rank run (tests/errors/conftest.py)."""
    @pytest.mark.parametrize("entry", sorted(cases))
    def test_entry(entry, request):
        fn = cases[entry]
        names = fn.__code__.co_varnames[:fn.__code__.co_argcount]
        fixtures = {"messages": lambda: [m[entry] for m in request.getfixturevalue("two_rank_messages")]}
        fn(*[fixtures[name]() if name in fixtures else request.getfixturevalue(name) for name in names])
    return test_entry


def expect(exc_type, fn, *patterns) -> str:
    """Run fn, require exc_type, and every regex in patterns in its message."""
    with pytest.raises(exc_type) as info:
        fn()
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message, re.S), f"{pattern!r} not in:\n{message}"
    return message


def expect_on_every_rank(tracebacks, exc_type, *patterns) -> None:
    """expect() for a refusal on launched ranks (tracebacks: one per rank, run_cases'): each
    rank raised exc_type, and its message holds every regex in patterns."""
    for traceback in tracebacks:
        heading = f"\n{exc_type.__name__}: "
        assert heading in traceback, f"no {exc_type.__name__} in:\n{traceback}"
        message = traceback.rsplit(heading, 1)[1]
        for pattern in patterns:
            assert re.search(pattern, message, re.S), f"{pattern!r} not in:\n{message}"


def expect_untouched(exc_type, call, *patterns, model=None) -> str:
    """expect() for call(model): the refused compile left the model's weights, buffers and
    training flags as they were (checked on a model in eval mode, so a flag set is seen)."""
    model = (model or mlp()).eval()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    message = expect(exc_type, lambda: call(model), *patterns)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert not any(m.training for m in model.modules())
    return message


def doc_ids():
    """(ids of every table row in the sections the catalogue tests cover, rows there without an id)."""
    ids, missing, section = [], [], ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:]
        if not line.startswith("| ") or line.startswith("| id ") or any(s in section for s in OTHERS_SECTIONS):
            continue
        match = re.match(r"\| `(E-[a-z0-9-]+)` \|", line)
        if match:
            ids.append(match.group(1))
        elif not line.startswith("| message start"):
            missing.append(line[:80])
    return ids, missing

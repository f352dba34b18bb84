"""The bad-input catalogue (docs/errors.md) and its tests correspond one to one: every row of
the doc has a unique id, and the ids are the same set as the cases of the area files
(tests/errors/test_*_errors.py), so neither can drift from the other."""
from __future__ import annotations

import importlib
import pathlib

from tests.errors.catalogue import doc_ids


AREA_FILES = "test_*_errors.py"


def every_case():
    """{catalogue id: case} gathered from every area file; no id may be registered by two."""
    cases = {}
    for path in sorted(pathlib.Path(__file__).parent.glob(AREA_FILES)):
        area = importlib.import_module(f"tests.errors.{path.stem}")
        twice = set(cases) & set(area.CASES)
        assert not twice, f"{path.name} registers ids another area file registers too: {sorted(twice)}"
        cases.update(area.CASES)
    return cases


CASES = every_case()


def test_every_catalogue_row_has_an_id_and_ids_are_unique():
    ids, missing = doc_ids()
    assert not missing, f"rows of docs/errors.md without an id: {missing}"
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)


def test_catalogue_and_tests_name_the_same_entries():
    ids = set(doc_ids()[0])
    assert not ids - set(CASES), f"catalogue entries with no test: {sorted(ids - set(CASES))}"
    assert not set(CASES) - ids, f"tests of entries missing from docs/errors.md: {sorted(set(CASES) - ids)}"

"""`graphpar demo` run as a user runs it: a separate process that trains on 8 ranks
(dp2 x tp2 x pp2), checks parity and writes its outputs."""
from __future__ import annotations

import importlib.util
import json

from tests.unit.tools.test_cli import graphpar_cli


HAS_DUMP = importlib.util.find_spec("graphpar.ir.printer") is not None


def test_demo_trains_checks_parity_and_writes_its_outputs(tmp_path):
    out = tmp_path / "demo"
    result = graphpar_cli("demo", "--steps", "3", "--check-steps", "2", "--out", str(out))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "parity: PASS" in result.stdout
    assert str(out.resolve()) in result.stdout.splitlines()[-1]
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["losses"]) == 3
    assert summary["parity"]["passed"] and summary["parity"]["steps"] == 2
    assert summary["tokens_per_s"] > 0
    if HAS_DUMP:
        assert list((out / "dumps" / "rank0").glob("*.py"))

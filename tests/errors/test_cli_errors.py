"""docs/errors.md, Command line (graphpar/tools/cli.py):
every entry triggered here and its message checked for the value it names, the rule
and the fix (tests/errors/test_catalogue.py checks that the doc and the cases agree)."""
from __future__ import annotations

from tests.errors.catalogue import entry_test, registrar


CASES = {}
case = registrar(CASES)


def cli(capsys, *argv):
    from graphpar.tools.cli import main
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    return code, capsys.readouterr().err


@case("E-cli-user-error")
def _(capsys):
    code, err = cli(capsys, "plan", "--tp", "3", "--layers", "1")
    assert code == 1
    assert err.startswith("graphpar plan: error: tp=3 does not divide") and "Fix:" in err
    assert "Traceback" not in err


@case("E-cli-n-embd")
def _(capsys):
    code, err = cli(capsys, "plan", "--n-embd", "30")
    assert code == 2 and "--n-embd 30 must be a multiple of the 4 attention heads; try --n-embd 32" in err


@case("E-cli-batch-dp")
def _(capsys):
    code, err = cli(capsys, "plan", "--batch-size", "5", "--dp", "2")
    assert code == 2 and "--batch-size 5 must split evenly over --dp 2 ranks; try --batch-size 6" in err


@case("E-cli-model-spec")
def _(capsys, tmp_path):
    code, err = cli(capsys, "dump", "nocolon", "--out", str(tmp_path))
    assert code == 1 and "MODEL_SPEC 'nocolon' is neither 'gpt' nor 'module.path:factory'" in err and "Fix:" in err
    code, err = cli(capsys, "dump", "tests.no_such_module:factory", "--out", str(tmp_path))
    assert code == 1 and "could not be imported" in err


test_entry = entry_test(CASES)

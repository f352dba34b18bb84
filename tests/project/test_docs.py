"""The docs describe the pass pipeline that really runs, and their examples print what they show.

Every list of pass names printed in docs/ or the README must be what `gp.list_passes()`
returns for the default strategy, the data-flow picture in docs/architecture.md must name
every built-in pass in order, and the worked example of docs/writing-a-pass.md must print
exactly the output the page shows (it places user passes, so it checks the anchoring
rules the page states), and so must the planner's example in docs/planner.md."""
import ast
import os
import pathlib
import re
import subprocess
import sys

import pytest

import graphpar as gp

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# A printed pass list always starts with the first built-in pass.
PASS_LIST = re.compile(r"\['trace'(?:, '[a-z_]+')*\]")
# Names of the worked example's own passes; lists holding them are checked by running it.
EXAMPLE_PASSES = {"count_linears", "scale_logits"}


def _printed_builtin_pass_lists():
    """(where, names) of every printed pass list without the worked example's own passes."""
    for path in DOCS:
        for line_no, line in enumerate(path.read_text().splitlines(), 1):
            for match in PASS_LIST.finditer(line):
                names = ast.literal_eval(match.group(0))
                if not EXAMPLE_PASSES & set(names):
                    yield f"{path.name}:{line_no}", names


PRINTED = list(_printed_builtin_pass_lists())


def test_docs_show_pass_lists():
    assert len(PRINTED) >= 2  # docs/passes.md and the quick start in docs/architecture.md


@pytest.mark.parametrize("where,names", PRINTED, ids=[where for where, _ in PRINTED])
def test_printed_pass_list_is_the_real_pipeline(where, names):
    assert names == gp.list_passes(gp.Strategy()), f"{where} shows an outdated pass list"


def test_architecture_data_flow_names_every_builtin_pass_in_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    flow = text[text.index("## Data flow"):]
    flow = flow[:flow.index("PipelineResult(")]
    # pass rows of the picture: three spaces, the pass name, then its description
    named = re.findall(r"^   ([a-z_]+) {2,}\S", flow, re.M)
    assert named == gp.list_passes(gp.Strategy())


def _code_blocks_by_file(text):
    return dict((name, code) for code, name in
                re.findall(r"```python\n(# file: (\S+)\n.*?)```", text, re.S))


def _shown_output(text, after):
    """The first ```text block after position `after`."""
    start = text.index("```text\n", after) + len("```text\n")
    return text[start:text.index("```", start)]


def _run(tmp_path, script):
    run = subprocess.run([sys.executable, script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    return run.stdout


def test_planner_example_prints_what_the_page_shows(tmp_path):
    text = (ROOT / "docs" / "planner.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    (tmp_path / "plan_example.py").write_text(text[start:text.index("```", start)])
    assert _run(tmp_path, "plan_example.py") == _shown_output(text, start)


def test_writing_a_pass_example_prints_what_the_page_shows(tmp_path):
    text = (ROOT / "docs" / "writing-a-pass.md").read_text()
    for name, code in _code_blocks_by_file(text).items():
        (tmp_path / name).write_text(code)
    assert _run(tmp_path, "train.py") == _shown_output(text, text.index("Output of `python train.py`:"))

"""The package layout, derived from the tree; metadata and dependencies are in setup.cfg.

graphpar/ holds the package and its subpackages. The built-in passes live at the top of
the repository in passes/ (one pass per file) and are installed as graphpar.passes. setup.cfg
cannot express that mapping for subpackages found later (passes/tp/ must become
graphpar.passes.tp), so the lists are computed here: a new subpackage with an __init__.py
ships with no edit (tests/project/test_packaging.py checks the built wheel against the tree).
"""

from setuptools import find_packages, setup

PASSES_PACKAGE = "graphpar.passes"
PASSES_DIR = "passes"

passes_subpackages = [f"{PASSES_PACKAGE}.{name}" for name in find_packages(PASSES_DIR)]

setup(
    packages=find_packages(include=["graphpar", "graphpar.*"]) + [PASSES_PACKAGE] + passes_subpackages,
    # One entry covers the subpackages too: setuptools resolves graphpar.passes.tp to
    # passes/tp through its parent's directory.
    package_dir={PASSES_PACKAGE: PASSES_DIR},
)

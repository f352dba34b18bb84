"""graphpar's pass machinery and built-in passes, one per file.

This folder sits at the top of the repository and is installed as the subpackage
``graphpar.passes`` (setup.py: ``package_dir={"graphpar.passes": "passes"}``). What a pass
is and sees (Pass, PassContext, the typed PassResults) is context.py; the pipeline order is
the list builtin.default_passes(strategy) returns; the pass manager (registration,
ordering, the requires/produces check, running) is manager.py. Nothing registers itself on
import.
"""

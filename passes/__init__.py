"""graphpar's pass machinery and built-in passes, one per file, in pipeline order.

This folder sits at the top of the repository and is installed as the subpackage
``graphpar.passes`` (setup.py: ``package_dir={"graphpar.passes": "passes"}``). The pass
manager is manager.py; importing graphpar.passes.builtin registers each built-in pass with
it, and builtin.ORDER is the pipeline order (the manager does so on first use of the
pipeline). Importing this package alone registers nothing, so the runtime
can use the analyses here (tp/) without loading every pass.
"""

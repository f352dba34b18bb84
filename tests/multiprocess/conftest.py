"""Fixtures shared by the multiprocess tests."""
import pytest


@pytest.fixture(scope="module")
def directory(request, tmp_path_factory):
    """A directory for one test module's launches to write into (checkpoints, dumps) and its
    tests to read, named after the module."""
    return tmp_path_factory.mktemp(request.module.__name__.rsplit(".", 1)[-1].removeprefix("test_"))

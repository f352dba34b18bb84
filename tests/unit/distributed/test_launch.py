"""graphpar.launch without starting processes: bad arguments refused before any rank starts,
and run_in_process_group outside a launcher."""

import pytest

from graphpar.distributed.launch import launch
from tests.targets import launch_targets as targets


def test_bad_arguments_fail_before_starting():
    with pytest.raises(ValueError, match="module level"):
        launch(lambda: 0, world_size=2)

    def local_fn():
        return 0

    with pytest.raises(ValueError, match="local_fn"):
        launch(local_fn, world_size=2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=f"world_size.*{bad!r}"):
            launch(targets.echo_args, world_size=bad)


def test_run_in_process_group_and_helpers_outside_a_launcher(monkeypatch):
    import torch.distributed as dist

    from graphpar.distributed import groups as gp_dist
    from graphpar.distributed.launch import run_in_process_group

    if dist.is_initialized():
        pytest.skip("another test left a process group initialised")
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    # Without torchrun's variables: a plain single-process call.
    assert run_in_process_group(lambda a, b: (a + b, gp_dist.rank(), gp_dist.world_size()),
                                1, 2) == (3, 0, 1)
    assert not dist.is_initialized()

    # With them (a world of one, as torchrun --nproc-per-node=1 would set).
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(gp_dist.find_free_port()))
    try:
        assert run_in_process_group(lambda: (dist.is_initialized(), gp_dist.world_size())) \
            == (True, 1)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_timeout_env_var(monkeypatch):
    from graphpar.distributed import groups as gp_dist

    monkeypatch.setenv("GRAPHPAR_TIMEOUT_S", "7.5")
    assert gp_dist._timeout_from_env() == 7.5
    monkeypatch.delenv("GRAPHPAR_TIMEOUT_S")
    assert gp_dist._timeout_from_env() == 120.0
    for bad in ("0", "-3", "soon", "nan"):
        monkeypatch.setenv("GRAPHPAR_TIMEOUT_S", bad)
        with pytest.raises(ValueError, match="GRAPHPAR_TIMEOUT_S"):
            gp_dist._timeout_from_env()

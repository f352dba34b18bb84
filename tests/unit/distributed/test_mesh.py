"""graphpar/distributed/mesh.py: the expert-parallel axes inside dp (docs/expert-parallel.md)."""
import pytest

from graphpar.distributed.mesh import Mesh, all_groups_along


def test_ep_groups_are_consecutive_dp_ranks_and_edp_groups_stride_by_ep():
    # the table of docs/expert-parallel.md: dp = 4, ep = 2
    meshes = [Mesh(4, 1, 1, rank, ep=2) for rank in range(4)]
    assert [m.ep_rank for m in meshes] == [0, 1, 0, 1]
    assert [m.ranks_along("ep") for m in meshes] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [m.ranks_along("edp") for m in meshes] == [[0, 2], [1, 3], [0, 2], [1, 3]]


def test_ep_folds_into_dp_times_tp_with_tp_fastest():
    # dp = 2, tp = 2, ep = 4: one ep group over the four ranks of the stage; ep = 2: the two tp
    # ranks of each dp replica, and the edp groups pair the same tp rank of the two replicas
    meshes = [Mesh(2, 2, 1, rank, ep=4) for rank in range(4)]
    assert [m.ep_rank for m in meshes] == [0, 1, 2, 3]
    assert {tuple(m.ranks_along("ep")) for m in meshes} == {(0, 1, 2, 3)}
    assert [m.ranks_along("edp") for m in meshes] == [[0], [1], [2], [3]]
    meshes = [Mesh(2, 2, 1, rank, ep=2) for rank in range(4)]
    assert [m.ranks_along("ep") for m in meshes] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [m.ranks_along("edp") for m in meshes] == [[0, 2], [1, 3], [0, 2], [1, 3]]


@pytest.mark.parametrize("dp, tp, pp, ep", [(4, 2, 1, 2), (4, 1, 2, 4), (8, 1, 1, 2), (2, 2, 2, 2), (2, 2, 2, 4),
                                            (1, 2, 2, 2), (1, 4, 1, 2)])
def test_expert_groups_split_each_stage(dp, tp, pp, ep):
    for axis, size in (("ep", ep), ("edp", dp * tp // ep)):
        groups = all_groups_along(dp, tp, pp, axis, ep)
        assert sorted(r for g in groups for r in g) == list(range(dp * tp * pp))   # each rank in one group
        assert {len(g) for g in groups} == {size}
        for group in groups:   # within one pipeline stage, in rank order
            meshes = [Mesh(dp, tp, pp, r, ep=ep) for r in group]
            assert len({m.pp_rank for m in meshes}) == 1 and group == sorted(group)
            if axis == "ep":   # group rank i is ep rank i (full_state_dict concatenates in that order)
                assert [m.ep_rank for m in meshes] == list(range(ep))
    # an ep group and an edp group meet in exactly one rank
    for rank in range(dp * tp * pp):
        mesh = Mesh(dp, tp, pp, rank, ep=ep)
        assert set(mesh.ranks_along("ep")) & set(mesh.ranks_along("edp")) == {rank}


def test_expert_tp_layout_is_etp_then_ep_then_edp():
    # docs/expert-parallel.md's expert tensor parallelism table: dp = 4, tp = 2, ep = 2, etp = 2
    meshes = [Mesh(4, 2, 1, rank, ep=2, etp=2) for rank in range(8)]
    assert [m.ep_rank for m in meshes] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [m.edp_rank for m in meshes] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [m.ranks_along("ep") for m in meshes[:4]] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [m.ranks_along("edp") for m in meshes[:4]] == [[0, 4], [1, 5], [2, 6], [3, 7]]


@pytest.mark.parametrize("dp, tp, pp, ep", [(2, 2, 1, 1), (2, 2, 1, 2), (4, 2, 2, 2), (2, 4, 1, 2), (4, 2, 1, 4)])
def test_expert_tp_groups_keep_one_tp_rank(dp, tp, pp, ep):
    # with etp = tp the ep and edp groups run across dp ranks at one tp rank of one stage, and
    # an ep group, an edp group and the tp group meet in exactly one rank
    for axis, size in (("ep", ep), ("edp", dp // ep)):
        groups = all_groups_along(dp, tp, pp, axis, ep, tp)
        assert sorted(r for g in groups for r in g) == list(range(dp * tp * pp))
        assert {len(g) for g in groups} == {size}
        for group in groups:
            meshes = [Mesh(dp, tp, pp, r, ep=ep, etp=tp) for r in group]
            assert len({(m.pp_rank, m.tp_rank) for m in meshes}) == 1
            if axis == "ep":
                assert [m.ep_rank for m in meshes] == list(range(ep))
    for rank in range(dp * tp * pp):
        mesh = Mesh(dp, tp, pp, rank, ep=ep, etp=tp)
        assert set(mesh.ranks_along("ep")) & set(mesh.ranks_along("edp")) & set(mesh.ranks_along("tp")) == {rank}

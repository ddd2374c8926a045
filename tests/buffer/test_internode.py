"""DeepEP's internode forms on groups of several nodes: one host split into nodes by MOE_COMM_RANKS_PER_NODE
(2 nodes of 2 ranks, 2 of 3 on every transport and backend), and 16 ranks as two 8-rank nodes, as
DeepEP's test_internode runs."""
import pytest

from helpers.internode_cases import internode, zero_token_rank
from helpers.tiers import exhaustive
from helpers.transports import local_world

_SHM_RUN: dict = {}


@pytest.mark.parametrize("world_size,ranks_per_node", [exhaustive(4, 2), (6, 3)])  # 4 of 2: below
def test_internode_forms(worlds, world_size, ranks_per_node):
    results = worlds(world_size).run(internode, ranks_per_node, 37, 256, 4, 2 * world_size)
    assert [r["checks"] for r in results] == [10] * world_size


@pytest.mark.every_transport
def test_internode_forms_are_the_same_on_every_transport(worlds, transport):
    """Outputs are bitwise equal across transports and backends (compared with the shm run)."""
    results = worlds(4).run(internode, 2, 29, 128, 3, 8)
    if "shm" not in _SHM_RUN:  # one shm run serves every transport's comparison
        with local_world(4, "shm", timeout_s=120, threads_per_rank=1) as shm:
            _SHM_RUN["shm"] = shm.run(internode, 2, 29, 128, 3, 8)
    assert [r["digest"] for r in results] == [r["digest"] for r in _SHM_RUN["shm"]]


@pytest.mark.exhaustive  # 16 processes: half a minute on 2 cores
def test_sixteen_ranks_are_two_nodes_of_eight():
    """DeepEP's shape: more than 8 ranks make nodes of 8 (no MOE_COMM_RANKS_PER_NODE)."""
    with local_world(16, "shm", timeout_s=300, threads_per_rank=1) as world:
        results = world.run(internode, None, 24, 128, 4, 32, 4)
    assert [r["checks"] for r in results] == [10] * 16


@pytest.mark.every_transport
def test_a_rank_without_tokens_on_two_nodes(worlds, transport):
    """Found through ElasticBuffer: on shm (and cuda_host, over shm), a rank sending no rows took its rows
    from the other node as 1-byte rows, and the internode handle's exchange read garbage."""
    results = worlds(4).run(zero_token_rank, 2)
    assert all(r["combined"] for r in results), results
    assert sum(r["received"] for r in results) > 0

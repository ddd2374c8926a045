"""Which ranks of a group share a node, and DeepEP's view of it: NVLink domains of up to 8 ranks.

DeepEP splits a group into ``rdma_rank = rank // 8`` (the node) and ``nvl_rank = rank % 8`` (the GPU
inside it), and uses its internode forms (``num_tokens_per_rdma_rank``, the 10-tuple handle, the
two-level combine sum) whenever that gives more than one node. moe-comm does the same with the
nodes it sees: the ranks of one host form a node (split further only where ``MOE_COMM_RANKS_PER_NODE``
makes one machine stand for several); a node holds at most ``NUM_MAX_NVL_PEERS`` ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from . import env
from .config import NUM_MAX_NVL_PEERS

__all__ = ["Topology", "split_nodes"]


def split_nodes(hosts: Sequence[int], global_ranks: Optional[Sequence[int]]) -> list[list[int]]:
    """The group's ranks split into nodes, in order of their first rank: the same host (``hosts[r]``,
    a host id per rank) and, when ``MOE_COMM_RANKS_PER_NODE`` is set and ``global_ranks`` (the ranks' places
    in the launcher's world; None when the group is not the whole world) is given, the same
    ``global_ranks[r] // MOE_COMM_RANKS_PER_NODE`` (one host standing for several)."""
    per_node = env.ranks_per_node()
    blocks = [0] * len(hosts)
    if per_node and global_ranks is not None:
        blocks = [g // per_node for g in global_ranks]
    nodes: dict[tuple[int, int], list[int]] = {}
    for r, key in enumerate(zip(hosts, blocks)):
        nodes.setdefault(key, []).append(r)
    return list(nodes.values())


@dataclass(frozen=True)
class Topology:
    """DeepEP's node split of ``num_ranks`` ranks: node ``rank // ranks_per_node``, the last one
    possibly smaller."""

    num_ranks: int
    ranks_per_node: int

    @staticmethod
    def of(nodes: Sequence[Sequence[int]]) -> "Topology":
        """From the nodes a transport sees (``split_nodes``): when there are several, all of one size
        and each a block of consecutive ranks, a node is one of them (cut to 8 ranks); otherwise
        DeepEP's rule, nodes of 8 consecutive ranks (one node for 8 ranks or fewer)."""
        num_ranks = sum(len(n) for n in nodes)
        size = len(nodes[0])
        uniform = all(list(n) == list(range(i * size, (i + 1) * size)) for i, n in enumerate(nodes))
        if len(nodes) > 1 and uniform:
            return Topology(num_ranks, min(size, NUM_MAX_NVL_PEERS))
        return Topology(num_ranks, min(num_ranks, NUM_MAX_NVL_PEERS))

    @property
    def num_nodes(self) -> int:
        """DeepEP's ``num_rdma_ranks``."""
        return -(-self.num_ranks // self.ranks_per_node)

    @property
    def internode(self) -> bool:
        """Whether DeepEP's internode forms apply (more than one node)."""
        return self.num_nodes > 1

    def node_of(self, rank: int) -> int:
        """DeepEP's ``rdma_rank`` of ``rank``."""
        return rank // self.ranks_per_node

    def local_of(self, rank: int) -> int:
        """DeepEP's ``nvl_rank`` of ``rank``: its index inside its node."""
        return rank % self.ranks_per_node

    def rank_at(self, node: int, local: int) -> Optional[int]:
        """The rank at ``(node, local)``, or None where the last node is smaller."""
        rank = node * self.ranks_per_node + local
        return rank if rank < self.num_ranks else None

"""DeepEP's internode bookkeeping of normal mode, for groups of several nodes (``core.topology``):
the per-node token counts and channel prefixes, the node bits of each token and the ring positions of
forwarded tokens. Pure functions of the routing; ``backends.portable.internode`` exchanges them."""
from __future__ import annotations

from typing import Optional

import torch

from ..core.checks import check_tensor
from ..core.errors import bad_argument
from ..core.topology import Topology
from ..ops.layout import token_channels

__all__ = ["check_tokens_per_node", "forward_bits", "in_node", "node_bits", "rdma_channel_prefix",
           "ring_positions", "tokens_per_node"]


def in_node(is_token_in_rank: torch.Tensor, topology: Topology) -> torch.Tensor:
    """``[T, Rn, L]`` bool: token t goes to local rank l of node n (False past the last node's end)."""
    num_tokens, num_ranks = is_token_in_rank.shape
    padded = torch.zeros(num_tokens, topology.num_nodes * topology.ranks_per_node, dtype=torch.bool,
                         device=is_token_in_rank.device)
    padded[:, :num_ranks] = is_token_in_rank
    return padded.view(num_tokens, topology.num_nodes, topology.ranks_per_node)


def node_bits(in_node: torch.Tensor) -> torch.Tensor:
    """``[T, Rn]`` int64: DeepEP's ``is_token_in_nvl_rank_bits`` of each token for each node."""
    weights = 1 << torch.arange(in_node.shape[2], dtype=torch.int64, device=in_node.device)
    return (in_node.to(torch.int64) * weights).sum(2)


def tokens_per_node(is_token_in_rank: torch.Tensor, topology: Topology) -> torch.Tensor:
    """``[Rn]`` int32: DeepEP's ``num_tokens_per_rdma_rank``, tokens with a destination in each node
    (a token counts once per node)."""
    return in_node(is_token_in_rank, topology).any(2).sum(0).to(torch.int32)


def rdma_channel_prefix(is_token_in_rank: torch.Tensor, topology: Topology, num_channels: int) -> torch.Tensor:
    """``[Rn, C]`` int64 on the CPU: DeepEP's ``rdma_channel_prefix_matrix``, tokens with a destination
    in node n from channels 0..c (a token counts once per node)."""
    in_rank = is_token_in_rank.cpu()
    to_node = in_node(in_rank, topology).any(2)
    pairs = torch.nonzero(to_node)
    channel = token_channels(in_rank.shape[0], num_channels, torch.device("cpu"))
    flat = pairs[:, 1] * num_channels + channel[pairs[:, 0]]
    return torch.bincount(flat, minlength=topology.num_nodes * num_channels).view(
        topology.num_nodes, num_channels).cumsum(1)


def forward_bits(send_nvl_head: torch.Tensor, ranks_per_node: int) -> torch.Tensor:
    """``[N_rdma]`` int32 on the CPU: for each token a rank forwards (``send_nvl_head``'s rows), bit l set
    when it goes to local rank l of the forwarder's node."""
    member = send_nvl_head.cpu()[:, :ranks_per_node] >= 0
    return (member.to(torch.int32) << torch.arange(ranks_per_node, dtype=torch.int32)).sum(1, dtype=torch.int32)


def ring_positions(channel: torch.Tensor, member: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[N, K]`` int32: for each row and column k where ``member`` is set, how many earlier rows of the
    same channel have it set (a ring position inside the channel); -1 elsewhere."""
    one_hot = torch.nn.functional.one_hot(channel, num_channels).to(torch.int64)  # [N, C]
    counts = member.to(torch.int64).unsqueeze(1) * one_hot.unsqueeze(2)          # [N, C, K]
    before = (counts.cumsum(0) - counts).gather(1, channel.view(-1, 1, 1).expand(-1, 1, member.shape[1]))
    return torch.where(member, before.squeeze(1), -1).to(torch.int32)


def check_tokens_per_node(op: str, given: Optional[torch.Tensor], is_token_in_rank: torch.Tensor,
                          topology: Topology) -> None:
    """Checks a caller's ``num_tokens_per_rdma_rank`` against the routing (internode groups)."""
    if given is None:
        return
    check_tensor(op, "num_tokens_per_rdma_rank", given, shape=(topology.num_nodes,), dtype=torch.int32)
    expected = tokens_per_node(is_token_in_rank, topology)
    if not torch.equal(given.cpu(), expected):
        bad_argument(op, "num_tokens_per_rdma_rank", f"the tokens routed to each node by is_token_in_rank "
                     f"({expected.tolist()})", given.tolist())

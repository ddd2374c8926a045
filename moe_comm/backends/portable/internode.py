"""DeepEP's internode forms of normal mode, for groups of several nodes (``topology.Topology``).

DeepEP sends a token across the network once per destination node, to the rank with the sender's
local index there (the forwarder), which passes it to the destination ranks of its node. Its handle
records that route. moe-comm moves rows directly, in the same order (blocks by global source rank,
tokens ascending), and computes the route's bookkeeping with DeepEP's meanings, so code that reads
the 10-tuple finds what it expects:

    is_token_in_rank [T, R] bool            rdma_channel_prefix_matrix [Rn, C] int32
    gbl_channel_prefix_matrix [R, C] int32  recv_rdma_channel_prefix_matrix [Rn, C] int32
    recv_rdma_rank_prefix_sum [Rn] int32    recv_gbl_channel_prefix_matrix [R, C] int32
    recv_gbl_rank_prefix_sum [R] int32      recv_src_meta [N, 8] uint8
    send_rdma_head [T, Rn] int32            send_nvl_head [N_rdma, 8] int32

Where DeepEP's values depend on arrival order (ring slots shared by several source nodes), the
order here is source node ascending, then token ascending: the fields are deterministic.
"""
from __future__ import annotations

from typing import Optional

import torch

from ...checks import check_tensor
from ...config import NUM_MAX_NVL_PEERS
from ...errors import bad_argument
from ...handle import InternodeFields, NormalHandle
from ...ops.layout import token_channels
from ...topology import Topology
from ...transport import Transport

__all__ = ["attach_internode", "check_tokens_per_node", "forward_bits", "rdma_channel_prefix", "tokens_per_node"]


def _in_node(is_token_in_rank: torch.Tensor, topology: Topology) -> torch.Tensor:
    """``[T, Rn, L]`` bool: token t goes to local rank l of node n (False past the last node's end)."""
    num_tokens, num_ranks = is_token_in_rank.shape
    padded = torch.zeros(num_tokens, topology.num_nodes * topology.ranks_per_node, dtype=torch.bool,
                         device=is_token_in_rank.device)
    padded[:, :num_ranks] = is_token_in_rank
    return padded.view(num_tokens, topology.num_nodes, topology.ranks_per_node)


def _node_bits(in_node: torch.Tensor) -> torch.Tensor:
    """``[T, Rn]`` int64: DeepEP's ``is_token_in_nvl_rank_bits`` of each token for each node."""
    weights = 1 << torch.arange(in_node.shape[2], dtype=torch.int64, device=in_node.device)
    return (in_node.to(torch.int64) * weights).sum(2)


def tokens_per_node(is_token_in_rank: torch.Tensor, topology: Topology) -> torch.Tensor:
    """``[Rn]`` int32: DeepEP's ``num_tokens_per_rdma_rank``, tokens with a destination in each node
    (a token counts once per node)."""
    return _in_node(is_token_in_rank, topology).any(2).sum(0).to(torch.int32)


def rdma_channel_prefix(is_token_in_rank: torch.Tensor, topology: Topology, num_channels: int) -> torch.Tensor:
    """``[Rn, C]`` int64 on the CPU: DeepEP's ``rdma_channel_prefix_matrix``, tokens with a destination
    in node n from channels 0..c (a token counts once per node)."""
    in_rank = is_token_in_rank.cpu()
    to_node = _in_node(in_rank, topology).any(2)
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


def _positions(channel: torch.Tensor, member: torch.Tensor, num_channels: int) -> torch.Tensor:
    """``[N, K]`` int32: for each row and column k where ``member`` is set, how many earlier rows of the
    same channel have it set (a ring position inside the channel); -1 elsewhere."""
    one_hot = torch.nn.functional.one_hot(channel, num_channels).to(torch.int64)  # [N, C]
    counts = member.to(torch.int64).unsqueeze(1) * one_hot.unsqueeze(2)          # [N, C, K]
    before = (counts.cumsum(0) - counts).gather(1, channel.view(-1, 1, 1).expand(-1, 1, member.shape[1]))
    return torch.where(member, before.squeeze(1), -1).to(torch.int32)


def attach_internode(transport: Transport, topology: Topology, handle: NormalHandle, op: str) -> NormalHandle:
    """``handle`` with its internode fields (``handle.InternodeFields``), computed from this rank's
    routing and its peers'. Collective: two small all-to-alls over ``transport`` (sent-side channel
    prefixes per node, then each routed token's node bits), with the transport's deadline."""
    me, R, device = transport.rank, transport.num_ranks, handle.is_token_in_rank.device
    in_rank = handle.is_token_in_rank.cpu()
    num_tokens, C = in_rank.shape[0], handle.channel_prefix_matrix.shape[1]
    Rn, L = topology.num_nodes, topology.ranks_per_node
    my_local = topology.local_of(me)
    in_node = _in_node(in_rank, topology)
    to_node = in_node.any(2)                                                      # [T, Rn]
    bits = _node_bits(in_node)                                                    # [T, Rn]
    channel = token_channels(num_tokens, C, torch.device("cpu"))
    rdma_prefix = rdma_channel_prefix(in_rank, topology, C)                       # [Rn, C]
    send_rdma_head = _positions(channel, to_node, C)

    # 1: to each rank, the channel prefix of the tokens for its node (what its forwarder would read).
    wire = transport.device  # where the transport's small exchanges travel (the GPU over NCCL)
    prefixes = torch.empty(R, C, dtype=torch.int64, device=wire)
    transport.all_to_all(prefixes, rdma_prefix[[topology.node_of(d) for d in range(R)]].to(wire).contiguous(),
                         [1] * R, [1] * R, op=op).wait()
    prefixes = prefixes.cpu()
    forwarded_from = [topology.rank_at(n, my_local) for n in range(Rn)]  # the sources of this rank's forwarding
    recv_rdma_prefix = torch.stack([prefixes[s] if s is not None else torch.zeros(C, dtype=torch.int64)
                                    for s in forwarded_from])                     # [Rn, C]
    forward_counts = recv_rdma_prefix[:, -1].tolist()

    # 2: to each rank d, the node bits of the rows it receives from this rank, then (when d has this
    # rank's local index) each token for d's node as (bits | channel << 8), tokens ascending.
    received = handle.recv_counts(me)
    pieces, in_splits = [], []
    for d in range(R):
        n = topology.node_of(d)
        piece = [bits[in_rank[:, d], n]]
        if topology.local_of(d) == my_local:
            piece.append(bits[to_node[:, n], n] | (channel[to_node[:, n]] << NUM_MAX_NVL_PEERS))
        pieces.append(torch.cat(piece))
        in_splits.append(pieces[-1].numel())
    out_splits = [received[s] + (forward_counts[topology.node_of(s)] if topology.local_of(s) == my_local else 0)
                  for s in range(R)]
    got = torch.empty(sum(out_splits), 1, dtype=torch.int64, device=wire)
    transport.all_to_all(got, torch.cat(pieces).view(-1, 1).to(wire), out_splits, in_splits, op=op).wait()
    got = got.view(-1).cpu()
    row_bits, forwarded = [], {}
    begin = 0
    for s in range(R):
        row_bits.append(got[begin:begin + received[s]])
        if topology.local_of(s) == my_local:
            forwarded[topology.node_of(s)] = got[begin + received[s]:begin + out_splits[s]]
        begin += out_splits[s]

    # recv_src_meta: per received row, (source node, bits for this node) as DeepEP's 8-byte SourceMeta;
    # padding rows (num_worst_tokens) hold node -1 and no bits.
    rows = handle.recv_src_idx.shape[0]
    meta = torch.zeros(rows, 2, dtype=torch.int32)
    meta[:, 0] = -1
    num_recv = sum(received)
    meta[:num_recv, 0] = torch.cat([torch.full((received[s],), topology.node_of(s), dtype=torch.int32)
                                    for s in range(R)])
    meta[:num_recv, 1] = torch.cat(row_bits).to(torch.int32)

    # send_nvl_head: this rank's forwarded tokens (source node ascending, then token), the ring
    # position of each towards each local rank of its node (DeepEP's width: NUM_MAX_NVL_PEERS).
    entries = torch.cat([forwarded.get(n, torch.zeros(0, dtype=torch.int64)) for n in range(Rn)])
    entry_bits = entries & ((1 << NUM_MAX_NVL_PEERS) - 1)
    member = ((entry_bits.view(-1, 1) >> torch.arange(NUM_MAX_NVL_PEERS)) & 1).bool()
    member[:, L:] = False
    send_nvl_head = _positions(entries >> NUM_MAX_NVL_PEERS, member, C)

    prefix = handle.rank_prefix_matrix[:, me].cpu().to(torch.int64)
    starts = prefix - torch.tensor(received, dtype=torch.int64)
    recv_gbl_chan = handle.recv_channel_prefix_matrix.cpu().to(torch.int64) + starts.view(-1, 1)
    fields = InternodeFields(
        rdma_channel_prefix_matrix=rdma_prefix.to(torch.int32).to(device),
        recv_rdma_channel_prefix_matrix=recv_rdma_prefix.to(torch.int32).to(device),
        recv_rdma_rank_prefix_sum=torch.tensor(forward_counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device),
        recv_gbl_channel_prefix_matrix=recv_gbl_chan.to(torch.int32).to(device),
        recv_gbl_rank_prefix_sum=prefix.to(torch.int32).to(device),
        recv_src_meta=meta.view(torch.uint8).view(rows, 8).to(device),
        send_rdma_head=send_rdma_head.to(device),
        send_nvl_head=send_nvl_head.to(device))
    return handle.with_internode(fields)


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

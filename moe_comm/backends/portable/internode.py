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

import torch

from ...core.config import NUM_MAX_NVL_PEERS
from ...core.topology import Topology
from ...ops.layout import token_channels
from ...protocol.handle import InternodeFields, NormalHandle
from ...protocol.internode_layout import in_node as node_members
from ...protocol.internode_layout import node_bits, rdma_channel_prefix, ring_positions
from ...transport import Transport

__all__ = ["attach_internode"]


def attach_internode(transport: Transport, topology: Topology, handle: NormalHandle, op: str) -> NormalHandle:
    """``handle`` with its internode fields (``handle.InternodeFields``), computed from this rank's
    routing and its peers'. Collective: two small all-to-alls over ``transport`` (sent-side channel
    prefixes per node, then each routed token's node bits), with the transport's deadline."""
    me, R, device = transport.rank, transport.num_ranks, handle.is_token_in_rank.device
    in_rank = handle.is_token_in_rank.cpu()
    num_tokens, C = in_rank.shape[0], handle.channel_prefix_matrix.shape[1]
    Rn, L = topology.num_nodes, topology.ranks_per_node
    my_local = topology.local_of(me)
    in_node = node_members(in_rank, topology)
    to_node = in_node.any(2)                                                      # [T, Rn]
    bits = node_bits(in_node)                                                    # [T, Rn]
    channel = token_channels(num_tokens, C, torch.device("cpu"))
    rdma_prefix = rdma_channel_prefix(in_rank, topology, C)                       # [Rn, C]
    send_rdma_head = ring_positions(channel, to_node, C)

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
    send_nvl_head = ring_positions(entries >> NUM_MAX_NVL_PEERS, member, C)

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



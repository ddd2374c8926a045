"""A CPU model of ``torch_mlu_ops``' expert-parallel all-to-all (``moe_all2all_*``), written from its
docstrings and its public callers (vllm-mlu's ``CnclEP``, xllm; ``docs/vendors.md`` records them), never
from moe-comm's code. The tests put this folder first on ``sys.path`` inside their rank processes only.

It proves the cambricon backend's use of the calls against those conventions, not against an MLU.
The handle's exchange info carries each rank's global rank; ``moe_all2all_init`` makes a gloo group of
them, over which the rows move. Where the sources are silent the model picks, and says so: rows from
source r land at ``r * max_token_num`` of ``dispatch_recv`` in the source's send order;
``recv_layout[r]`` is (the rows' offset in r's ``dispatch_send``, their count); ``recv_token_num[r * El
+ e]`` counts r's rows for local expert e; buffers are int8 on the CPU.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

__version__ = "1.3.0.model"
__all__ = ["moe_all2all_create", "moe_all2all_init", "moe_all2all_dispatch", "moe_all2all_combine",
           "moe_all2all_destroy", "moe_all2all_gen_send_layout"]

_INFO_BYTES = 16
_HANDLES: dict[int, dict] = {}
_NEXT = itertools.count(1)


def moe_all2all_create(dispatch_token_byte, combine_token_byte, max_expert_num, max_token_num, rank, nrank):
    """``(handle, exchange_info_size, exchange_info, dispatch_send, dispatch_recv, combine_send, combine_recv)``."""
    if min(dispatch_token_byte, combine_token_byte, max_expert_num, max_token_num, nrank) < 1 or not 0 <= rank < nrank:
        raise RuntimeError("moe_all2all_create: sizes must be positive and rank in [0, nrank)")
    if max_expert_num % nrank:
        raise RuntimeError("moe_all2all_create: max_expert_num must be a multiple of nrank")
    handle = next(_NEXT)
    info = torch.zeros(_INFO_BYTES, dtype=torch.int8)
    info[:8].view(torch.int64)[0] = dist.get_rank()
    buffers = (torch.zeros(max_token_num * dispatch_token_byte, dtype=torch.int8),
               torch.zeros(nrank * max_token_num * dispatch_token_byte, dtype=torch.int8),
               torch.zeros(max_token_num * combine_token_byte, dtype=torch.int8),
               torch.zeros(nrank * max_token_num * combine_token_byte, dtype=torch.int8))
    _HANDLES[handle] = dict(rank=rank, nrank=nrank, rows=max_token_num, dtb=dispatch_token_byte,
                            ctb=combine_token_byte, experts=max_expert_num, info=info, buffers=buffers, group=None)
    return (handle, _INFO_BYTES, info) + buffers


def _state(handle, initialised=True):
    if handle not in _HANDLES or (initialised and _HANDLES[handle]["group"] is None):
        raise RuntimeError(f"handle {handle} is not {'an initialised' if initialised else 'a live'} moe_all2all handle")
    return _HANDLES[handle]


def moe_all2all_init(handle, all_exchange_info):
    """Connects the ranks: ``all_exchange_info`` [nrank, exchange_info_size] int8 on the CPU."""
    s = _state(handle, initialised=False)
    if all_exchange_info.device.type != "cpu" or tuple(all_exchange_info.shape) != (s["nrank"], _INFO_BYTES):
        raise RuntimeError(f"moe_all2all_init: all_exchange_info must be a CPU [{s['nrank']}, {_INFO_BYTES}] tensor")
    if not torch.equal(all_exchange_info[s["rank"]].to(torch.int8), s["info"]):
        raise RuntimeError("moe_all2all_init: row `rank` of all_exchange_info is not this rank's exchange_info")
    ranks = [int(row.to(torch.int8)[:8].view(torch.int64)[0]) for row in all_exchange_info]
    s["group"] = dist.new_group(ranks, use_local_synchronization=True)


def moe_all2all_gen_send_layout(token_count, nrank):
    """``[nrank, 2]`` int32 (offset, count) per rank of per-expert counts laid out by expert."""
    per_rank = token_count.reshape(nrank, -1).sum(-1).to(torch.int32)
    return torch.stack([per_rank.cumsum(0) - per_rank, per_rank], dim=1).to(torch.int32)


def _exchange(group, blocks, meta):
    """Uneven all-to-all of uint8 row blocks [n_i, B] plus one int64 meta row [M] per peer."""
    n = len(blocks)
    sizes = torch.tensor([b.shape[0] for b in blocks], dtype=torch.int64)
    got_sizes = torch.empty_like(sizes)
    dist.all_to_all_single(got_sizes, sizes, group=group)
    width = blocks[0].shape[1]
    out = torch.empty(int(got_sizes.sum()) * width, dtype=torch.uint8)
    dist.all_to_all_single(out, torch.cat(blocks).reshape(-1), [int(s) * width for s in got_sizes],
                           [int(s) * width for s in sizes], group=group)
    got_meta = torch.empty_like(meta)
    dist.all_to_all_single(got_meta, meta, group=group)
    return list(out.view(-1, width).split(got_sizes.tolist())), got_meta.view(n, -1)


def _check_layout(name, layout, nrank, total):
    if layout.dtype != torch.int32 or tuple(layout.shape) != (nrank, 2):
        raise RuntimeError(f"{name} must be [{nrank}, 2] int32")
    counts = layout[:, 1].to(torch.int64)
    if bool((counts < 0).any()) or int(counts.sum()) != total:
        raise RuntimeError(f"{name}'s counts must be >= 0 and sum to {total}, got {counts.tolist()}")


def moe_all2all_dispatch(handle, token_byte, token_num, send_layout, send_token_num, recv_layout, recv_token_num,
                         send_token=None, recv_token=None):
    """Sends rows ``send_layout[r]`` of ``dispatch_send`` to each rank r; fills ``recv_layout`` and
    ``recv_token_num`` in place."""
    s = _state(handle)
    nrank, rows, local = s["nrank"], s["rows"], s["experts"] // s["nrank"]
    if not 0 < token_byte <= s["dtb"] or not 0 <= token_num <= rows:
        raise RuntimeError(f"moe_all2all_dispatch: token_byte must be in (0, {s['dtb']}] and token_num in [0, {rows}]")
    _check_layout("send_layout", send_layout, nrank, token_num)
    if send_token_num.shape != (s["experts"],) or not torch.equal(
            moe_all2all_gen_send_layout(send_token_num.to(torch.int64), nrank), send_layout):
        raise RuntimeError("moe_all2all_dispatch: send_layout must be moe_all2all_gen_send_layout(send_token_num)")
    send = (send_token if send_token is not None else s["buffers"][0]).view(torch.uint8)
    send = send[:token_num * token_byte].view(token_num, token_byte)
    blocks = [send[int(o):int(o) + int(n)] for o, n in send_layout.tolist()]
    meta = torch.cat([send_layout[:, :1].to(torch.int64), send_token_num.to(torch.int64).view(nrank, local)], dim=1)
    got, got_meta = _exchange(s["group"], blocks, meta.reshape(-1))
    recv = (recv_token if recv_token is not None else s["buffers"][1]).view(torch.uint8)
    recv = recv[:nrank * rows * token_byte].view(nrank, rows, token_byte)
    for r, block in enumerate(got):
        recv[r, :block.shape[0]] = block
        recv_layout[r, 0], recv_layout[r, 1] = int(got_meta[r, 0]), block.shape[0]
    recv_token_num.copy_(got_meta[:, 1:].reshape(-1).to(recv_token_num.dtype))


def moe_all2all_combine(handle, token_byte, token_num, send_src_layout, send_dst_layout, send_token=None,
                        recv_token=None):
    """Sends rows ``send_src_layout[r]`` of ``combine_send`` back to rank r, which places them at the offset
    ``send_dst_layout[r]`` (the dispatch's ``recv_layout``) names; ``token_num`` rows arrive here."""
    s = _state(handle)
    nrank, rows = s["nrank"], s["rows"]
    if not 0 < token_byte <= s["ctb"] or not 0 <= token_num <= rows:
        raise RuntimeError(f"moe_all2all_combine: token_byte must be in (0, {s['ctb']}] and token_num in [0, {rows}]")
    total = int(send_src_layout[:, 1].sum()) if send_src_layout.dim() == 2 else -1
    _check_layout("send_src_layout", send_src_layout, nrank, total)
    if total > rows or not torch.equal(send_src_layout[:, 1], send_dst_layout[:, 1]):
        raise RuntimeError("moe_all2all_combine: send_src_layout's counts must be send_dst_layout's")
    send = (send_token if send_token is not None else s["buffers"][2]).view(torch.uint8)
    send = send[:total * token_byte].view(total, token_byte)
    blocks = [send[int(o):int(o) + int(n)] for o, n in send_src_layout.tolist()]
    got, got_meta = _exchange(s["group"], blocks, send_dst_layout[:, :1].to(torch.int64).reshape(-1))
    if sum(b.shape[0] for b in got) != token_num:
        raise RuntimeError(f"moe_all2all_combine: {sum(b.shape[0] for b in got)} rows arrived, token_num is {token_num}")
    recv = (recv_token if recv_token is not None else s["buffers"][3]).view(torch.uint8)
    recv = recv[:nrank * rows * token_byte].view(nrank * rows, token_byte)
    for r, block in enumerate(got):
        at = int(got_meta[r, 0])
        recv[at:at + block.shape[0]] = block


def moe_all2all_destroy(handle):
    _state(handle, initialised=False)
    del _HANDLES[handle]

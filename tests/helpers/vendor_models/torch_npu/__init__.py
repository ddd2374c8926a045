"""A CPU model of the parts of ``torch_npu`` the ascend backend calls, written from their documentation
(op-plugin's schemas and docs, as ``docs/vendors.md`` "Facts about MC2" records them), never from
moe-comm's code. The tests put this folder first on ``sys.path`` inside their rank processes only.

It proves the backend's argument mapping and layout conversions against the documentation, not
against an NPU. Communication goes over the gloo group whose HCCL name the adapter asked for: a
gloo group answers ``get_hccl_comm_name`` here, as an hccl group does under ``torch_npu``.

Where the documentation is silent the model picks, and says so:
- rows of one local expert in ``expand_x`` arrive by source rank, then token;
- ``expand_x``'s rows past the valid ones hold garbage (the docs: "not zeroed"): here byte 0x5A;
- the opaque ``assist_info_for_combine`` / ``expand_idx`` / ``ep_recv_counts`` hold what this model's
  combine needs.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroupGloo

from . import npu

__version__ = "2.14.0.model"
__all__ = ["npu", "npu_moe_distribute_dispatch", "npu_moe_distribute_combine"]

_GARBAGE = 0x5A
_NAMES: dict[str, dist.ProcessGroup] = {}


def _get_hccl_comm_name(backend: ProcessGroupGloo, rank: int) -> str:
    """The group's communicator name (torch_npu: ``ProcessGroupHCCL.get_hccl_comm_name(global_rank)``)."""
    for group in dist.distributed_c10d._world.pg_map:
        if group._get_backend(torch.device("cpu")) is backend:
            name = f"model_hccl_{id(group):x}"
            _NAMES[name] = group
            return name
    raise RuntimeError("get_hccl_comm_name: not a group of this process")


ProcessGroupGloo.get_hccl_comm_name = _get_hccl_comm_name


def _group(name: str, ep_world_size: int, ep_rank_id: int) -> dist.ProcessGroup:
    if not isinstance(name, str) or not 1 <= len(name) < 128 or name not in _NAMES:
        raise RuntimeError(f"group_ep {name!r} is not an HCCL communicator name (length [1, 128))")
    group = _NAMES[name]
    if dist.get_world_size(group) != ep_world_size or dist.get_rank(group) != ep_rank_id:
        raise RuntimeError(f"ep_world_size/ep_rank_id {ep_world_size}/{ep_rank_id} do not match {name}")
    return group


def _all_to_all(group: dist.ProcessGroup, blocks: list[torch.Tensor]) -> list[torch.Tensor]:
    """Uneven all-to-all of uint8 row blocks [n_i, B] (B equal everywhere): the blocks each rank got."""
    width = blocks[0].shape[1]
    sizes = torch.tensor([b.shape[0] for b in blocks], dtype=torch.int64)
    got = torch.empty_like(sizes)
    dist.all_to_all_single(got, sizes, group=group)
    out = torch.empty(int(got.sum()) * width, dtype=torch.uint8)
    dist.all_to_all_single(out, torch.cat(blocks).reshape(-1), [int(s) * width for s in got.tolist()],
                           [int(s) * width for s in sizes.tolist()], group=group)
    return list(out.view(-1, width).split(got.tolist()))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Rows of ``t`` as uint8 [rows, bytes per row] (empty ones too)."""
    return t.contiguous().view(torch.uint8).reshape(t.shape[0], t.element_size() * math.prod(t.shape[1:]))


def _dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, active, quant_mode, global_bs,
              expert_token_nums_type):
    bs, hidden = x.shape
    k = expert_ids.shape[1]
    if x.dtype not in (torch.bfloat16, torch.float16) or expert_ids.dtype != torch.int32:
        raise RuntimeError(f"x must be bf16/fp16 and expert_ids int32, got {x.dtype}, {expert_ids.dtype}")
    if expert_ids.shape[0] != bs or bool(((expert_ids < 0) | (expert_ids >= moe_expert_num)).any()):
        raise RuntimeError("expert_ids must be [BS, K] with values in [0, moe_expert_num)")
    if global_bs not in (0, bs * ep_world_size):
        raise RuntimeError(f"global_bs must be 0 or BS * ep_world_size = {bs * ep_world_size}, got {global_bs}")
    if quant_mode not in (0, 2) or expert_token_nums_type not in (0, 1):
        raise RuntimeError("quant_mode must be 0 or 2, expert_token_nums_type 0 or 1")
    ids = expert_ids.to(torch.int64)
    for t in range(bs):
        chosen = ids[t][active[t]].tolist()
        if len(set(chosen)) != len(chosen):
            raise RuntimeError(f"expert_ids[{t}] repeats an expert: {chosen}")
    group = _group(group_ep, ep_world_size, ep_rank_id)
    local = moe_expert_num // ep_world_size
    if quant_mode == 2:  # dynamic quant: s = 127 / max|x|, int8(x * s), scale 1 / s
        x32 = x.float()
        s = torch.tensor(127.0) / x32.abs().amax(dim=1).clamp(min=1e-4)
        payload = torch.round(x32 * s.unsqueeze(1)).clamp(-128, 127).to(torch.int8)
        scale = (torch.tensor(1.0) / s).to(torch.float32)
    else:
        payload, scale = x, torch.zeros(bs, dtype=torch.float32)
    row_bytes = _bytes(payload[:1]).shape[1]
    blocks = []
    for dest in range(ep_world_size):
        sel = [(int(ids[t, j]) % local, t, j) for t in range(bs) for j in range(k)
               if active[t, j] and int(ids[t, j]) // local == dest]
        sel.sort()  # by local expert, then token
        meta = torch.tensor([[e, t, j] for e, t, j in sel], dtype=torch.int32).reshape(-1, 3)
        tokens = meta[:, 1].to(torch.int64)
        blocks.append(torch.cat([_bytes(payload[tokens]), _bytes(scale[tokens].unsqueeze(1)), _bytes(meta)], dim=1))
    got = _all_to_all(group, blocks)
    rows = [(int(b[i, row_bytes + 4:].view(torch.int32)[0]), src, i) for src, b in enumerate(got)
            for i in range(b.shape[0])]
    rows.sort(key=lambda r: (r[0], r[1]))  # by local expert, then source rank (tokens stay in order)
    a = bs * ep_world_size * min(local, k)
    expand_x = torch.full((a, row_bytes), _GARBAGE, dtype=torch.uint8)
    scales = torch.full((a,), float(_GARBAGE), dtype=torch.float32)
    assist = torch.full((a * 128,), -1, dtype=torch.int32)
    for n, (_, src, i) in enumerate(rows):
        expand_x[n] = got[src][i, :row_bytes]
        scales[n] = got[src][i, row_bytes:row_bytes + 4].view(torch.float32)[0]
        meta = got[src][i, row_bytes + 4:].view(torch.int32)
        assist[n * 128:n * 128 + 3] = torch.tensor([src, int(meta[1]), int(meta[2])], dtype=torch.int32)
    counts = torch.bincount(torch.tensor([r[0] for r in rows], dtype=torch.int64), minlength=local)
    token_nums = counts if expert_token_nums_type == 1 else counts.cumsum(0)
    ep_recv_counts = torch.tensor([len(rows)], dtype=torch.int32)
    return (expand_x.view(payload.dtype).view(a, hidden), scales, assist, token_nums.to(torch.int64), ep_recv_counts,
            torch.zeros(1, dtype=torch.int32), torch.zeros(a, dtype=torch.float32))


def _combine(expand_x, expert_ids, assist, ep_send_counts, expert_scales, group_ep, ep_world_size, ep_rank_id,
             moe_expert_num, active, global_bs):
    bs, k = expert_ids.shape
    hidden = expand_x.shape[1]
    if expand_x.dtype not in (torch.bfloat16, torch.float16):
        raise RuntimeError(f"expand_x must be bf16/fp16 (dequantise before combine), got {expand_x.dtype}")
    if expert_scales.shape != (bs, k) or expert_scales.dtype != torch.float32:
        raise RuntimeError(f"expert_scales must be [BS, K] float32, got {list(expert_scales.shape)} {expert_scales.dtype}")
    group = _group(group_ep, ep_world_size, ep_rank_id)
    valid = int(ep_send_counts[0])
    meta = assist.view(-1, 128)[:valid, :3]
    blocks = []
    for dest in range(ep_world_size):
        mine = (meta[:, 0] == dest).nonzero().flatten()
        blocks.append(torch.cat([_bytes(expand_x[mine]), _bytes(meta[mine, 1:])], dim=1))
    got = torch.cat(_all_to_all(group, blocks))
    row_bytes = hidden * expand_x.element_size()
    y = got[:, :row_bytes].contiguous().view(expand_x.dtype).view(-1, hidden)
    where = got[:, row_bytes:].contiguous().view(torch.int32).view(-1, 2)
    acc = torch.zeros(bs, hidden, dtype=torch.float32)
    for j in range(k):  # out[t] = sum over k ascending of expert_scales[t, k] * y_k, fp32
        for i in (where[:, 1] == j).nonzero().flatten().tolist():
            t = int(where[i, 0])
            if active[t, j]:
                acc[t] += expert_scales[t, j] * y[i].float()
    return acc.to(expand_x.dtype)


def _mask(x_active_mask, expert_ids):
    if x_active_mask is None:
        return torch.ones(expert_ids.shape, dtype=torch.bool)
    if x_active_mask.dtype != torch.bool or x_active_mask.shape != expert_ids.shape:
        raise RuntimeError(f"x_active_mask must be bool [BS] or [BS, K], got {list(x_active_mask.shape)}")
    return x_active_mask


def npu_moe_distribute_dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None,
                                x_active_mask=None, expert_scales=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                global_bs=0, expert_token_nums_type=1):
    """v1: ``(expand_x, dynamic_scales, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts,
    expand_scales)``; ``x_active_mask`` is reserved (every entry is dispatched)."""
    if scales is not None or tp_world_size > 1 or shared_expert_rank_num:
        raise RuntimeError("this model has no smoothing scales, TP domain or shared experts")
    return _dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, _mask(None, expert_ids),
                     quant_mode, global_bs, expert_token_nums_type)


def npu_moe_distribute_combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep,
                               ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None, x_active_mask=None,
                               activation_scale=None, weight_scale=None, group_list=None, expand_scales=None,
                               shared_expert_x=None, group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0,
                               shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, out_dtype=0,
                               comm_quant_mode=0, group_list_type=0):
    """v1 combine: ``[BS, H]``."""
    return _combine(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep, ep_world_size,
                    ep_rank_id, moe_expert_num, _mask(None, expert_ids), global_bs)


def npu_moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *,
                                   scales=None, x_active_mask=None, expert_scales=None, elastic_info=None,
                                   performance_info=None, group_tp="", tp_world_size=0, tp_rank_id=0,
                                   expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, quant_mode=0,
                                   global_bs=0, expert_token_nums_type=1, comm_alg="", zero_expert_num=0,
                                   copy_expert_num=0, const_expert_num=0):
    """v2: as v1, with ``assist_info_for_combine`` [A * 128] int32 in place of ``expand_idx``."""
    if comm_alg not in ("", "fullmesh", "fullmesh_v1", "fullmesh_v2", "hierarchy"):
        raise RuntimeError(f"comm_alg {comm_alg!r} is not one of the documented algorithms")
    return _dispatch(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num,
                     _mask(x_active_mask, expert_ids), quant_mode, global_bs, expert_token_nums_type)


def npu_moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                                  group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, tp_send_counts=None,
                                  x_active_mask=None, expand_scales=None, shared_expert_x=None, elastic_info=None,
                                  ori_x=None, const_expert_alpha_1=None, const_expert_alpha_2=None,
                                  const_expert_v=None, performance_info=None, group_tp="", tp_world_size=0,
                                  tp_rank_id=0, expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0,
                                  global_bs=0, comm_quant_mode=0, comm_alg="", zero_expert_num=0, copy_expert_num=0,
                                  const_expert_num=0):
    """v2 combine: ``[BS, H]``."""
    return _combine(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales, group_ep,
                    ep_world_size, ep_rank_id, moe_expert_num, _mask(x_active_mask, expert_ids), global_bs)


if os.environ.get("TORCH_NPU_MODEL_V1_ONLY") == "1":  # a torch_npu from before the _v2 operators
    del npu_moe_distribute_dispatch_v2, npu_moe_distribute_combine_v2


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1,
                            expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False,
                            quant_mode=-1, active_expert_range=(), row_idx_type=0):
    """Sorts the (token, k) pairs by expert ("permute"), dropless: ``(expanded_x, expanded_row_idx,
    expert_token_cumsum_or_count, expanded_scale)``. Only what the docs describe for drop_pad_mode 0,
    quant_mode -1 (none) / 1 (dynamic INT8), gather-style row indices (row_idx_type 0: each expanded row's
    flat ``t * K + k``, -1 after the routed rows); ids outside ``active_expert_range`` are not routed. The
    model sorts stably (the docs do not say)."""
    if drop_pad_mode != 0 or quant_mode not in (-1, 1) or row_idx_type != 0 or scale is not None or offset is not None:
        raise RuntimeError("this model covers drop_pad_mode 0, quant_mode -1/1, row_idx_type 0, no smooth scales")
    if expert_idx.dtype != torch.int32 or expert_idx.dim() != 2 or expert_idx.shape[0] != x.shape[0]:
        raise RuntimeError("expert_idx must be [NUM_ROWS, K] int32")
    start, end = active_expert_range if active_expert_range else (0, expert_num)
    flat = expert_idx.reshape(-1).to(torch.int64)
    active = (flat >= start) & (flat < end)
    keys = torch.where(active, flat, torch.full_like(flat, end))  # inactive pairs sort last
    order = torch.sort(keys, stable=True).indices
    routed = int(active.sum())
    rows = order[:routed]
    k = expert_idx.shape[1]
    expanded_x = x[rows // k]
    expanded_scale = torch.zeros(expanded_x.shape[0], dtype=torch.float32)
    if quant_mode == 1:
        x32 = expanded_x.float()
        s = torch.tensor(127.0) / x32.abs().amax(dim=1).clamp(min=1e-4)
        expanded_x = torch.round(x32 * s.unsqueeze(1)).clamp(-128, 127).to(torch.int8)
        expanded_scale = torch.tensor(1.0) / s
    row_idx = torch.full((flat.numel(),), -1, dtype=torch.int32)
    row_idx[:routed] = rows.to(torch.int32)
    counts = torch.bincount(flat[active] - start, minlength=end - start).to(torch.int64)
    tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    return expanded_x, row_idx, tokens, expanded_scale


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None, antiquant_offset=None,
                       per_token_scale=None, group_list=None, activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None, group_list_type=0, act_type=0,
                       output_dtype=None, tuning_config=None):
    """One x [M, K] split by ``group_list`` (counts, group_list_type 1; cumsum, 0) along M (group_type 0)
    times one weight [E, K, N]: ``[out [M, N]]`` (split_item 2/3), fp32 accumulation per group."""
    if len(x) != 1 or len(weight) != 1 or split_item not in (2, 3) or group_type != 0 or group_list is None:
        raise RuntimeError("this model covers one x, one [E, K, N] weight, split_item 2/3, group_type 0")
    a, w = x[0], weight[0]
    counts = group_list.to(torch.int64) if group_list_type == 1 else torch.diff(group_list.to(torch.int64), prepend=
                                                                                  torch.zeros(1, dtype=torch.int64))
    if w.dim() != 3 or w.shape[0] != counts.numel() or int(counts.sum()) != a.shape[0]:
        raise RuntimeError(f"weight must be [E, K, N] with E = len(group_list) and group_list covering x's {a.shape[0]} "
                           f"rows")
    out = torch.empty(a.shape[0], w.shape[2], dtype=output_dtype or a.dtype)
    first = 0
    for e, n in enumerate(counts.tolist()):
        out[first:first + n] = (a[first:first + n].float() @ w[e].float()).to(out.dtype)
        first += n
    return [out]

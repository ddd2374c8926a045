"""Bad inputs, run inside a rank: each case makes one bad call and reports what it raised."""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

import moe_comm

T, H, K, E = 8, 128, 2, 8


def _inputs(num_ranks: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    topk_idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    return dict(x=torch.randn(T, H, generator=g).to(torch.bfloat16), topk_idx=topk_idx,
                topk_weights=torch.rand(T, K, generator=g))


def _dispatch(buf: moe_comm.Buffer, **overrides: Any) -> Any:
    args = _inputs(buf.group_size)
    ntr, _, nte, itr, _ = buf.get_dispatch_layout(args["topk_idx"], E)
    args.update(num_tokens_per_rank=ntr, is_token_in_rank=itr, num_tokens_per_expert=nte)
    valid = dict(args)
    args.update(overrides)
    args = {k: v for k, v in args.items() if v is not _DROP}
    _warm_up(buf.dispatch, args, valid)
    return buf.dispatch(**args)


_DROP = object()


def _combine(buf: moe_comm.Buffer, **overrides: Any) -> Any:
    recv_x, _, recv_w, _, handle, _ = _dispatch(buf)
    args = dict(x=recv_x, handle=handle, topk_weights=recv_w)
    valid = dict(args, bias=torch.zeros(T, H, dtype=torch.bfloat16))
    args.update(overrides)
    _warm_up(buf.combine, args, valid)
    return buf.combine(**args)


def _handle(buf: moe_comm.Buffer) -> tuple:
    return _dispatch(buf)[4]


M = 8  # low-latency num_max_dispatch_tokens_per_rank


def _ll_buffer(buf: moe_comm.Buffer, **kw: Any) -> moe_comm.Buffer:
    kw.setdefault("num_rdma_bytes", moe_comm.Buffer.get_low_latency_rdma_size_hint(M, H, buf.group_size, E))
    return moe_comm.Buffer(buf.group, low_latency_mode=kw.pop("low_latency_mode", True), timeout_s=20, **kw)


#: run_case(..., warm=True): every dispatch and combine case (normal and low-latency) first makes a valid call of
#: its bad call's signature, so the bad call meets that signature's prepared call (backends/portable/prepared.py,
#: prepared_normal.py), which must decline it for the checked path to raise the expected error
_warm = False


def _warm_up(call: Callable[..., Any], args: dict[str, Any], valid: dict[str, Any]) -> None:
    """With ``_warm``: ``call`` with ``args``, their tensors replaced by the valid ``valid`` ones (the same
    presence: a None stays None). A call that still raises has a bad scalar: no prepared call is made for it."""
    if not _warm:
        return
    try:
        call(**{**args, **{k: v for k, v in valid.items() if args.get(k) is not None}})
    except Exception:  # noqa: BLE001 (the bad call that follows raises the error the test checks)
        pass


def _ll_dispatch(buf: moe_comm.Buffer, **overrides: Any) -> Any:
    ll = _ll_buffer(buf)
    args = _inputs(buf.group_size)
    args = dict(x=args["x"], topk_idx=args["topk_idx"], num_max_dispatch_tokens_per_rank=M, num_experts=E)
    valid = dict(args, cumulative_local_expert_recv_stats=torch.zeros(E // buf.group_size, dtype=torch.int32),
                 dispatch_wait_recv_cost_stats=torch.zeros(buf.group_size, dtype=torch.int64))
    args.update(overrides)
    _warm_up(ll.low_latency_dispatch, args, valid)
    return ll.low_latency_dispatch(**args)


def _ll_combine(buf: moe_comm.Buffer, **overrides: Any) -> Any:
    ll = _ll_buffer(buf)
    inputs = _inputs(buf.group_size)
    recv_x, _, handle, _, _ = ll.low_latency_dispatch(inputs["x"], inputs["topk_idx"], M, E, use_fp8=False)
    args = dict(x=recv_x, topk_idx=inputs["topk_idx"], topk_weights=inputs["topk_weights"], handle=handle)
    valid = dict(args, out=torch.zeros(T, H, dtype=torch.bfloat16),
                 combine_wait_recv_cost_stats=torch.zeros(buf.group_size, dtype=torch.int64))
    args.update(overrides)
    _warm_up(ll.low_latency_combine, args, valid)
    return ll.low_latency_combine(**args)


def _ll_handle(buf: moe_comm.Buffer) -> tuple:
    inputs = _inputs(buf.group_size)
    return _ll_buffer(buf).low_latency_dispatch(inputs["x"], inputs["topk_idx"], M, E, use_fp8=False)[2]


def _duplicate_expert() -> torch.Tensor:
    idx = _inputs(1)["topk_idx"].clone()
    idx[3, 1] = idx[3, 0]
    return idx


# name -> bad call on a Buffer; the test module holds the expected exception and message.
CASES: dict[str, Callable[[moe_comm.Buffer], Any]] = {
    "layout_topk_dtype": lambda b: b.get_dispatch_layout(_inputs(1)["topk_idx"].int(), E),
    "layout_topk_dims": lambda b: b.get_dispatch_layout(_inputs(1)["topk_idx"].view(-1), E),
    "layout_topk_range": lambda b: b.get_dispatch_layout(_inputs(1)["topk_idx"] + E, E),
    "layout_topk_below": lambda b: b.get_dispatch_layout(_inputs(1)["topk_idx"] - 5, E),
    "layout_num_experts": lambda b: b.get_dispatch_layout(_inputs(1)["topk_idx"], 0),
    "layout_num_experts_type": lambda b: b.get_dispatch_layout(_inputs(1)["topk_idx"], 8.0),
    "dispatch_x_dims": lambda b: _dispatch(b, x=torch.zeros(T, H, 1)),
    "dispatch_x_type": lambda b: _dispatch(b, x=[1, 2, 3]),
    "dispatch_x_strides": lambda b: _dispatch(b, x=torch.zeros(H, T).T),
    "dispatch_fp8_tuple_len": lambda b: _dispatch(b, x=(torch.zeros(T, H, dtype=torch.float8_e4m3fn),)),
    "dispatch_fp8_dtype": lambda b: _dispatch(b, x=(torch.zeros(T, H), torch.ones(T, 1))),
    "dispatch_scales_rows": lambda b: _dispatch(b, x=(torch.zeros(T, H, dtype=torch.float8_e4m3fn), torch.ones(T + 1, 1))),
    "dispatch_scales_dtype": lambda b: _dispatch(b, x=(torch.zeros(T, H, dtype=torch.float8_e4m3fn),
                                                       torch.ones(T, 1, dtype=torch.float16))),
    "dispatch_topk_without_weights": lambda b: _dispatch(b, topk_weights=None),
    "dispatch_weights_shape": lambda b: _dispatch(b, topk_weights=torch.rand(T, K + 1)),
    "dispatch_weights_dtype": lambda b: _dispatch(b, topk_weights=torch.rand(T, K).double()),
    "dispatch_topk_rows": lambda b: _dispatch(b, topk_idx=_inputs(1)["topk_idx"][:-1], topk_weights=torch.rand(T - 1, K)),
    "dispatch_worst_without_topk": lambda b: _dispatch(b, topk_idx=None, topk_weights=None, num_worst_tokens=64),
    "dispatch_worst_negative": lambda b: _dispatch(b, num_worst_tokens=-1),
    "dispatch_alignment_zero": lambda b: _dispatch(b, expert_alignment=0),
    "dispatch_partial_layout": lambda b: _dispatch(b, is_token_in_rank=None),
    "dispatch_no_layout_no_experts": lambda b: _dispatch(b, num_tokens_per_rank=None, is_token_in_rank=None,
                                                         num_tokens_per_expert=None),
    "dispatch_num_experts_mismatch": lambda b: _dispatch(b, num_experts=E * 2),
    "dispatch_rank_counts_mismatch": lambda b: _dispatch(b, num_tokens_per_rank=torch.zeros(b.group_size, dtype=torch.int32)),
    "dispatch_in_rank_shape": lambda b: _dispatch(b, is_token_in_rank=torch.zeros(T, b.group_size + 1, dtype=torch.bool)),
    "dispatch_per_expert_dtype": lambda b: _dispatch(b, num_tokens_per_expert=torch.zeros(E, dtype=torch.int64)),
    "dispatch_handle_with_topk": lambda b: _dispatch(b, handle=_handle(b)),
    "dispatch_handle_not_tuple": lambda b: _dispatch(b, handle="handle", topk_idx=None, topk_weights=None),
    "dispatch_handle_tensor_dtype": lambda b: _dispatch(b, handle=(_handle(b)[0].long(),) + _handle(b)[1:],
                                                        topk_idx=None, topk_weights=None),
    "dispatch_handle_rows": lambda b: b.dispatch(torch.zeros(T + 1, H), handle=_handle(b)),
    "dispatch_comm_stream_without_event": lambda b: _dispatch(b, allocate_on_comm_stream=True, async_finish=True),
    "dispatch_previous_event_type": lambda b: _dispatch(b, previous_event="event"),
    "dispatch_async_type": lambda b: _dispatch(b, async_finish=1),
    "dispatch_config_type": lambda b: _dispatch(b, config={"num_sms": 20}),
    "combine_x_dtype": lambda b: _combine(b, x=torch.zeros(3, H, dtype=torch.int32)),
    "combine_x_rows": lambda b: _combine(b, x=torch.zeros(10_000, H, dtype=torch.bfloat16)),
    "combine_weights_dtype": lambda b: _combine(b, topk_weights=torch.zeros(T, K, dtype=torch.float64)),
    "combine_bias_shape": lambda b: _combine(b, bias=torch.zeros(T, H + 1, dtype=torch.bfloat16)),
    "combine_bias_dtype": lambda b: _combine(b, bias=(torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, H))),
    "combine_bias_type": lambda b: _combine(b, bias=[1, 2, 3]),
    "combine_handle_len": lambda b: _combine(b, handle=_handle(b)[:5]),
    "combine_x_type": lambda b: _combine(b, x="x"),
    "dispatch_device_mismatch": lambda b: _dispatch(b, x=torch.zeros(T, H, device="meta")),
    "dispatch_handle_src_idx_short": lambda b: _dispatch(b, handle=_handle(b)[:3] + (torch.zeros(0, dtype=torch.int32),)
                                                         + _handle(b)[4:], topk_idx=None, topk_weights=None),
    "dispatch_handle_send_head_shape": lambda b: _dispatch(b, handle=_handle(b)[:5] + (torch.zeros(1, 1, dtype=torch.int32),),
                                                           topk_idx=None, topk_weights=None),
    "layout_async_type": lambda b: b.get_dispatch_layout(_inputs(1)["topk_idx"], E, async_finish="yes"),
    "combine_weights_rows": lambda b: _combine(b, topk_weights=torch.zeros(T + 3, K)),
    "destroy_not_explicit": lambda b: b.destroy(),
    "set_num_sms_odd": lambda b: moe_comm.Buffer.set_num_sms(3),
    "buffer_negative_bytes": lambda b: moe_comm.Buffer(b.group, num_nvl_bytes=-1),
    "buffer_flag_type": lambda b: moe_comm.Buffer(b.group, low_latency_mode="yes"),
    "buffer_group_type": lambda b: moe_comm.Buffer("world"),
    "buffer_timeout": lambda b: moe_comm.Buffer(b.group, timeout_s=0),
    "buffer_timeout_type": lambda b: moe_comm.Buffer(b.group, timeout_s="5"),
    "buffer_qps_negative": lambda b: moe_comm.Buffer(b.group, num_qps_per_rank=-2),
    "buffer_transport_type": lambda b: moe_comm.Buffer(b.group, transport=None),
    "buffer_transport": lambda b: moe_comm.Buffer(b.group, transport="carrier-pigeon"),
    "buffer_comm": lambda b: moe_comm.Buffer(None, comm=object()),
    "mask_without_shrink": lambda b: _ll_buffer(b).low_latency_update_mask_buffer(0, True),
    "mask_rank_range": lambda b: _ll_buffer(b, enable_shrink=True).low_latency_update_mask_buffer(b.group_size, True),
    "mask_rank_type": lambda b: _ll_buffer(b, enable_shrink=True).low_latency_update_mask_buffer(0.0, True),
    "mask_self": lambda b: _ll_buffer(b, enable_shrink=True).low_latency_update_mask_buffer(b.rank, True),
    "mask_flag": lambda b: _ll_buffer(b, enable_shrink=True).low_latency_update_mask_buffer(0, 1),
    "mask_status_shape": lambda b: _ll_buffer(b, enable_shrink=True).low_latency_query_mask_buffer(
        torch.zeros(b.group_size + 1, dtype=torch.int32)),
    "mask_status_dtype": lambda b: _ll_buffer(b, enable_shrink=True).low_latency_query_mask_buffer(
        torch.zeros(b.group_size, dtype=torch.int64)),
    "ll_not_low_latency_mode": lambda b: b.low_latency_dispatch(_inputs(1)["x"], _inputs(1)["topk_idx"], M, E),
    "ll_rdma_bytes_small": lambda b: _ll_buffer(b, num_rdma_bytes=1024).low_latency_dispatch(
        _inputs(1)["x"], _inputs(1)["topk_idx"], M, E),
    "ll_x_dtype": lambda b: _ll_dispatch(b, x=torch.zeros(T, H)),
    "ll_x_type": lambda b: _ll_dispatch(b, x=[[0.0] * H]),
    "ll_hidden": lambda b: _ll_dispatch(b, x=torch.zeros(T, 200, dtype=torch.bfloat16)),
    "ll_too_many_tokens": lambda b: _ll_dispatch(b, x=torch.zeros(M + 1, H, dtype=torch.bfloat16),
                                                 topk_idx=torch.zeros(M + 1, K, dtype=torch.int64)),
    "ll_topk_rows": lambda b: _ll_dispatch(b, topk_idx=_inputs(1)["topk_idx"][:-1]),
    "ll_topk_duplicate": lambda b: _ll_dispatch(b, topk_idx=_duplicate_expert()),
    "ll_topk_range": lambda b: _ll_dispatch(b, topk_idx=_inputs(1)["topk_idx"] + E),
    "ll_m_zero": lambda b: _ll_dispatch(b, num_max_dispatch_tokens_per_rank=0),
    "ll_num_experts_type": lambda b: _ll_dispatch(b, num_experts=8.0),
    "ll_ue8m0_without_round_scale": lambda b: _ll_dispatch(b, use_ue8m0=True),
    "ll_ue8m0_hidden": lambda b: _ll_dispatch(b, round_scale=True, use_ue8m0=True),
    "ll_async_and_hook": lambda b: _ll_dispatch(b, async_finish=True, return_recv_hook=True),
    "ll_flag_type": lambda b: _ll_dispatch(b, use_fp8=1),
    "ll_recv_stats_dtype": lambda b: _ll_dispatch(b, cumulative_local_expert_recv_stats=torch.zeros(E, dtype=torch.int64)),
    "ll_wait_stats_shape": lambda b: _ll_dispatch(b, dispatch_wait_recv_cost_stats=torch.zeros(2, 2, dtype=torch.int64)),
    "llc_logfmt_zero_copy": lambda b: _ll_combine(b, use_logfmt=True, zero_copy=True),
    "llc_handle_len": lambda b: _ll_combine(b, handle=_ll_handle(b)[:4]),
    "llc_handle_range": lambda b: _ll_combine(b, handle=(_ll_handle(b)[0], _ll_handle(b)[1] + (M << 32)) + _ll_handle(b)[2:]),
    "llc_x_shape": lambda b: _ll_combine(b, x=torch.zeros(E, M, H + 128, dtype=torch.bfloat16)),
    "llc_x_dtype": lambda b: _ll_combine(b, x=torch.zeros(E, M, H)),
    "llc_weights_shape": lambda b: _ll_combine(b, topk_weights=torch.zeros(T, K + 1)),
    "llc_out_shape": lambda b: _ll_combine(b, out=torch.zeros(T + 1, H, dtype=torch.bfloat16)),
    "llc_out_strides": lambda b: _ll_combine(b, out=torch.zeros(H, T, dtype=torch.bfloat16).T),
    "llc_zero_copy_without_buffer": lambda b: _ll_combine(b, zero_copy=True),
    "llc_stats_dtype": lambda b: _ll_combine(b, combine_wait_recv_cost_stats=torch.zeros(1, dtype=torch.int32)),
    "ll_clean_hidden": lambda b: _ll_buffer(b).clean_low_latency_buffer(M, 200, E),
    "ll_next_buffer_handle": lambda b: _ll_buffer(b).get_next_low_latency_combine_buffer("handle"),
    "ll_size_hint_hidden": lambda b: moe_comm.Buffer.get_low_latency_rdma_size_hint(M, 64, 1, E),
    "layout_experts_huge": lambda b: b.get_dispatch_layout(_inputs(1)["topk_idx"], 2**40),
    "layout_experts_too_big_for_memory": lambda b: b.get_dispatch_layout(_inputs(1)["topk_idx"], 2**31 - 1),
    "dispatch_experts_huge": lambda b: _dispatch(b, num_tokens_per_rank=None, is_token_in_rank=None,
                                                 num_tokens_per_expert=None, num_experts=2**40),
    "dispatch_worst_huge": lambda b: _dispatch(b, num_worst_tokens=2**40),
    "dispatch_worst_too_big_for_memory": lambda b: _dispatch(b, num_worst_tokens=2**31 - 1),
    "dispatch_alignment_huge": lambda b: _dispatch(b, expert_alignment=2**40),
    "ll_m_huge": lambda b: _ll_dispatch(b, num_max_dispatch_tokens_per_rank=2**40),
    # the Buffer's own num_rdma_bytes: the receive buffer's size is checked first (a Buffer made with 2**62 bytes
    # maps, on cuda_host, its whole share of the host's shared memory up front: 18 s, and OOM beside other worlds)
    "ll_m_too_big_for_memory": lambda b: _ll_buffer(b).low_latency_dispatch(_inputs(1)["x"], _inputs(1)["topk_idx"],
                                                                             2**30, E),
    "ll_experts_huge": lambda b: _ll_dispatch(b, num_experts=2**40),
}


def run_case(group: dist.ProcessGroup, name: str, warm: bool = False) -> tuple[str, str]:
    """Runs CASES[name] on a fresh Buffer (``warm``: see ``_warm``); returns (exception class name, message)."""
    global _warm
    buf = moe_comm.Buffer(group, timeout_s=20)
    _warm = warm
    try:
        CASES[name](buf)
    except Exception as exc:  # the test checks type and message
        return type(exc).__name__, str(exc)
    finally:
        _warm = False
    return "no exception", ""


def after_destroy(group: dist.ProcessGroup) -> tuple[str, str]:
    buf = moe_comm.Buffer(group, explicitly_destroy=True)
    buf.destroy()
    buf.destroy()  # idempotent
    try:
        buf.dispatch(**_inputs(1), num_experts=E)
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    return "no exception", ""


def env_transport(group: dist.ProcessGroup, value: str) -> tuple[str, str]:
    import os
    before = os.environ.get("MOE_COMM_TRANSPORT")
    os.environ["MOE_COMM_TRANSPORT"] = value
    try:
        buf = moe_comm.Buffer(group)
        return "ok", buf.transport_name
    except Exception as exc:
        return type(exc).__name__, str(exc)
    finally:
        os.environ.pop("MOE_COMM_TRANSPORT")
        if before is not None:
            os.environ["MOE_COMM_TRANSPORT"] = before

"""Every argument check is reached, and its message names the argument, the expectation and the value."""
import pytest

from helpers.error_cases import CASES, after_destroy, env_transport, run_case

EXPECTED = {
    "layout_topk_dtype": ("TypeError", r"get_dispatch_layout: topk_idx must be of dtype int64, got \[8, 2\] int32"),
    "layout_topk_dims": ("ValueError", r"topk_idx must be shaped \[\*, \*\], got \[16\]"),
    "layout_topk_range": ("ValueError", r"topk_idx must be expert ids in \[-1, 8\) .*got values in \[8, 15\]"),
    "layout_topk_below": ("ValueError", r"topk_idx must be expert ids in \[-1, 8\).*got values in \[-5, "),
    "layout_num_experts": ("ValueError", r"num_experts must be >= 1, got 0"),
    "layout_num_experts_type": ("TypeError", r"num_experts must be an int, got float 8.0"),
    "dispatch_x_dims": ("ValueError", r"dispatch: x must be shaped \[\*, \*\], got \[8, 128, 1\]"),
    "dispatch_x_type": ("TypeError", r"dispatch: x must be a tensor or a 2-tuple \(x_fp8, x_scales\), got a list of length 3"),
    "dispatch_x_strides": ("ValueError", r"x must be row-major .*got strides \(1, 8\)"),
    "dispatch_fp8_tuple_len": ("TypeError", r"x must be a tensor or a 2-tuple \(x_fp8, x_scales\), got a tuple of length 1"),
    "dispatch_fp8_dtype": ("TypeError", r"x\[0\] must be of dtype float8_e4m3fn or .*got \[8, 128\] float32"),
    "dispatch_scales_rows": ("ValueError", r"x\[1\] \(scales\) must be shaped \[8, \*\], got \[9, 1\]"),
    "dispatch_scales_dtype": ("TypeError", r"x\[1\] \(scales\) must be of dtype float32 or int32, got .* float16"),
    "dispatch_topk_without_weights": ("ValueError", r"topk_idx and topk_weights must be given together or both None"),
    "dispatch_weights_shape": ("ValueError", r"topk_weights must be shaped \[8, 2\], got \[8, 3\]"),
    "dispatch_weights_dtype": ("TypeError", r"topk_weights must be of dtype float32, got \[8, 2\] float64"),
    "dispatch_topk_rows": ("ValueError", r"topk_idx must be shaped \[8, \*\], got \[7, 2\]"),
    "dispatch_worst_without_topk": ("ValueError", r"topk_idx must be given when num_worst_tokens > 0"),
    "dispatch_worst_negative": ("ValueError", r"num_worst_tokens must be >= 0, got -1"),
    "dispatch_alignment_zero": ("ValueError", r"expert_alignment must be >= 1, got 0"),
    "dispatch_partial_layout": ("ValueError", r"must be all given or all None, got .*NoneType None"),
    "dispatch_no_layout_no_experts": ("ValueError", r"or topk_idx and num_experts given to compute them, got all None"),
    "dispatch_num_experts_mismatch": ("ValueError", r"num_experts must be len\(num_tokens_per_expert\) = 8, got 16"),
    "dispatch_rank_counts_mismatch": ("ValueError", r"num_tokens_per_rank must be the column sums of is_token_in_rank \[8\], got \[0\]"),
    "dispatch_in_rank_shape": ("ValueError", r"is_token_in_rank must be shaped \[8, 1\], got \[8, 2\]"),
    "dispatch_per_expert_dtype": ("TypeError", r"num_tokens_per_expert must be of dtype int32, got \[8\] int64"),
    "dispatch_handle_with_topk": ("ValueError", r"topk_idx and topk_weights must be None in cached mode"),
    "dispatch_handle_not_tuple": ("TypeError", r"handle must be the 6-tuple returned by a non-cached dispatch, got str"),
    "dispatch_handle_tensor_dtype": ("TypeError", r"handle\[0\] \(rank_prefix_matrix\) must be of dtype int32, got \[1, 1\] int64"),
    "dispatch_handle_rows": ("ValueError", r"x must be 8 rows \(the tokens of the handle's dispatch\), got \[9, 128\]"),
    "dispatch_comm_stream_without_event": ("ValueError", r"allocate_on_comm_stream must be False unless previous_event is given"),
    "dispatch_previous_event_type": ("TypeError", r"previous_event must be an EventOverlap or None, got str"),
    "dispatch_async_type": ("TypeError", r"async_finish must be a bool, got int 1"),
    "dispatch_config_type": ("TypeError", r"config must be a moe_comm.Config or None, got dict"),
    "combine_x_dtype": ("TypeError", r"combine: x must be of dtype float32 or bfloat16 or float16, got \[3, 128\] int32"),
    "combine_x_rows": ("ValueError", r"combine: x must be \[8 \(rows received by dispatch\), hidden\], got \[10000, 128\]"),
    "combine_weights_dtype": ("TypeError", r"combine: topk_weights must be of dtype float32"),
    "combine_bias_shape": ("ValueError", r"bias\[0\] must be shaped \[8, 128\], got \[8, 129\]"),
    "combine_bias_dtype": ("TypeError", r"bias\[1\] must be of dtype bfloat16, got \[8, 128\] float32"),
    "combine_bias_type": ("TypeError", r"bias must be None, a tensor or a 2-tuple of tensors, got list"),
    "combine_handle_len": ("TypeError", r"handle must be the 6-tuple returned by a non-cached dispatch, got tuple of length 5"),
    "combine_x_type": ("TypeError", r"combine: x must be a tensor, got str"),
    "dispatch_device_mismatch": ("ValueError", r"dispatch: topk_idx must be on meta \(the device of x\), got \[8, 2\] int64 on cpu"),
    "dispatch_handle_src_idx_short": ("ValueError", r"handle\[3\] \(recv_src_idx\) must be at least rank_prefix_matrix\[-1, 0\] = 8 rows, got \[0\]"),
    "dispatch_handle_send_head_shape": ("ValueError", r"handle\[5\] \(send_head\) must be shaped \[8, 1\], got \[1, 1\]"),
    "layout_async_type": ("TypeError", r"get_dispatch_layout: async_finish must be a bool, got str 'yes'"),
    "combine_weights_rows": ("ValueError", r"combine: topk_weights must be shaped \[8, \*\], got \[11, 2\]"),
    "destroy_not_explicit": ("RuntimeError", r"Buffer.destroy: needs Buffer\(..., explicitly_destroy=True\)"),
    "set_num_sms_odd": ("ValueError", r"Buffer.set_num_sms: new_num_sms must be even, got 3"),
    "buffer_negative_bytes": ("ValueError", r"Buffer: num_nvl_bytes must be >= 0, got -1"),
    "buffer_flag_type": ("TypeError", r"Buffer: low_latency_mode must be a bool, got str 'yes'"),
    "buffer_group_type": ("TypeError", r"Buffer: group must be a torch.distributed ProcessGroup, got str 'world'"),
    "buffer_timeout": ("ValueError", r"Buffer: timeout_s must be a positive number of seconds, got int 0"),
    "buffer_timeout_type": ("ValueError", r"Buffer: timeout_s must be a positive number of seconds, got str '5'"),
    "buffer_qps_negative": ("ValueError", r"Buffer: num_qps_per_rank must be >= 0, got -2"),
    "buffer_transport_type": ("TypeError", r"Buffer: transport must be a str, got NoneType None"),
    "buffer_transport": ("ValueError", r"Buffer: transport must be 'auto' or one of \['collective', 'mpi', 'shm'\], got 'carrier-pigeon'"),
    "buffer_comm": ("TypeError", r"Buffer: comm must be an mpi4py intra-communicator \(e.g. MPI.COMM_WORLD\), "
                                 r"got object"),
    "mask_without_shrink": ("RuntimeError", r"low_latency_update_mask_buffer: needs a Buffer created with "
                                            r"enable_shrink=True"),
    "mask_rank_range": ("ValueError", r"low_latency_update_mask_buffer: rank_to_mask must be a rank in \[0, 1\), "
                                      r"got 1$"),
    "mask_rank_type": ("TypeError", r"low_latency_update_mask_buffer: rank_to_mask must be an int, got float"),
    "mask_self": ("ValueError", r"low_latency_update_mask_buffer: rank_to_mask must be another rank than this one "
                                r"\(0\), got 0"),
    "mask_flag": ("TypeError", r"low_latency_update_mask_buffer: mask must be a bool"),
    "mask_status_shape": ("ValueError", r"low_latency_query_mask_buffer: mask_status must be shaped \[1\], got \[2\]"),
    "mask_status_dtype": ("TypeError", r"low_latency_query_mask_buffer: mask_status must be of dtype int32"),
    "ll_not_low_latency_mode": ("RuntimeError", r"low_latency_dispatch: needs a Buffer created with low_latency_mode=True"),
    "ll_rdma_bytes_small": ("ValueError", r"low_latency_dispatch: the Buffer's num_rdma_bytes must be >= \d+ for "
                            r"num_max_dispatch_tokens_per_rank=8, hidden=128, num_experts=8 \(create it with "
                            r"num_rdma_bytes=Buffer.get_low_latency_rdma_size_hint\(8, 128, 1, 8\)\), got 1024"),
    "ll_x_dtype": ("TypeError", r"low_latency_dispatch: x must be of dtype bfloat16, got \[8, 128\] float32"),
    "ll_x_type": ("TypeError", r"low_latency_dispatch: x must be a tensor \[\*, \*\], got list"),
    "ll_hidden": ("ValueError", r"low_latency_dispatch: x must be \[T, hidden\] with hidden a positive multiple of "
                  r"128, got \[8, 200\] bfloat16 on cpu"),
    "ll_too_many_tokens": ("ValueError", r"x must be at most num_max_dispatch_tokens_per_rank = 8 rows, got \[9, 128\]"),
    "ll_topk_rows": ("ValueError", r"low_latency_dispatch: topk_idx must be shaped \[8, \*\], got \[7, 2\]"),
    "ll_topk_duplicate": ("ValueError", r"topk_idx must be rows that pick each expert at most once, got row 3 picking "
                          r"expert \d twice"),
    "ll_topk_range": ("ValueError", r"topk_idx must be expert ids in \[-1, 8\)"),
    "ll_m_zero": ("ValueError", r"num_max_dispatch_tokens_per_rank must be >= 1, got 0"),
    "ll_num_experts_type": ("TypeError", r"low_latency_dispatch: num_experts must be an int, got float 8.0"),
    "ll_ue8m0_without_round_scale": ("ValueError", r"round_scale must be True when use_ue8m0=True"),
    "ll_ue8m0_hidden": ("ValueError", r"x must be \[T, hidden\] with hidden a multiple of 512 for use_ue8m0"),
    "ll_async_and_hook": ("ValueError", r"async_finish and return_recv_hook must be not both True \(as DeepEP asserts\)"),
    "ll_flag_type": ("TypeError", r"low_latency_dispatch: use_fp8 must be a bool, got int 1"),
    "ll_recv_stats_dtype": ("TypeError", r"cumulative_local_expert_recv_stats must be of dtype int32, got \[8\] int64"),
    "ll_wait_stats_shape": ("ValueError", r"dispatch_wait_recv_cost_stats must be shaped \[1\], got \[2, 2\] int64"),
    "llc_logfmt_zero_copy": ("ValueError", r"low_latency_combine: use_logfmt must be False with zero_copy=True"),
    "llc_handle_len": ("TypeError", r"handle must be the 5-tuple \(src_info, layout_range, "
                       r"num_max_dispatch_tokens_per_rank, hidden, num_experts\) returned by low_latency_dispatch, "
                       r"got tuple of length 4"),
    "llc_handle_range": ("ValueError", r"handle\[1\] \(layout_range\) must be begin << 32 \| count blocks by source "
                         r"rank ascending inside "
                         r"\[0, 8\)"),
    "llc_x_shape": ("ValueError", r"low_latency_combine: x must be shaped \[8, 8, 128\], got \[8, 8, 256\]"),
    "llc_x_dtype": ("TypeError", r"low_latency_combine: x must be of dtype bfloat16, got \[8, 8, 128\] float32"),
    "llc_weights_shape": ("ValueError", r"topk_weights must be shaped \[8, 2\], got \[8, 3\]"),
    "llc_out_shape": ("ValueError", r"low_latency_combine: out must be shaped \[8, 128\], got \[9, 128\]"),
    "llc_out_strides": ("ValueError", r"low_latency_combine: out must be contiguous, got strides \(1, 8\)"),
    "llc_zero_copy_without_buffer": ("RuntimeError", r"zero_copy=True reads the buffer from "
                                     r"get_next_low_latency_combine_buffer\(handle\), which must be called"),
    "llc_stats_dtype": ("TypeError", r"combine_wait_recv_cost_stats must be of dtype int64, got \[1\] int32"),
    "ll_clean_hidden": ("ValueError", r"clean_low_latency_buffer: hidden must be a multiple of 128, got 200"),
    "ll_next_buffer_handle": ("TypeError", r"get_next_low_latency_combine_buffer: handle must be the 5-tuple"),
    "ll_size_hint_hidden": ("ValueError", r"get_low_latency_rdma_size_hint: hidden must be >= 128, got 64"),
    "layout_experts_huge": ("ValueError", r"^get_dispatch_layout: num_experts must be at most 2147483647 \(experts are "
                                          r"numbered with int32 in counts and records\), got 1099511627776$"),
    "layout_experts_too_big_for_memory": ("ValueError", r"^get_dispatch_layout: num_experts must be small enough for "
                                                        r"the per-expert counts to fit on cpu \(34359738352 bytes "
                                                        r"needed, \d+ there\), got 2147483647$"),
    "dispatch_experts_huge": ("ValueError", r"^dispatch: num_experts must be at most 2147483647"),
    "dispatch_worst_huge": ("ValueError", r"^dispatch: num_worst_tokens must be at most 2147483647 \(received rows "
                                          r"are numbered with int32 \(handle\[3\]\)\), got 1099511627776$"),
    "dispatch_worst_too_big_for_memory": ("ValueError", r"^dispatch: num_worst_tokens must be small enough for "
                                                        r"2147483647 padded rows of outputs to fit on cpu"),
    "dispatch_alignment_huge": ("ValueError", r"^dispatch: expert_alignment must be at most 2147483647"),
    "ll_m_huge": ("ValueError", r"^low_latency_dispatch: num_max_dispatch_tokens_per_rank must be at most 2147483647 "
                                r"\(the num_ranks \* M = 1 \* M rows of an expert's block are numbered with int32\), "
                                r"got 1099511627776$"),
    "ll_m_too_big_for_memory": ("ValueError", r"^low_latency_dispatch: num_max_dispatch_tokens_per_rank must be small "
                                              r"enough for the \[8, 1073741824, 128\] receive buffer to fit on cpu"),
    "ll_experts_huge": ("ValueError", r"^low_latency_dispatch: num_experts must be at most 2147483647"),
}


def test_every_case_has_an_expectation():
    assert set(CASES) == set(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_bad_argument(worlds, name):
    (kind, message), = set(worlds(1).run(run_case, name))
    want_kind, pattern = EXPECTED[name]
    assert kind == want_kind, message
    assert __import__("re").search(pattern, message), message


@pytest.mark.every_transport
@pytest.mark.parametrize("transport", ("shm", "cuda_host"), indirect=True)  # the kinds that prepare calls
@pytest.mark.parametrize("name", sorted(n for n in EXPECTED if n.startswith(("ll_", "llc_", "dispatch_", "combine_"))))
def test_bad_argument_after_a_valid_call(worlds, name):
    """The same errors when a valid call of the bad call's signature came first: its prepared call declines
    every bad argument, and the checked path words the error (on every kind that prepares calls)."""
    (kind, message), = set(worlds(1).run(run_case, name, True))
    want_kind, pattern = EXPECTED[name]
    assert kind == want_kind, message
    assert __import__("re").search(pattern, message), message


def test_use_after_destroy(worlds):
    (kind, message), = set(worlds(1).run(after_destroy))
    assert kind == "RuntimeError" and "dispatch: this Buffer was destroyed" in message


def test_transport_from_environment(worlds):
    assert worlds(1).run(env_transport, "collective") == [("ok", "collective")]
    (kind, message), = set(worlds(1).run(env_transport, "shm-later"))
    assert kind == "ValueError"
    assert "got 'shm-later' (from MOE_COMM_TRANSPORT)" in message


def test_buffer_without_group_before_init_process_group():
    import torch.distributed as dist

    import moe_comm

    assert not dist.is_initialized()  # the test process itself never joins a group
    with pytest.raises(ValueError, match=r"Buffer: group must be a torch.distributed ProcessGroup, or None with comm= "
                                         r"or after init_process_group, got None, and torch.distributed is not "
                                         r"initialized"):
        moe_comm.Buffer()

"""The same dispatch/combine on CUDA tensors over NCCL and on CPU tensors over gloo, compared bitwise."""
from __future__ import annotations

import torch
import torch.distributed as dist

import moe_comm
from moe_comm.ops import per_token_cast_to_fp8


def cuda_matches_cpu(group: dist.ProcessGroup) -> int:
    cpu_group = dist.new_group(list(range(dist.get_world_size(group))), backend="gloo")
    on_gpu, on_cpu = moe_comm.Buffer(group, timeout_s=60), moe_comm.Buffer(cpu_group, timeout_s=60)
    g = torch.Generator().manual_seed(dist.get_rank(group))
    tokens, hidden, experts, topk = 96, 256, 16, 4
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    w = torch.rand(tokens, topk, generator=g)
    fp8, scales = per_token_cast_to_fp8(x)
    checks = 0
    results = []
    for buf, dev in ((on_cpu, "cpu"), (on_gpu, "cuda")):
        layout = buf.get_dispatch_layout(idx.to(dev), experts)
        recv_x, recv_idx, recv_w, recv_list, handle, _ = buf.dispatch(
            x.to(dev), num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2],
            topk_idx=idx.to(dev), topk_weights=w.to(dev), expert_alignment=4)
        (r8, rs), *_ = buf.dispatch((fp8.to(dev), scales.T.contiguous().T.to(dev)), handle=handle)
        worst = buf.dispatch(x.to(dev), topk_idx=idx.to(dev), topk_weights=w.to(dev), num_experts=experts,
                             num_worst_tokens=tokens * buf.group_size)
        y, y_w, _ = buf.combine(recv_x, handle, topk_weights=recv_w, bias=x.to(dev))
        results.append([t.cpu() for t in (*layout[:1], layout[2], layout[3], recv_x, recv_idx, recv_w, *handle,
                                          r8.view(torch.uint8), rs, worst[0], worst[1], y, y_w)] + [recv_list])
    for a, b in zip(*results):
        assert (a == b) if isinstance(a, list) else torch.equal(a, b)
        checks += 1
    return checks


def cuda_low_latency_matches_cpu(group: dist.ProcessGroup) -> int:
    """Low-latency dispatch (BF16, FP8, UE8M0) and combine: CUDA over NCCL equals CPU over gloo bitwise."""
    cpu_group = dist.new_group(list(range(dist.get_world_size(group))), backend="gloo")
    tokens, hidden, experts, topk = 32, 512, 8 * dist.get_world_size(group), 4
    size = moe_comm.Buffer.get_low_latency_rdma_size_hint(tokens, hidden, dist.get_world_size(group), experts)
    on_gpu, on_cpu = (moe_comm.Buffer(g, num_rdma_bytes=size, low_latency_mode=True, timeout_s=60)
                      for g in (group, cpu_group))
    g = torch.Generator().manual_seed(dist.get_rank(group))
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    idx[torch.rand(idx.shape, generator=g) < 0.2] = -1
    w = torch.rand(tokens, topk, generator=g)
    results = []
    for buf, dev in ((on_cpu, "cpu"), (on_gpu, "cuda")):
        got = []
        for use_fp8, round_scale, ue8m0 in ((False, False, False), (True, False, False), (True, True, True)):
            recv, count, handle, _, hook = buf.low_latency_dispatch(x.to(dev), idx.to(dev), tokens, experts,
                                                                    use_fp8=use_fp8, round_scale=round_scale,
                                                                    use_ue8m0=ue8m0, return_recv_hook=True)
            hook()
            parts = list(recv) if use_fp8 else [recv]
            got += [p.contiguous().reshape(-1).view(torch.uint8).cpu() for p in parts] + [count.cpu(), handle[0].cpu(),
                                                                                handle[1].cpu()]
        recv, _, handle, _, _ = buf.low_latency_dispatch(x.to(dev), idx.to(dev), tokens, experts, use_fp8=False)
        y, _, _ = buf.low_latency_combine(recv, idx.to(dev), w.to(dev), handle)
        results.append(got + [y.view(torch.int16).cpu()])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    return len(results[0])

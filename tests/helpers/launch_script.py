"""A tiny EP round trip started by a launcher (torchrun or mpirun); prints one line per rank."""
import sys

import torch

import moe_comm

group = moe_comm.init_from_env(timeout_s=60)
buf = moe_comm.Buffer(group, timeout_s=30)
g = torch.Generator().manual_seed(buf.rank)
x = torch.randn(16, 32, generator=g).to(torch.bfloat16)
idx = torch.stack([torch.randperm(4 * buf.group_size, generator=g)[:2] for _ in range(16)])
recv_x, _, _, _, handle, _ = buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand(16, 2), num_experts=4 * buf.group_size)
y, _, _ = buf.combine(recv_x, handle)
assert torch.allclose(y.float(), x.float() * handle[4].sum(1, keepdim=True), rtol=1e-2)
sys.stdout.write(f"rank {buf.rank}/{buf.group_size} ok\n")  # one write: lines of ranks may interleave
sys.stdout.flush()

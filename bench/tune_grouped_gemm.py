"""Times the Triton grouped GEMM under a list of tile configs on one GPU, next to ``torch._grouped_mm``,
to choose ``moe_comm.ops.grouped_gemm.default_config``.

    python bench/tune_grouped_gemm.py [--tokens 4096 --hidden 7168 --intermediate 2048 --experts 32 --topk 8]

Cases are one EP rank's expert GEMMs at DeepSeek-V3 shapes (rows from a random top-k routing,
aligned to 128): the gate/up projection (BF16, FP8 with 128x128 block scales, and SwiGLU-fused) and
the down projection. Every config's output is checked against the default config's (calc_diff)
before it is timed. Medians of CUDA-event timings (``triton.testing.do_bench``).
"""
from __future__ import annotations

import argparse
import sys

import torch

from moe_comm import accuracy, ops
from moe_comm.ops.grouped_gemm import GemmArgs, GemmConfig, default_config, launch_gemm

CONFIGS = {
    False: [GemmConfig(*c) for c in ((64, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3), (128, 256, 64, 8, 8, 3),
                                     (128, 256, 64, 1, 8, 3), (128, 256, 64, 8, 8, 4), (256, 128, 64, 8, 8, 3),
                                     (128, 256, 32, 8, 8, 4))],
    True: [GemmConfig(*c) for c in ((64, 128, 128, 8, 8, 3), (128, 128, 128, 8, 8, 3), (128, 128, 128, 8, 8, 4),
                                    (128, 128, 128, 1, 8, 4), (128, 64, 128, 8, 4, 3))],
}
SWIGLU = {
    False: [GemmConfig(*c) for c in ((64, 64, 64, 8, 8, 3), (128, 64, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3),
                                     (128, 128, 64, 8, 8, 4), (128, 128, 64, 1, 8, 3))],
    True: [GemmConfig(*c) for c in ((64, 128, 128, 8, 8, 3), (128, 64, 128, 8, 8, 3), (128, 128, 128, 8, 8, 3),
                                    (128, 128, 128, 8, 8, 4))],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("tokens", 4096), ("hidden", 7168), ("intermediate", 2048), ("experts", 32), ("topk", 8)):
        p.add_argument(f"--{name}", type=int, default=default)
    cfg = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        return 2
    from triton.testing import do_bench
    torch.manual_seed(0)
    dev = torch.device("cuda")
    T, H, I, E, K = cfg.tokens, cfg.hidden, cfg.intermediate, cfg.experts, cfg.topk
    topk = torch.rand(T, E, device=dev).argsort(dim=1)[:, :K]
    perm = ops.permute(torch.randn(T, H, device=dev).bfloat16(), topk, E, alignment=128)
    offsets = perm.expert_offsets
    w13 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).bfloat16()
    w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).bfloat16()
    x8, x_scales = ops.quantize(perm.x, "e4m3")
    w13_8 = (w13.float() * 64).to(torch.float8_e4m3fn)
    w13_scales = torch.full((E, 2 * I // 128, H // 128), 1 / 64, device=dev)
    h = torch.randn(perm.x.shape[0], I, device=dev).bfloat16()
    rows = int(perm.num_tokens_per_expert.sum())
    cases = [
        ("gate_up bf16", GemmArgs("tune", perm.x, w13, offsets, None, None, None, 2 * I), False, CONFIGS[False]),
        ("gate_up fp8", GemmArgs("tune", x8, w13_8, offsets, None, x_scales, w13_scales, 2 * I), False, CONFIGS[True]),
        ("gate_up swiglu bf16", GemmArgs("tune", perm.x, w13, offsets, None, None, None, I), True, SWIGLU[False]),
        ("gate_up swiglu fp8", GemmArgs("tune", x8, w13_8, offsets, None, x_scales, w13_scales, I), True, SWIGLU[True]),
        ("down bf16", GemmArgs("tune", h, w2, offsets, None, None, None, H), False, CONFIGS[False]),
    ]
    ends = offsets[1:].to(torch.int32)
    baselines = {"gate_up bf16": lambda: torch._grouped_mm(perm.x, w13.transpose(1, 2), offs=ends),
                 "down bf16": lambda: torch._grouped_mm(h, w2.transpose(1, 2), offs=ends)}
    print(f"{torch.cuda.get_device_name()}; tokens {T}, hidden {H}, intermediate {I}, experts {E}, top-{K}; "
          f"{rows} routed rows ({perm.x.shape[0]} with padding)")
    print(f"{'case':22} {'config (bm, bn, bk, group_m, warps, stages)':46} {'median_us':>10} {'TFLOP/s':>8}")
    for name, args, swiglu, configs in cases:
        n, k = args.b_rows, args.k
        flops = 2.0 * rows * n * k
        reference = torch.zeros(args.a.shape[0], args.n_out, dtype=torch.bfloat16, device=dev)
        launch_gemm(args, reference, swiglu)
        default = default_config(args.a_scales is not None, swiglu, False)
        for config in configs:
            out = torch.zeros_like(reference)
            launch_gemm(args, out, swiglu, config)
            diff = accuracy.calc_diff(out, reference)
            if diff > 1e-5:
                print(f"{name:22} {str(tuple(config)):46} WRONG: calc_diff {diff:.2e} against the default config")
                continue
            ms = do_bench(lambda: launch_gemm(args, out, swiglu, config), warmup=5, rep=40, return_mode="median")
            mark = " (default)" if config == default else ""
            print(f"{name:22} {str(tuple(config)) + mark:46} {ms * 1e3:10.1f} {flops / ms / 1e9:8.1f}")
        if name in baselines:
            ms = do_bench(baselines[name], warmup=5, rep=40, return_mode="median")
            print(f"{name:22} {'torch._grouped_mm':46} {ms * 1e3:10.1f} {flops / ms / 1e9:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

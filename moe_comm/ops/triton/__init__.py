"""Triton kernels of ``moe_comm.ops``, one module per op. These modules import only ``triton`` (no
torch, no moe_comm), so a vendor's Triton front end can compile them by file path alone
(``tools/triton_ascend_check.py``); the typed wrappers that launch them live in ``moe_comm.ops``.

Portability rules the kernels keep (after triton-ascend's documented Ascend A2/A3 limits): no inline
assembly or vendor ``tl.extra`` calls, no cross-program waits, bf16 math done in fp32, int32 atomics
only, division through ``tl.math.div_rn`` (IEEE, so results match the torch references bit for bit).
"""

"""Local compute around communication. Each op: one public function that picks a backend by device
(``native``: ``_C`` or torch ops; ``triton``: one kernel source for every vendor, see ``backend``) and
a plain-torch ``*_reference`` that is its specification. Ops never import a transport."""
from .backend import BACKENDS, resolve, triton_usable
from .combine_reduce import combine_reduce, combine_reduce_reference
from .digest import (digests, digests_reference, low_latency_combine_digests, low_latency_combine_digests_reference,
                     sent_tokens, sent_tokens_reference)
from .expert_ffn import expert_ffn, expert_ffn_reference
from .fp8 import per_block_cast_to_fp8, per_token_cast_back, per_token_cast_to_fp8, ue8m0_to_float
from .grouped_gemm import grouped_gemm, grouped_gemm_reference
from .layout import DispatchLayout, dispatch_layout, dispatch_layout_reference
from .low_latency_layout import (combine_rows, combine_rows_reference, layout_range_check, layout_range_check_reference,
                                 low_latency_unpack, low_latency_unpack_reference, send_order, send_order_reference)
from .permute import Permutation, max_permuted_rows, permute, permute_reference
from .quant import FORMATS, dequantize, dequantize_reference, quantize, quantize_reference
from .records import (RecordLayout, gather_rows, gather_rows_reference, pack_rows, pack_rows_reference, unpack_rows,
                      unpack_rows_reference)
from .unpermute import unpermute_reduce, unpermute_reduce_reference

__all__ = [
    "BACKENDS", "resolve", "triton_usable",
    "DispatchLayout", "dispatch_layout", "dispatch_layout_reference",
    "Permutation", "permute", "permute_reference", "max_permuted_rows",
    "unpermute_reduce", "unpermute_reduce_reference",
    "FORMATS", "quantize", "quantize_reference", "dequantize", "dequantize_reference",
    "grouped_gemm", "grouped_gemm_reference", "expert_ffn", "expert_ffn_reference",
    "RecordLayout", "pack_rows", "pack_rows_reference", "unpack_rows", "unpack_rows_reference",
    "gather_rows", "gather_rows_reference",
    "combine_reduce", "combine_reduce_reference",
    "per_token_cast_to_fp8", "per_token_cast_back", "per_block_cast_to_fp8", "ue8m0_to_float",
    "send_order", "send_order_reference", "combine_rows", "combine_rows_reference",
    "low_latency_unpack", "low_latency_unpack_reference", "layout_range_check", "layout_range_check_reference",
    "digests", "digests_reference", "sent_tokens", "sent_tokens_reference", "low_latency_combine_digests",
    "low_latency_combine_digests_reference",
]

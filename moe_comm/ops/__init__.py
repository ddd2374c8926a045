"""Local compute around communication, for users and for backends. Each op: one public function that
picks an implementation (``impl=``, or MOE_COMM_OPS_IMPL, or by device: ``native``, ``_C`` or torch ops;
``triton``, one kernel source for every vendor; see ``impl``) and a plain-torch ``*_reference`` that is
its specification. Ops never import a transport or a backend.

Exported here: the ops a MoE layer calls, and the LogFMT-10 codec of the low-latency combine (``logfmt``).
The row-record kernels that the portable backend's exchange is built on (``records``: pack and unpack;
``combine_reduce``: the fixed-order reduction, which ``unpermute_reduce`` reuses) are modules of this
package, not exported."""
from .expert_ffn import expert_ffn, expert_ffn_reference
from .fp8 import per_block_cast_to_fp8, per_token_cast_back, per_token_cast_to_fp8, ue8m0_to_float
from .grouped_gemm import grouped_gemm, grouped_gemm_reference
from .impl import IMPLS, resolve, triton_usable
from .layout import DispatchLayout, dispatch_layout, dispatch_layout_reference
from .logfmt import logfmt_decode, logfmt_decode_reference, logfmt_encode, logfmt_encode_reference, logfmt_row_bytes
from .permute import Permutation, max_permuted_rows, permute, permute_reference
from .quant import FORMATS, dequantize, dequantize_reference, quantize, quantize_reference
from .rows import take_rows, take_rows_reference
from .unpermute import unpermute_reduce, unpermute_reduce_reference

__all__ = [
    "IMPLS", "resolve", "triton_usable",
    "DispatchLayout", "dispatch_layout", "dispatch_layout_reference",
    "Permutation", "permute", "permute_reference", "max_permuted_rows",
    "unpermute_reduce", "unpermute_reduce_reference",
    "FORMATS", "quantize", "quantize_reference", "dequantize", "dequantize_reference",
    "grouped_gemm", "grouped_gemm_reference", "expert_ffn", "expert_ffn_reference",
    "take_rows", "take_rows_reference",
    "logfmt_row_bytes", "logfmt_encode", "logfmt_encode_reference", "logfmt_decode", "logfmt_decode_reference",
    "per_token_cast_to_fp8", "per_token_cast_back", "per_block_cast_to_fp8", "ue8m0_to_float",
]


def __getattr__(name: str):  # the old name of IMPLS, for callers written before the rename
    if name == "BACKENDS":
        import warnings
        warnings.warn("moe_comm.ops.BACKENDS is deprecated: use moe_comm.ops.IMPLS", DeprecationWarning, stacklevel=2)
        return IMPLS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

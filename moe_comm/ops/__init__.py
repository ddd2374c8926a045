"""Local compute around communication. Each op: a typed wrapper (``_C`` on CPU, torch elsewhere)
and a plain-torch ``*_reference`` that is its specification. Ops never import a transport."""
from .combine_reduce import combine_reduce, combine_reduce_reference
from .fp8 import per_token_cast_back, per_token_cast_to_fp8, ue8m0_to_float
from .layout import DispatchLayout, dispatch_layout, dispatch_layout_reference
from .low_latency_layout import (combine_rows, combine_rows_reference, low_latency_unpack, low_latency_unpack_reference,
                                 send_order, send_order_reference)
from .records import (RecordLayout, gather_rows, gather_rows_reference, pack_rows, pack_rows_reference, unpack_rows,
                      unpack_rows_reference)

__all__ = [
    "DispatchLayout", "dispatch_layout", "dispatch_layout_reference",
    "RecordLayout", "pack_rows", "pack_rows_reference", "unpack_rows", "unpack_rows_reference",
    "gather_rows", "gather_rows_reference",
    "combine_reduce", "combine_reduce_reference",
    "per_token_cast_to_fp8", "per_token_cast_back", "ue8m0_to_float",
    "send_order", "send_order_reference", "combine_rows", "combine_rows_reference",
    "low_latency_unpack", "low_latency_unpack_reference",
]

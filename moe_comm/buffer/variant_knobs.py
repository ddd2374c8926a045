"""Keywords that DeepEP forks and branches add to the low-latency calls and engines pass when a
feature is on (NVFP4 dispatch, DeepEP-Ascend's quantization, single-batch-overlap signals), which
moe-comm does not implement.

Each is accepted at its "off" value, so engines that always pass it still work, and otherwise
raises NotImplementedError naming the keyword, the feature and where it comes from. An unknown
keyword raises TypeError, as Python does.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple

from ..core.checks import describe

__all__ = ["LOW_LATENCY_DISPATCH", "LOW_LATENCY_COMBINE", "reject_unsupported"]


class Knob(NamedTuple):
    is_off: Callable[[Any], bool]
    feature: str
    origin: str


def _none(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is False or value is None


def _companion(value: Any) -> bool:
    """A tuning value read only while its feature is on; any value is accepted."""
    return True


_NVFP4 = "vLLM 0.32 and SGLang 0.5 pass it for NVFP4 MoE (DeepEP's hybrid-ep branch)"
_ASCEND = "DeepEP-Ascend (sgl-kernel-npu); SGLang passes it on NPUs"
_SBO = "DeepEP's antgroup-opt branch; SGLang passes it with single-batch overlap"

LOW_LATENCY_DISPATCH: dict[str, Knob] = {
    "use_nvfp4": Knob(_false, "NVFP4 dispatch", _NVFP4),
    "x_global_scale": Knob(_none, "NVFP4 dispatch (its global scale)", _NVFP4),
    "topk_weights": Knob(_none, "weights sent with the dispatch", _ASCEND),
    "quant_mode": Knob(_none, "an NPU quantization mode", _ASCEND),
    "use_mxfp4": Knob(_false, "MXFP4 dispatch", _ASCEND),
    "use_mxfp8": Knob(_false, "MXFP8 dispatch", _ASCEND),
}

LOW_LATENCY_COMBINE: dict[str, Knob] = {
    "overlap": Knob(_false, "a combine overlapped with the expert GEMM by signals", _SBO),
    "packed_recv_count": Knob(_none, "a signal-overlapped combine", _SBO),
    "comp_signal": Knob(_none, "a signal-overlapped combine", _SBO),
    "src_signals": Knob(_none, "a signal-overlapped combine (Blackwell)", _SBO),
    "block_m": Knob(_companion, "", _SBO),
    "threshold": Knob(_companion, "", _SBO),
    "num_sms": Knob(_companion, "", _SBO),
    "src_signal_expect_value": Knob(_companion, "", _SBO),
}


def reject_unsupported(op: str, table: dict[str, Knob], extras: dict[str, Any]) -> None:
    """Raises for each keyword of ``extras`` not in ``table`` (TypeError) or not at its off value
    (NotImplementedError); returns when all are off."""
    for name, value in extras.items():
        knob = table.get(name)
        if knob is None:
            raise TypeError(f"{op}() got an unexpected keyword argument {name!r}")
        if not knob.is_off(value):
            raise NotImplementedError(
                f"{op}: {name}={describe(value)} asks for {knob.feature}, which moe-comm does not implement "
                f"({knob.origin}); leave it unset to use moe-comm's BF16/FP8 path")

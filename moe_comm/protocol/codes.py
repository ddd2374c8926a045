"""Every integer code that travels between ranks, in one place.

The portable backend's handshake (``protocol/handshake.py``) sends one int64 vector per
call; these enums name its slots and the values they hold. Python code uses the members, never the
bare integers. ``WireDType`` is the element-type table of ``csrc/common/codes.h``, the one source that
the CPU and CUDA kernels compile and bind (``moe_comm._C.DType``); a test checks that the two agree.
Wait outcomes are bound from the same header (``moe_comm._C.WaitOutcome``).
"""
from __future__ import annotations

from enum import IntEnum
from typing import Optional

import torch

__all__ = ["UNKNOWN", "Op", "Field", "Fp8Format", "WireDType"]

#: a slot this rank cannot fill (a field the operation does not use, a count not yet known)
UNKNOWN = -1


class Op(IntEnum):
    """The operation a handshake belongs to."""

    DISPATCH = 1
    CACHED_DISPATCH = 2
    COMBINE = 3
    LOW_LATENCY_DISPATCH = 4
    LOW_LATENCY_COMBINE = 5
    CLEAN_LOW_LATENCY_BUFFER = 6

    @property
    def label(self) -> str:
        """How messages name it: the ``Buffer`` method (``"cached dispatch"`` for a dispatch with a handle)."""
        return "cached dispatch" if self is Op.CACHED_DISPATCH else self.name.lower()

    @classmethod
    def of_method(cls, method: str) -> "Op":
        """The code a call of ``Buffer.<method>`` carries when it rejects its arguments."""
        return cls[method.upper()]


class Field(IntEnum):
    """The scalar slots at the head of a handshake vector, in order (rows per rank follow them)."""

    OP = 0
    CALL = 1              # the Buffer's call number: every collective call advances it, rejected ones too
    REJECTED = 2          # 1 when this rank rejected its own arguments (it then sends no rows)
    HIDDEN = 3
    X_DTYPE = 4           # a WireDType
    NUM_SCALES = 5
    SCALES_DTYPE = 6      # a WireDType
    NUM_TOPK = 7
    NUM_EXPERTS = 8
    NUM_CHANNELS = 9
    HAS_WEIGHTS = 10
    NUM_WORST_TOKENS = 11
    NUM_MAX_DISPATCH_TOKENS_PER_RANK = 12
    FP8_FORMAT = 13       # an Fp8Format
    PREFIX_DIGEST = 14    # digest of a normal handle's rank prefix matrix (the same matrix on every rank)
    NUM_MAX_NVL_CHUNKED_SEND_TOKENS = 15  # the Config's ring geometry: kernels size rings by it
    NUM_MAX_NVL_CHUNKED_RECV_TOKENS = 16
    NUM_MAX_RDMA_CHUNKED_SEND_TOKENS = 17  # compared across nodes only (DeepEP's RDMA rings)
    NUM_MAX_RDMA_CHUNKED_RECV_TOKENS = 18
    USE_LOGFMT = 19       # a low-latency combine's row format (1: LogFMT-10): sizes the records

    @property
    def label(self) -> str:
        """The name messages use: the argument's name (``"num_topk"``)."""
        return self.name.lower()


class Fp8Format(IntEnum):
    """How a low-latency dispatch casts ``x`` (``use_fp8``, ``round_scale``, ``use_ue8m0``)."""

    BF16 = 0
    FP8 = 1               # E4M3, one fp32 scale per 128 channels
    FP8_ROUND_SCALE = 2   # power-of-two fp32 scales
    FP8_UE8M0 = 3         # power-of-two scales packed as UE8M0 bytes

    @property
    def label(self) -> str:
        """``"bf16"``, ``"fp8"``, ``"fp8 round_scale"`` or ``"fp8 ue8m0"``."""
        return self.name.lower().replace("_", " ", 1)

    @property
    def round_scale(self) -> bool:
        """Power-of-two scales (the UE8M0 format has them too)."""
        return self in (Fp8Format.FP8_ROUND_SCALE, Fp8Format.FP8_UE8M0)

    @property
    def ue8m0(self) -> bool:
        return self is Fp8Format.FP8_UE8M0

    @classmethod
    def of(cls, use_fp8: bool, round_scale: bool, use_ue8m0: bool) -> "Fp8Format":
        """The format of checked flags (``use_ue8m0`` implies ``round_scale``, which implies ``use_fp8``)."""
        if not use_fp8:
            return cls.BF16
        return cls.FP8_UE8M0 if use_ue8m0 else cls.FP8_ROUND_SCALE if round_scale else cls.FP8


class WireDType(IntEnum):
    """Tensor dtypes on the wire (the ones this torch lacks are never sent): ``csrc/common/codes.h``'s
    ``DType``, member for member."""

    FLOAT32 = 0
    FLOAT16 = 1
    BFLOAT16 = 2
    FLOAT64 = 3
    INT8 = 4
    UINT8 = 5
    INT16 = 6
    INT32 = 7
    INT64 = 8
    BOOL = 9
    FLOAT8_E4M3FN = 10
    FLOAT8_E5M2 = 11
    FLOAT8_E4M3FNUZ = 12
    FLOAT8_E5M2FNUZ = 13

    @property
    def label(self) -> str:
        """The torch name (``"bfloat16"``)."""
        return self.name.lower()

    @classmethod
    def code(cls, dtype: Optional[torch.dtype]) -> int:
        """The code of ``dtype``, UNKNOWN for None."""
        return UNKNOWN if dtype is None else cls[str(dtype).replace("torch.", "").upper()].value

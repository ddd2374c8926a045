"""The header a low-latency call sends beside its rows: the agreement in the data path.

A low-latency call does not meet its peers before it sends. Each rank writes, to every rank, its
rows and one header: the handshake vector (``handshake.vector``: operation, call number, rejected
bit, hidden, experts, M, format, rows to each rank, and for a combine the digests of its routing)
followed by this rank's rejection message, if it rejected its arguments. The receive half holds
every rank's header and judges them as the handshake would (``CallAgreement.judge``), so every
rank reaches the same verdict without a round trip on the send path.

    header = int64 vector [len(Field) + 4 R] | message [MESSAGE_BYTES] (utf-8, zero padded)
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..core.native import native
from .codes import Field

__all__ = ["MESSAGE_BYTES", "header_bytes", "encode", "decode", "messages", "compare_mask", "agree"]

#: a rejection's message in the header, truncated to fit
MESSAGE_BYTES = 1024
_ALIGN = 64


def header_bytes(vector_len: int) -> int:
    """Bytes of one header for a vector of ``vector_len`` int64 (64-byte aligned)."""
    return -(-(8 * vector_len + MESSAGE_BYTES) // _ALIGN) * _ALIGN


def encode(vector: list[int], message: Optional[str]) -> torch.Tensor:
    """One rank's header as `[header_bytes]` uint8 (CPU)."""
    out = torch.zeros(header_bytes(len(vector)), dtype=torch.uint8)
    out[:8 * len(vector)] = torch.tensor(vector, dtype=torch.int64).view(torch.uint8)
    if message:
        text = message.encode()[:MESSAGE_BYTES]
        out[8 * len(vector):8 * len(vector) + len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    return out


def decode(headers: torch.Tensor, vector_len: int) -> list[list[int]]:
    """Every rank's vector from `[R, header_bytes]` uint8."""
    return headers[:, :8 * vector_len].cpu().contiguous().view(torch.int64).tolist()


def messages(headers: torch.Tensor, vector_len: int, ranks: list[int]) -> list[str]:
    """The messages of ``ranks``'s headers."""
    texts = headers[ranks, 8 * vector_len:8 * vector_len + MESSAGE_BYTES].cpu()
    return [bytes(row.tolist()).rstrip(b"\0").decode(errors="replace") for row in texts]


def compare_mask(compare: Sequence[Field]) -> int:
    """The words a verdict on headers compares, as a bit mask (bit w: vector word w): the operation, the
    call number and ``compare``."""
    mask = 0
    for field in (Field.OP, Field.CALL, *compare):
        mask |= 1 << int(field)
    return mask


def agree(headers: torch.Tensor, vector_len: int, num_fields: int, rank: int, compare: int,
          rejected: int) -> Optional[list[int]]:
    """The rows each rank sends ``rank`` when every header of `[R, header_bytes]` (CPU, each row contiguous)
    agrees, else None: the checks of ``handshake.check`` on the vectors (``compare``: a mask of the words
    alike everywhere, ``compare_mask``; word ``rejected`` zero everywhere; each pair's counts and digests), natively
    (``csrc/common/call_header.h``, which the CUDA kernels' receive runs too). On None the caller judges
    the headers in Python (``CallAgreement.judge``) for the error every rank raises alike."""
    R, nbytes = headers.shape
    if headers.device.type != "cpu" or headers.stride(1) != 1 or headers.stride(0) < nbytes or \
            nbytes < 8 * max(vector_len, 64):
        return None
    agreed, sent = native().headers_agree(headers.data_ptr(), headers.stride(0), R, rank, num_fields, rejected,
                                          compare)
    return sent if agreed else None

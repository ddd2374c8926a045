"""The metadata exchange that opens every collective operation.

Before any payload moves, each rank sends every other rank one small int64 vector: its arguments
(hidden size, dtypes, top-k, number of experts, ...), the rows it will send to each rank and the rows
it expects from each rank. Every rank then holds every rank's vector, so argument mismatches and
count mismatches are found before any payload moves, and every rank raises the same error.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

import torch

from .errors import CrossRankMismatchError
from .transport import Transport

__all__ = ["Handshake", "handshake", "dtype_code", "FP8_FORMATS"]

# Fields of the vector, in order. Unused fields hold -1.
FIELDS = ("op", "hidden", "x_dtype", "num_scales", "scales_dtype", "num_topk", "num_experts",
          "num_channels", "has_weights", "num_worst_tokens", "num_max_dispatch_tokens_per_rank", "fp8_format")
OPS = {1: "dispatch", 2: "cached dispatch", 3: "combine", 4: "low_latency_dispatch", 5: "low_latency_combine",
       6: "clean_low_latency_buffer"}
# fp8_format values (low-latency dispatch)
FP8_FORMATS = {0: "bf16", 1: "fp8", 2: "fp8 round_scale", 3: "fp8 ue8m0"}
_DTYPES = [getattr(torch, n) for n in (
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)]
_DTYPE_FIELDS = ("x_dtype", "scales_dtype")


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    """Small int naming ``dtype`` on the wire (-1 for None)."""
    return -1 if dtype is None else _DTYPES.index(dtype)


def _show(field: str, value: int) -> str:
    if field in _DTYPE_FIELDS:
        return "none" if value < 0 else str(_DTYPES[value]).replace("torch.", "")
    if field == "op":
        return OPS.get(value, f"op {value}")
    if field == "fp8_format":
        return FP8_FORMATS.get(value, f"format {value}")
    return "none" if value < 0 else str(value)


@dataclass(frozen=True)
class Handshake:
    """Every rank's vector, as received by this rank (identical on all ranks). Plain lists: the
    checks on a few ranks' small vectors are cheaper in Python than as tensor ops."""

    # rows[r] = rank r's vector: FIELDS values, then rows sent to each rank, then rows expected
    # from each rank (-1 where it cannot know)
    rows: list[list[int]]

    def field(self, name: str) -> list[int]:
        """Every rank's value of field ``name``."""
        f = FIELDS.index(name)
        return [row[f] for row in self.rows]

    @property
    def sent(self) -> torch.Tensor:
        """``[R, R]`` int64: sent[i, j] = rows rank i sends to rank j."""
        return torch.tensor(self.matrix, dtype=torch.int64)

    @property
    def matrix(self) -> list[list[int]]:
        """``[R][R]``: matrix[i][j] = rows rank i sends to rank j."""
        F, R = len(FIELDS), len(self.rows)
        return [row[F:F + R] for row in self.rows]

    def recv_counts(self, rank: int) -> list[int]:
        """Rows ``rank`` receives from each rank: ``sent[:, rank]``."""
        return [row[len(FIELDS) + rank] for row in self.rows]


def handshake(transport: Transport, op: str, fields: Mapping[str, int], send_counts: Sequence[int],
              expected: Optional[Sequence[int]], compare: Sequence[str], device: torch.device,
              skip: frozenset[int] = frozenset()) -> Handshake:
    """Exchanges this rank's vector with all ranks and checks them. Collective; blocks the host.

    Args:
        fields: values for names in FIELDS (missing ones are sent as -1); must include "op".
        send_counts: rows this rank will send to each rank.
        expected: rows this rank expects from each rank, or None when unknown before the exchange.
        compare: fields that must be equal on every rank.
        device: where the vectors travel (the payload's device: NCCL moves CUDA tensors only).
        skip: masked ranks, left out; their vectors read as this rank's fields with no rows sent
            or expected (this rank must send them nothing).
    Raises:
        CrossRankMismatchError, the same on every rank, when ops, compared fields or counts disagree.
        CommTimeoutError when a rank does not take part before the deadline.
    """
    R = transport.num_ranks
    unknown = [name for name in fields if name not in FIELDS]
    if unknown:
        raise KeyError(f"handshake: unknown fields {unknown}; known: {FIELDS}")
    row = [int(fields.get(name, -1)) for name in FIELDS] + [int(c) for c in send_counts]
    row += [int(c) for c in expected] if expected is not None else [-1] * R
    mine = torch.tensor(row, dtype=torch.int64, device=device).expand(R, len(row)).contiguous()
    got = torch.empty_like(mine)
    transport.all_to_all(got, mine, [1] * R, [1] * R, op=op, skip=skip).wait()
    rows = got.cpu().tolist()
    for r in skip:
        rows[r] = row[:len(FIELDS)] + [0] * R + [-1] * R
    shake = Handshake(rows)
    _check(shake, op, compare)
    return shake


def _per_rank(shake: Handshake, name: str) -> str:
    return ", ".join(f"rank {r}: {_show(name, v)}" for r, v in enumerate(shake.field(name)))


def _check(shake: Handshake, op: str, compare: Sequence[str]) -> None:
    hint = ("every rank must call the same operation with the same hidden size, dtypes, top-k, number of "
            "experts and config")
    if len(set(shake.field("op"))) > 1:  # no local prefix: every rank must word it the same
        raise CrossRankMismatchError(f"ranks called different operations: {_per_rank(shake, 'op')}; {hint}")
    for name in compare:
        if len(set(shake.field(name))) > 1:
            raise CrossRankMismatchError(f"{op}: ranks disagree on {name}: {_per_rank(shake, name)}; {hint}")
    F, R = len(FIELDS), len(shake.rows)
    sent = [row[F:F + R] for row in shake.rows]
    expected = [row[F + R:] for row in shake.rows]
    bad = [(i, j) for i in range(R) for j in range(R) if 0 <= expected[i][j] != sent[j][i]]
    if bad:
        shown = "; ".join(f"rank {i} expects {expected[i][j]} rows from rank {j}, which sends {sent[j][i]}"
                          for i, j in bad[:4])
        more = f" (and {len(bad) - 4} more)" if len(bad) > 4 else ""
        raise CrossRankMismatchError(f"{op}: row counts disagree: {shown}{more}; every rank must pass the handle "
                                     f"of the same dispatch")

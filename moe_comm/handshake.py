"""The metadata vector that opens every collective call, and the checks every rank runs on it.

Before any payload moves, each rank sends every other rank one small int64 vector: which call of
the Buffer this is (its number and operation), whether this rank rejected its own arguments, its
arguments (hidden size, dtypes, top-k, number of experts, ...), the rows it will send to each rank
and the rows it expects from each rank, and digests of which tokens those rows carry
(``ops.digest``). Every rank
then holds every rank's vector, so ranks out of step, one-sided rejections, argument and count
mismatches, and handles that disagree with a peer's routing are all found before any payload
moves, and every rank reaches the same verdict. ``agreement.CallAgreement`` runs the exchange.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from .errors import CrossRankMismatchError

__all__ = ["FIELDS", "OPS", "OP_CODES", "FP8_FORMATS", "UNKNOWN", "Handshake", "dtype_code", "vector", "per_rank",
           "check"]

# Scalar fields of the vector, in order; unused fields hold UNKNOWN. "call" is the Buffer's call
# number (every collective call advances it, rejected ones included); "rejected" is 1 when this
# rank rejected its own arguments (it then sends no rows); "prefix_digest" is the digest of a
# normal handle's rank prefix matrix, which is the same matrix on every rank.
FIELDS = ("op", "call", "rejected", "hidden", "x_dtype", "num_scales", "scales_dtype", "num_topk", "num_experts",
          "num_channels", "has_weights", "num_worst_tokens", "num_max_dispatch_tokens_per_rank", "fp8_format",
          "prefix_digest")
UNKNOWN = -1
OPS = {1: "dispatch", 2: "cached dispatch", 3: "combine", 4: "low_latency_dispatch", 5: "low_latency_combine",
       6: "clean_low_latency_buffer"}
#: the code a rejection carries for each public operation
OP_CODES = {"dispatch": 1, "combine": 3, "low_latency_dispatch": 4, "low_latency_combine": 5,
            "clean_low_latency_buffer": 6}
# fp8_format values (low-latency dispatch)
FP8_FORMATS = {0: "bf16", 1: "fp8", 2: "fp8 round_scale", 3: "fp8 ue8m0"}
_DTYPES = [getattr(torch, n) for n in (
    "float32", "float16", "bfloat16", "float64", "int8", "uint8", "int16", "int32", "int64", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz") if hasattr(torch, n)]
_DTYPE_FIELDS = ("x_dtype", "scales_dtype")


def dtype_code(dtype: Optional[torch.dtype]) -> int:
    """Small int naming ``dtype`` on the wire (UNKNOWN for None)."""
    return UNKNOWN if dtype is None else _DTYPES.index(dtype)


def vector(fields: Mapping[str, int], send_counts: Sequence[int], expected: Optional[Sequence[int]],
           sent_digests: Optional[Sequence[int]], expected_digests: Optional[Sequence[int]],
           num_ranks: int) -> list[int]:
    """One rank's vector: FIELDS, then rows sent to each rank, rows expected from each rank, digests
    of the rows sent, digests of the rows expected (UNKNOWN where this rank cannot know)."""
    unknown = [name for name in fields if name not in FIELDS]
    if unknown:
        raise KeyError(f"handshake: unknown fields {unknown}; known: {FIELDS}")
    none = [UNKNOWN] * num_ranks
    row = [int(fields.get(name, UNKNOWN)) for name in FIELDS]
    for part in (send_counts, expected, sent_digests, expected_digests):
        row += none if part is None else [int(v) for v in part]
    return row


@dataclass(frozen=True)
class Handshake:
    """Every rank's vector, as received by this rank (identical on all ranks). Plain lists: the
    checks on a few ranks' small vectors are cheaper in Python than as tensor ops."""

    # rows[r] = rank r's vector (see ``vector``)
    rows: list[list[int]]

    def field(self, name: str) -> list[int]:
        """Every rank's value of field ``name``."""
        f = FIELDS.index(name)
        return [row[f] for row in self.rows]

    def _part(self, index: int) -> list[list[int]]:
        start = len(FIELDS) + index * len(self.rows)
        return [row[start:start + len(self.rows)] for row in self.rows]

    @property
    def matrix(self) -> list[list[int]]:
        """``[R][R]``: matrix[i][j] = rows rank i sends to rank j."""
        return self._part(0)

    @property
    def sent(self) -> torch.Tensor:
        """``[R, R]`` int64: sent[i, j] = rows rank i sends to rank j."""
        return torch.tensor(self.matrix, dtype=torch.int64)

    def recv_counts(self, rank: int) -> list[int]:
        """Rows ``rank`` receives from each rank: ``sent[:, rank]``."""
        return [row[rank] for row in self.matrix]

    def expected(self) -> list[list[int]]:
        """``[R][R]``: rows rank i expects from rank j, or UNKNOWN."""
        return self._part(1)

    def digests(self) -> tuple[list[list[int]], list[list[int]]]:
        """(``sent[i][j]``: digest of the rows rank i sends to rank j, ``expected[i][j]``: of those
        rank i expects from rank j), UNKNOWN where not given."""
        return self._part(2), self._part(3)


def _show(field: str, value: int) -> str:
    if field in _DTYPE_FIELDS:
        return "none" if value < 0 else str(_DTYPES[value]).replace("torch.", "")
    if field == "op":
        return OPS.get(value, f"op {value}")
    if field == "fp8_format":
        return FP8_FORMATS.get(value, f"format {value}")
    return "none" if value < 0 else str(value)


def per_rank(shake: Handshake, name: str) -> str:
    """``"rank 0: v0, rank 1: v1, ..."`` for field ``name``."""
    return ", ".join(f"rank {r}: {_show(name, v)}" for r, v in enumerate(shake.field(name)))


def _listed(pairs: list[tuple[int, int]], word: Callable[[int, int], str]) -> str:
    shown = "; ".join(word(i, j) for i, j in pairs[:4])
    return shown + (f" (and {len(pairs) - 4} more)" if len(pairs) > 4 else "")


def check(shake: Handshake, op: str, compare: Sequence[str]) -> None:
    """The verdict on agreed vectors (after call numbers and rejections): operations, the
    ``compare`` fields, row counts, the handles' prefix matrices and row digests must agree, checked
    in that order. Raises the same CrossRankMismatchError on every rank."""
    hint = ("every rank must call the same operation with the same hidden size, dtypes, top-k, number of "
            "experts and config")
    if len(set(shake.field("op"))) > 1:  # no local prefix: every rank must word it the same
        raise CrossRankMismatchError(f"ranks called different operations: {per_rank(shake, 'op')}; {hint}")
    for name in compare:
        if name != "prefix_digest" and len(set(shake.field(name))) > 1:
            raise CrossRankMismatchError(f"{op}: ranks disagree on {name}: {per_rank(shake, name)}; {hint}")
    R, sent, expected = len(shake.rows), shake.matrix, shake.expected()
    bad = [(i, j) for i in range(R) for j in range(R) if 0 <= expected[i][j] != sent[j][i]]
    if bad:
        shown = _listed(bad, lambda i, j: f"rank {i} expects {expected[i][j]} rows from rank {j}, which sends "
                                          f"{sent[j][i]}")
        raise CrossRankMismatchError(f"{op}: row counts disagree: {shown}; every rank must pass the handle "
                                     f"of the same dispatch")
    prefixes = shake.field("prefix_digest")
    if "prefix_digest" in compare and len(set(prefixes)) > 1:
        odd = [r for r, v in enumerate(prefixes) if v != prefixes[0]]
        raise CrossRankMismatchError(f"{op}: the handles' rank prefix matrices (handle[0]) differ across ranks "
                                     f"(ranks {odd} differ from rank 0's); every rank must pass the unmodified "
                                     f"handle of the same dispatch")
    sent_digest, expected_digest = shake.digests()
    bad = [(i, j) for i in range(R) for j in range(R)
           if expected_digest[i][j] != UNKNOWN and sent_digest[j][i] != UNKNOWN
           and expected_digest[i][j] != sent_digest[j][i]]
    if bad:
        shown = _listed(bad, lambda i, j: f"rank {i} expects other tokens from rank {j} than rank {j} sends")
        raise CrossRankMismatchError(f"{op}: the handles disagree on which tokens travel: {shown}; every rank "
                                     f"must pass the unmodified handle of the same dispatch")

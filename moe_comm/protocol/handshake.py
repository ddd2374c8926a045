"""The metadata vector that opens every collective call, and the checks every rank runs on it.

Before any payload moves, each rank sends every other rank one small int64 vector: which call of
the Buffer this is (its number and operation), whether this rank rejected its own arguments, its
arguments (hidden size, dtypes, top-k, number of experts, ...), the rows it will send to each rank
and the rows it expects from each rank, and digests of which tokens those rows carry
(``digest.py``); ``codes.Field`` names its slots. Every rank then holds every rank's vector, so
ranks out of step, one-sided rejections, argument and count mismatches, and handles that disagree
with a peer's routing are all found before any payload moves, and every rank reaches the same
verdict. ``agreement.CallAgreement`` runs the exchange.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import torch

from ..core.errors import CrossRankMismatchError
from .codes import UNKNOWN, Field, Fp8Format, Op, WireDType

__all__ = ["Handshake", "vector", "show", "per_rank", "check"]

_FIELDS = tuple(Field)  # iterated once here, not per call (an Enum's iteration is a Python generator)
_NUM_FIELDS = len(_FIELDS)
# the fields whose values are codes, and the enum that words them
_CODES = {Field.X_DTYPE: WireDType, Field.SCALES_DTYPE: WireDType, Field.OP: Op, Field.FP8_FORMAT: Fp8Format}


def vector(fields: Mapping[Field, int], send_counts: Sequence[int], expected: Optional[Sequence[int]],
           sent_digests: Optional[Sequence[int]], expected_digests: Optional[Sequence[int]],
           num_ranks: int) -> list[int]:
    """One rank's vector: the ``Field`` slots, then rows sent to each rank, rows expected from each rank, digests
    of the rows sent, digests of the rows expected (UNKNOWN where this rank cannot know)."""
    none = [UNKNOWN] * num_ranks
    row = [int(fields.get(field, UNKNOWN)) for field in _FIELDS]
    for part in (send_counts, expected, sent_digests, expected_digests):
        row += none if part is None else [int(v) for v in part]
    return row


@dataclass(frozen=True)
class Handshake:
    """Every rank's vector, as received by this rank (identical on all ranks). Plain lists: the
    checks on a few ranks' small vectors are cheaper in Python than as tensor ops."""

    # rows[r] = rank r's vector (see ``vector``)
    rows: list[list[int]]
    #: the masked ranks the call runs without (their rows are placeholders: no rows sent or expected)
    skip: frozenset[int] = frozenset()

    def field(self, field: Field) -> list[int]:
        """Every rank's value of ``field``."""
        return [row[field] for row in self.rows]

    def _part(self, index: int) -> list[list[int]]:
        start = _NUM_FIELDS + index * len(self.rows)
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


def show(field: Field, value: int) -> str:
    """``value`` of ``field`` in words (a peer may send a code this rank does not know)."""
    codes = _CODES.get(field)
    if codes is not None and value in set(codes):
        return codes(value).label
    return "none" if value < 0 else str(value)


def per_rank(shake: Handshake, field: Field) -> str:
    """``"rank 0: v0, rank 1: v1, ..."`` for ``field``."""
    return ", ".join(f"rank {r}: {show(field, v)}" for r, v in enumerate(shake.field(field)))


def _listed(pairs: list[tuple[int, int]], word: Callable[[int, int], str]) -> str:
    shown = "; ".join(word(i, j) for i, j in pairs[:4])
    return shown + (f" (and {len(pairs) - 4} more)" if len(pairs) > 4 else "")


def check(shake: Handshake, op: str, compare: Sequence[Field]) -> None:
    """The verdict on agreed vectors (after call numbers and rejections): operations, the
    ``compare`` fields, row counts, the handles' prefix matrices and row digests must agree, checked
    in that order. Raises the same CrossRankMismatchError on every rank."""
    hint = ("every rank must call the same operation with the same hidden size, dtypes, top-k, number of "
            "experts and config")
    if len(set(shake.field(Field.OP))) > 1:  # no local prefix: every rank must word it the same
        raise CrossRankMismatchError(f"ranks called different operations: {per_rank(shake, Field.OP)}; {hint}")
    for field in compare:
        if field is not Field.PREFIX_DIGEST and len(set(shake.field(field))) > 1:
            raise CrossRankMismatchError(f"{op}: ranks disagree on {field.label}: {per_rank(shake, field)}; {hint}")
    R, sent, expected = len(shake.rows), shake.matrix, shake.expected()
    bad = [(i, j) for i in range(R) for j in range(R) if 0 <= expected[i][j] != sent[j][i]]
    if bad:
        shown = _listed(bad, lambda i, j: f"rank {i} expects {expected[i][j]} rows from rank {j}, which sends "
                                          f"{sent[j][i]}")
        raise CrossRankMismatchError(f"{op}: row counts disagree: {shown}; every rank must pass the handle "
                                     f"of the same dispatch")
    prefixes = shake.field(Field.PREFIX_DIGEST)
    if Field.PREFIX_DIGEST in compare and len(set(prefixes)) > 1:
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

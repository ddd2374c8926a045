"""Errors raised by moe-comm, and the one helper that words argument errors."""
from __future__ import annotations

from typing import Any, NoReturn, Sequence

__all__ = ["CommTimeoutError", "CrossRankMismatchError", "PeerExitedError", "bad_argument"]


class CommTimeoutError(TimeoutError):
    """A communication step missed its deadline.

    Attributes:
        op: the operation that timed out (e.g. ``"dispatch"``).
        rank: the rank that raised.
        missing_ranks: the ranks not heard from, or ``None`` when the transport cannot tell.
    """

    def __init__(self, op: str, rank: int, timeout_s: float, missing_ranks: Sequence[int] | None,
                 detail: str = "") -> None:
        self.op, self.rank, self.timeout_s = op, rank, timeout_s
        self.missing_ranks = None if missing_ranks is None else list(missing_ranks)
        who = "unknown (the transport cannot tell)" if missing_ranks is None else str(self.missing_ranks)
        message = f"{op}: rank {rank} timed out after {timeout_s:g} s; ranks not heard from: {who}"
        super().__init__(message + (f"; {detail}" if detail else ""))


class PeerExitedError(RuntimeError):
    """A rank this rank was waiting for has exited (found while waiting, before the deadline).

    Attributes:
        op: the operation that was waiting; rank: the rank that raised; peer, pid: the exited rank.
    """

    def __init__(self, op: str, rank: int, peer: int, pid: int) -> None:
        self.op, self.rank, self.peer, self.pid = op, rank, peer, pid
        super().__init__(f"{op}: rank {rank}: rank {peer} (pid {pid}) has exited while this rank waited for it")


class CrossRankMismatchError(ValueError):
    """Ranks called the same collective operation with inconsistent arguments.

    Every rank of the group raises it with the same message.
    """


def bad_argument(op: str, name: str, expected: str, got: Any, *, kind: type = ValueError) -> NoReturn:
    """Raises ``kind`` worded as ``"{op}: {name} must be {expected}, got {got}"``."""
    raise kind(f"{op}: {name} must be {expected}, got {got}")

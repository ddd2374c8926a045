"""Errors raised by moe-comm, and the one helper that words argument errors."""
from __future__ import annotations

from typing import Any, NoReturn, Sequence

__all__ = ["BackendUnavailableError", "BufferUnusableError", "CommTimeoutError", "CrossRankMismatchError", "PeerExitedError", "bad_argument"]


class CommTimeoutError(TimeoutError):
    """A communication step missed its deadline.

    Attributes:
        op: the operation that timed out (e.g. ``"dispatch"``).
        rank: the rank that raised.
        missing_ranks: the ranks not heard from, or ``None`` when the transport cannot tell.
    """

    def __init__(self, op: str, rank: int, timeout_s: float, missing_ranks: Sequence[int] | None,
                 detail: str = "") -> None:
        self.op, self.rank, self.timeout_s, self.detail = op, rank, timeout_s, detail
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


class BackendUnavailableError(RuntimeError):
    """``Buffer(backend=...)`` named a backend that cannot run here; the message says why and which can."""


class CrossRankMismatchError(ValueError):
    """Ranks called a collective operation with inconsistent arguments, or one rank rejected its own.

    Every rank of the group raises it with the same message (a rank that rejected its own arguments
    raises its own ``ValueError``/``TypeError`` instead), and the buffer stays usable: the ranks
    agreed to fail this call together, so they are still in step.
    """


class BufferUnusableError(RuntimeError):
    """A ``Buffer`` refuses a call because an earlier failure may have left its ranks out of step
    (a missed deadline, an exited peer, a failure on one rank in the middle of a call, ranks found
    on different calls). Build a new ``Buffer`` on every rank.

    Attributes:
        op: the refused operation; rank: the rank that raised; reason: the failure that broke the buffer.
    """

    def __init__(self, op: str, rank: int, reason: str) -> None:
        self.op, self.rank, self.reason = op, rank, reason
        super().__init__(f"{op}: rank {rank}: this Buffer is unusable since {reason}. Its ranks may be out of "
                         f"step, so it refuses every further call, hook and event wait: build a new Buffer on "
                         f"every rank")


def bad_argument(op: str, name: str, expected: str, got: Any, *, kind: type = ValueError) -> NoReturn:
    """Raises ``kind`` worded as ``"{op}: {name} must be {expected}, got {got}"``."""
    raise kind(f"{op}: {name} must be {expected}, got {got}")

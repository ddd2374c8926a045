"""The transport interface: moving rows of bytes between the ranks of a group, with deadlines.

A transport knows nothing of experts, top-k or FP8: it moves 2-D tensors whose rows are records,
and reports ranks that miss a deadline.
"""
from __future__ import annotations

import abc
from typing import Protocol, Sequence

import torch

__all__ = ["Pending", "Transport"]


class Pending(Protocol):
    """An exchange in flight."""

    def wait(self) -> None:
        """Blocks until the exchange has completed (on stream devices: until it is ordered before
        the current stream's next work). Raises ``CommTimeoutError`` past the deadline."""


class Transport(abc.ABC):
    """Moves records between the ranks of one group. One instance per ``Buffer``."""

    #: name used by ``Buffer(transport=...)`` and ``MOE_COMM_TRANSPORT``
    name: str
    rank: int
    num_ranks: int
    timeout_s: float
    #: where this transport's own small exchanges (metadata, barriers) travel
    device: torch.device

    @abc.abstractmethod
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int], *, op: str) -> Pending:
        """Starts an all-to-all of rows: rows ``[sum(input_splits[:j]), +input_splits[j])`` of
        ``input`` go to rank j, and rank i's rows land, in source-rank order, in ``output`` at
        ``[sum(output_splits[:i]), +output_splits[i])``. Collective: every rank must call it, in the
        same order. Any dtype; ``op`` names the caller's operation in errors."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases transport resources. Idempotent."""

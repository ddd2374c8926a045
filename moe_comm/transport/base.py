"""The transport interface: moving rows of bytes between the ranks of a group, with deadlines.

A transport knows nothing of experts, top-k or FP8: it moves 2-D tensors whose rows are records,
and reports ranks that miss a deadline.
"""
from __future__ import annotations

import abc
from typing import Callable, Protocol, Sequence, Union

import torch

from ..workspace import Workspace

__all__ = ["Exchange", "Pending", "Rows", "Transport"]

#: What a rank sends in an exchange: ``pack(dest, out)`` writes the rows for rank ``dest`` into
#: ``out`` (`[rows, record_bytes]` uint8, possibly another rank's memory), or the rows themselves as
#: one `[rows, record_bytes]` uint8 tensor ordered by destination rank.
Rows = Union[Callable[[int, torch.Tensor], None], torch.Tensor]


class Pending(Protocol):
    """An exchange in flight."""

    def wait(self) -> None:
        """Blocks until the exchange has completed (on stream devices: until it is ordered before
        the current stream's next work). Raises ``CommTimeoutError`` past the deadline."""


class Exchange(Protocol):
    """A records exchange in flight (see ``Transport.exchange``)."""

    def wait(self) -> torch.Tensor:
        """Blocks until every row has arrived; returns them as `[rows, record_bytes]` uint8, grouped
        by source rank ascending. Valid until ``release``. Raises ``CommTimeoutError`` past the deadline."""

    def release(self) -> None:
        """Hands the received rows' memory back to the transport. Idempotent."""


class Transport(abc.ABC):
    """Moves records between the ranks of one group. One instance per ``Buffer``."""

    #: name used by ``Buffer(transport=...)`` and ``MOE_COMM_TRANSPORT``
    name: str
    rank: int
    num_ranks: int
    timeout_s: float
    #: where this transport's own small exchanges (metadata, barriers) travel
    device: torch.device

    def __init__(self) -> None:
        #: send and receive buffers reused across exchanges
        self.workspace = Workspace()

    @abc.abstractmethod
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int], *, op: str) -> Pending:
        """Starts an all-to-all of rows: rows ``[sum(input_splits[:j]), +input_splits[j])`` of
        ``input`` go to rank j, and rank i's rows land, in source-rank order, in ``output`` at
        ``[sum(output_splits[:i]), +output_splits[i])``. Collective: every rank must call it, in the
        same order. Any dtype; ``op`` names the caller's operation in errors. Meant for small
        metadata; payloads go through ``exchange``."""

    def exchange(self, sent: Sequence[Sequence[int]], record_bytes: int, rows: Rows, *, op: str,
                 device: torch.device) -> Exchange:
        """Starts an all-to-all of records whose counts every rank knows: ``sent[i][j]`` rows go from
        rank i to rank j (the same matrix on every rank, e.g. from a handshake). ``rows`` supplies this
        rank's rows; a transport with direct access to peers' memory packs them straight into place.
        Collective, in the same order on every rank.

        This implementation packs into a local buffer and runs ``all_to_all``."""
        me = self.rank
        send_counts = [int(n) for n in sent[me]]
        recv_counts = [int(row[me]) for row in sent]
        send_store = None
        if callable(rows):
            send_store, packed = self.workspace.take("send", sum(send_counts), record_bytes, device)
            begin = 0
            for dest, count in enumerate(send_counts):
                if count:
                    rows(dest, packed[begin:begin + count])
                begin += count
        else:
            packed = rows
        recv_store, received = self.workspace.take("recv", sum(recv_counts), record_bytes, device)
        pending = self.all_to_all(received, packed, recv_counts, send_counts, op=op)
        return _BufferedExchange(self.workspace, pending, received, send_store, recv_store)

    @abc.abstractmethod
    def close(self) -> None:
        """Releases transport resources. Idempotent."""


class _BufferedExchange:
    """An ``exchange`` through workspace buffers and ``all_to_all``."""

    def __init__(self, workspace: Workspace, pending: Pending, received: torch.Tensor,
                 send_store: torch.Tensor | None, recv_store: torch.Tensor) -> None:
        self._workspace, self._pending, self._received = workspace, pending, received
        self._stores = [("send", send_store), ("recv", recv_store)]

    def wait(self) -> torch.Tensor:
        self._pending.wait()
        return self._received

    def release(self) -> None:
        for name, store in self._stores:
            if store is not None:
                self._workspace.give_back(name, store)
        self._stores = []

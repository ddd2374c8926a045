"""The transport interface: moving rows of bytes between the ranks of a group, with deadlines.

A transport knows nothing of experts, top-k or FP8: it moves 2-D tensors whose rows are records,
and reports ranks that miss a deadline.
"""
from __future__ import annotations

import abc
import socket
import zlib
from typing import Callable, Optional, Protocol, Sequence

import torch

from ..core.memory import Workspace
from .store_gather import StoreGather

__all__ = ["Exchange", "Pending", "Rows", "Transport", "host_id", "own_counts", "peer_blocks", "prefix_sums"]

#: What a rank sends in an exchange: ``pack(dest, first, out)`` writes the rows for rank ``dest`` into
#: ``out`` (`[rows, record_bytes]` uint8, possibly another rank's memory); they are rows
#: ``[first, first + rows)`` of the rank's send order (by destination rank, ``sent[rank]`` each).
Rows = Callable[[int, int, torch.Tensor], None]


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
    #: the group's ranks split into nodes (``topology.split_nodes``: hosts, LOCAL_WORLD_SIZE blocks)
    nodes: list[list[int]]

    #: deadline-tolerant gathers for shrinking buffers (``store_gather``), None where the transport has no
    #: rendezvous store to run them on
    gatherer: Optional[StoreGather] = None

    def __init__(self) -> None:
        #: send and receive buffers reused across exchanges
        self.workspace = Workspace()

    @abc.abstractmethod
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int], *, op: str,
                   skip: frozenset[int] = frozenset()) -> Pending:
        """Starts an all-to-all of rows: rows ``[sum(input_splits[:j]), +input_splits[j])`` of
        ``input`` go to rank j, and rank i's rows land, in source-rank order, in ``output`` at
        ``[sum(output_splits[:i]), +output_splits[i])``. Collective: every rank not in ``skip`` must
        call it, in the same order, with the same ``skip``; skipped ranks (masked, e.g. dead) neither
        send nor receive, and their blocks of ``output`` stay as they are. Any dtype; ``op`` names the
        caller's operation in errors. Meant for small metadata; payloads go through ``exchange``."""

    def bulk_all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                        input_splits: Sequence[int], *, op: str, skip: frozenset[int] = frozenset()) -> Pending:
        """``all_to_all`` for payload rows (what ``exchange`` moves). A transport may carry them on a channel
        of their own, so that a small ``all_to_all`` posted later never waits behind them; the default
        is ``all_to_all``. Ordered with the other bulk exchanges, not with ``all_to_all``."""
        return self.all_to_all(output, input, output_splits, input_splits, op=op, skip=skip)

    def all_gather_rows(self, row: torch.Tensor, *, op: str, skip: frozenset[int] = frozenset()) -> torch.Tensor:
        """Every rank's ``row`` (1-D, the same size and dtype on every rank), stacked in rank order
        (zeros for the ranks in ``skip``, which take no part): an all-gather through ``all_to_all``,
        with its deadline. Collective; blocks."""
        ranks = self.num_ranks
        got = (torch.zeros if skip else torch.empty)(ranks, row.numel(), dtype=row.dtype, device=row.device)
        self.all_to_all(got, row.reshape(1, -1).expand(ranks, -1).contiguous(), [1] * ranks, [1] * ranks,
                        op=op, skip=skip).wait()
        return got

    def barrier(self, *, op: str, skip: frozenset[int] = frozenset()) -> None:
        """Returns once every rank not in ``skip`` has called it (or raises at the deadline). Collective."""
        self.all_gather_rows(torch.ones(1, dtype=torch.uint8, device=self.device), op=op, skip=skip)

    @property
    def tolerant(self) -> bool:
        """Whether ``gather_tolerant`` works here (a shrinking Buffer needs it)."""
        return self.gatherer is not None

    def gather_tolerant(self, row: Sequence[int], send_to: Sequence[int], recv_from: Sequence[int], *,
                        op: str) -> tuple[dict[int, list[int]], list[int]]:
        """An all-gather of one small int64 row per rank that survives ranks which never come: sends
        ``row`` to ``send_to``, collects the rows of ``recv_from`` (this rank's own included if
        listed). Returns (rows by rank, late ranks: those of ``recv_from`` whose row did not come by the
        deadline, whose process exited, or that could not be sent to). A rank of ``send_to`` outside
        ``recv_from`` may miss the row (a transport need not wait to deliver it). Every
        rank that takes part calls it in the same order. Raises RuntimeError when this rank is out of
        step. This implementation runs through the rendezvous store (``store_gather``)."""
        if self.gatherer is None:
            raise RuntimeError(f"{op}: the {self.name} transport has no rendezvous store for deadline-tolerant "
                               f"gathers")
        return self.gatherer.gather(row, recv_from, op=op)

    @abc.abstractmethod
    def exited_ranks(self) -> list[int]:
        """Ranks on this host whose process has exited (a dead peer, found without waiting)."""

    def exchange(self, sent: Sequence[Sequence[int]], record_bytes: int, rows: Rows, *, op: str,
                 device: torch.device, skip_self: bool = False, skip: frozenset[int] = frozenset()) -> Exchange:
        """Starts an all-to-all of records whose counts every rank knows: ``sent[i][j]`` rows go from
        rank i to rank j (the same matrix on every rank, e.g. from a handshake). ``rows`` supplies this
        rank's rows; a transport with direct access to peers' memory packs them straight into place.
        With ``skip_self`` no rank sends to itself (the caller moves those rows itself, in one copy)
        and the received rows lack that block. Collective, in the same order on every rank not in
        ``skip`` (masked ranks: their rows and columns of ``sent`` must be 0).

        This implementation packs into a local buffer and runs ``bulk_all_to_all``."""
        me = self.rank
        send_counts, recv_counts = own_counts(sent, me, skip_self)
        firsts = prefix_sums(sent[me])
        send_store, packed = self.workspace.take("send", sum(send_counts), record_bytes, device)
        begin = 0
        for dest, count in enumerate(send_counts):
            if count:
                rows(dest, firsts[dest], packed[begin:begin + count])
            begin += count
        recv_store, received = self.workspace.take("recv", sum(recv_counts), record_bytes, device)
        pending = self.bulk_all_to_all(received, packed, recv_counts, send_counts, op=op, skip=skip)
        return _BufferedExchange(self.workspace, pending, received, send_store, recv_store)

    @abc.abstractmethod
    def close(self) -> None:
        """Releases transport resources. Idempotent."""


def host_id() -> int:
    """This host's name as a number (crc32), to tell which ranks share a host."""
    return zlib.crc32(socket.gethostname().encode())


def prefix_sums(counts: Sequence[int]) -> list[int]:
    """``[0, c0, c0 + c1, ...]``: where each block of rows starts when blocks of ``counts`` rows
    follow one another (one more entry than ``counts``: the total)."""
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + int(count))
    return starts


def peer_blocks(output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                input_splits: Sequence[int], me: int, skip: frozenset[int]) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """An all-to-all as point-to-point pieces: ``(peer, rows to send it, rows to receive from it)``
    for every peer not in ``skip``, ascending; rank ``me``'s own block is copied here and left out.
    Blocks of skipped ranks stay as they are."""
    out_at, in_at = prefix_sums(output_splits), prefix_sums(input_splits)
    blocks = []
    for peer in range(len(input_splits)):
        if peer in skip:
            continue
        send, recv = input[in_at[peer]:in_at[peer + 1]], output[out_at[peer]:out_at[peer + 1]]
        if peer == me:
            recv.copy_(send)
        else:
            blocks.append((peer, send, recv))
    return blocks


def own_counts(sent: Sequence[Sequence[int]], me: int, skip_self: bool) -> tuple[list[int], list[int]]:
    """(rows rank ``me`` sends to each rank, rows it receives from each rank) in an exchange."""
    send_counts = [int(n) for n in sent[me]]
    recv_counts = [int(row[me]) for row in sent]
    if skip_self:
        send_counts[me] = recv_counts[me] = 0
    return send_counts, recv_counts


class _BufferedExchange:
    """An ``exchange`` through workspace buffers and ``bulk_all_to_all``."""

    def __init__(self, workspace: Workspace, pending: Pending, received: torch.Tensor,
                 send_store: torch.Tensor, recv_store: torch.Tensor) -> None:
        self._workspace, self._pending, self._received = workspace, pending, received
        self._stores = [("send", send_store), ("recv", recv_store)]

    def wait(self) -> torch.Tensor:
        self._pending.wait()
        return self._received

    def release(self) -> None:
        for name, store in self._stores:
            self._workspace.give_back(name, store)
        self._stores = []

"""The transport interface: moving rows of bytes between the ranks of a group, with deadlines.

A transport knows nothing of experts, top-k or FP8: it moves 2-D tensors whose rows are records,
and reports ranks that miss a deadline.
"""
from __future__ import annotations

import abc
import queue
import socket
import threading
import zlib
from typing import Callable, Optional, Protocol, Sequence

import torch

from ..core.errors import CommTimeoutError
from ..core.memory import Workspace
from ..core.native import cpu_threads, native
from .store_gather import StoreGather

__all__ = ["Exchange", "Gathered", "Pending", "Posted", "Rows", "Transport", "host_id", "own_counts", "peer_blocks", "prefix_sums"]

#: What a rank sends in an exchange: ``pack(dest, first, out)`` writes the rows for rank ``dest`` into
#: ``out`` (`[rows, record_bytes]` uint8, possibly another rank's memory); they are rows
#: ``[first, first + rows)`` of the rank's send order (by destination rank, ``sent[rank]`` each).
Rows = Callable[[int, int, torch.Tensor], None]


class Gathered:
    """``Rows`` that a transport may write natively, without calling back into Python: record i of the
    send order holds rows ``src_rows[i]`` of ``segments`` (``moe_comm._C.pack_rows``' tuples, pointing into
    the tensors of ``keep``, which live as long as this), then, when given, the int32 ``words[i]`` at byte
    ``word_offset``. CPU only."""

    def __init__(self, segments: list[tuple[int, ...]], keep: Sequence[Optional[torch.Tensor]],
                 src_rows: torch.Tensor, record_bytes: int, words: Optional[torch.Tensor] = None,
                 word_offset: int = 0) -> None:
        self.segments, self.keep, self.record_bytes = segments, tuple(keep), record_bytes
        self.src_rows = src_rows.to(torch.int64).contiguous()
        self.words = None if words is None else words.to(torch.int32).contiguous()
        self.word_offset = word_offset

    def __call__(self, dest: int, first: int, out: torch.Tensor) -> None:
        count = out.shape[0]
        if first < 0 or first + count > self.src_rows.shape[0] or out.shape[1] != self.record_bytes:
            raise ValueError(f"Gathered: rows [{first}, {first + count}) of {self.src_rows.shape[0]}, "
                             f"{out.shape[1]}-byte records of {self.record_bytes}")
        if not count:
            return
        native().pack_rows(out.data_ptr(), self.segments, self.src_rows[first:].data_ptr(), count, self.record_bytes,
                           cpu_threads())
        if self.words is not None:
            out[:, self.word_offset:self.word_offset + 4].copy_(
                self.words[first:first + count].view(torch.uint8).view(count, 4))


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


class Posted(Protocol):
    """A low-latency call's header and rows on their way (``Transport.post``): the receive half."""

    def headers(self) -> torch.Tensor:
        """Every rank's header, `[R, header_bytes]` uint8 in rank order; blocks until all have
        arrived. Raises ``CommTimeoutError`` past the deadline, ``PeerExitedError`` when a rank waited
        for has exited, RuntimeError when a rank has already published a later call here (out of step)."""

    def rows(self) -> tuple[torch.Tensor, list[int]]:
        """``(records, firsts)``: the rows sent to this rank, source s's at ``records[firsts[s]:]`` (as many
        as its header says). Call after ``headers``. Valid until ``release``."""

    def last_call_header(self, rank: int) -> Optional[torch.Tensor]:
        """The latest header this rank holds from ``rank`` (of this call or an earlier one), for
        error messages: empty when none came yet, None where the transport keeps none."""

    def release(self) -> None:
        """Done with this call (its rows may be dropped unread); frees what it holds. Idempotent."""


class Transport(abc.ABC):
    """Moves records between the ranks of one group. One instance per ``Buffer``."""

    #: name used by ``Buffer(transport=...)`` and ``MOE_COMM_TRANSPORT``
    name: str
    rank: int
    num_ranks: int
    timeout_s: float
    #: where this transport's own small exchanges (metadata, barriers) travel
    device: torch.device
    #: the group's ranks split into nodes (``topology.split_nodes``: hosts, emulated nodes)
    nodes: list[list[int]]

    #: bytes of one rank's rows to another that ``all_to_all`` carries at most (None: no limit)
    metadata_room: Optional[int] = None

    #: deadline-tolerant gathers for shrinking buffers (``store_gather``), None where the transport has no
    #: rendezvous store to run them on
    gatherer: Optional[StoreGather] = None

    #: ranks no process holds (an elastic Buffer's epoch, ``store_group``): every exchange skips them
    absent: frozenset[int] = frozenset()

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
        ranks, skip = self.num_ranks, skip | self.absent
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

    def prepared_plan(self, header_bytes: int, record_bytes: int) -> Optional[tuple]:
        """Where a prepared low-latency call posts natively (``ShmTransport.prepared_plan``), or None: this
        transport's posts take the calls of ``post``."""
        return None

    def post_room(self, header_bytes: int, record_bytes: int) -> Optional[int]:
        """The most rows ``post`` can carry to one rank with these sizes (None: no limit). Local."""
        return None

    #: whether ``post`` moves rows on a thread of the transport (its exchanges may be posted from two
    #: threads at once: metadata from the caller's, payloads from that one)
    posts_in_background = False

    def post(self, header: torch.Tensor, counts: Sequence[int], record_bytes: int, rows: Rows, *, op: str,
             device: torch.device, background: bool = False) -> Posted:
        """Sends a low-latency call: ``header`` (`[header_bytes]` uint8, the same size on every rank) to
        every rank, and ``counts[j]`` rows (``rows(dest, first, out)``, as in ``exchange``) to each rank j,
        without waiting for any peer to arrive. Collective in order: every rank posts its calls in the
        same order, with headers of one size, and ``counts`` within ``post_room``. Reads ``rows``'s
        inputs before it returns.

        This implementation packs the rows into private memory and posts the headers, led by the
        record size and counts, as an ``all_to_all``; once they arrive, the rows follow as a
        ``bulk_all_to_all`` (none when ranks disagree on the record size: their verdict fails anyway).
        With ``background`` (the caller returns before it receives: a hook) and ``posts_in_background``
        a thread of the transport does that, in post order, unless the caller asks for the headers or
        rows first (then its own thread does); otherwise ``Posted.rows`` does (a caller that receives at
        once pays no hand-off between threads). Either way the caller must ask for the posts it holds in post order, and settle them
        before any other collective."""
        firsts = prefix_sums(counts)
        packed = torch.empty(firsts[-1], record_bytes, dtype=torch.uint8, device=device)
        for dest, count in enumerate(counts):
            if count:
                rows(dest, firsts[dest], packed[firsts[dest]:firsts[dest + 1]])
        posted = _DeferredPost(self, header, counts, record_bytes, packed, op, device)
        if background and self.posts_in_background:
            if self._poster is None:
                self._poster = _Poster(f"moe-comm {self.name} rank {self.rank}")
            self._poster.submit(posted.move_in_order)
        return posted

    _poster: Optional["_Poster"] = None

    def posted_exchange(self, sent: Sequence[Sequence[int]], record_bytes: int, packed: torch.Tensor, *, op: str,
                        device: torch.device) -> Exchange:
        """The exchange that moves the rows of a ``post``, once its headers told every rank's counts
        (``sent[i][j]``: rows rank i sends rank j); ``packed``: this rank's rows in its send order. Received
        rows come grouped by source rank ascending. This implementation: ``posted_all_to_all`` into a fresh
        tensor."""
        me = self.rank
        recv_counts = [int(row[me]) for row in sent]
        received = torch.empty(sum(recv_counts), record_bytes, dtype=torch.uint8, device=device)
        if any(any(row) for row in sent):  # a handshake moves none
            self.posted_all_to_all(received, packed, recv_counts, [int(n) for n in sent[me]], op=op).wait()
        return _Moved(received)

    def posted_all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                          input_splits: Sequence[int], *, op: str) -> Pending:
        """The all-to-all that moves the rows of ``post``: ``bulk_all_to_all`` here; a transport whose
        payload channel other buffers share gives posts a channel of their own."""
        return self.bulk_all_to_all(output, input, output_splits, input_splits, op=op)

    def _close_poster(self, timeout_s: Optional[float] = None) -> None:
        """Stops the posts' thread after the posts it holds; with ``timeout_s``, waits that long for them
        (a post meets its peers' posts, so one left running could post after the transport closed)."""
        if self._poster is not None:
            self._poster.stop(timeout_s)
            self._poster = None

    @abc.abstractmethod
    def close(self) -> None:
        """Releases transport resources. Idempotent."""


def host_id() -> int:
    """This host's name as a number (crc32), to tell which ranks share a host; never 0 (an absent rank's)."""
    return zlib.crc32(socket.gethostname().encode()) or 1


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


class _Poster:
    """One daemon thread that runs a transport's posts in order."""

    def __init__(self, name: str) -> None:
        self._jobs: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def stop(self, timeout_s: Optional[float] = None) -> None:
        """Ends the thread after the jobs already submitted; with ``timeout_s``, waits up to that long."""
        self._jobs.put(None)
        if timeout_s is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


class _Moved:
    """An ``Exchange`` whose rows have arrived already (in memory of their own)."""

    def __init__(self, received: torch.Tensor) -> None:
        self._received: Optional[torch.Tensor] = received

    def wait(self) -> torch.Tensor:
        assert self._received is not None, "rows asked for after release"
        return self._received

    def release(self) -> None:
        self._received = None


class _DeferredPost:
    """``Transport.post`` over ``all_to_all`` and ``bulk_all_to_all`` (see there)."""

    def __init__(self, transport: Transport, header: torch.Tensor, counts: Sequence[int], record_bytes: int,
                 packed: torch.Tensor, op: str, device: torch.device) -> None:
        R = transport.num_ranks
        self._t, self._packed, self._counts, self._op, self._device = transport, packed, list(counts), op, device
        self._lead = 8 * (R + 1)  # record size and counts, before the caller's header
        lead = torch.tensor([record_bytes] + [int(c) for c in counts], dtype=torch.int64).view(torch.uint8)
        wire = torch.cat([lead, header.reshape(-1).cpu()]).to(device)
        mine = wire.reshape(1, -1).expand(R, -1).contiguous()
        self._got = torch.empty_like(mine)
        self._pending = transport.all_to_all(self._got, mine, [1] * R, [1] * R, op=op)
        self._record_bytes = record_bytes
        self._arrived, self._moved = threading.Event(), threading.Event()
        self._error: Optional[BaseException] = None
        self._header_error: Optional[BaseException] = None
        self._exchange: Optional[Exchange] = None
        self._firsts: list[int] = []
        self._started = False
        self._claim = threading.Lock()

    def move(self) -> None:
        """Waits for the headers, then moves the rows: on the transport's thread, or on the caller's when
        it asks first (a blocking call asks at once: no hand-off between threads). Runs once."""
        with self._claim:
            if self._started:
                return
            self._started = True
        try:
            try:
                self._pending.wait()
            except BaseException as exc:
                self._header_error = exc
                raise
            finally:
                self._arrived.set()
            lead = self._got[:, :self._lead].cpu().contiguous().view(torch.int64)
            sizes, sent = lead[:, 0].tolist(), lead[:, 1:].tolist()
            if len(set(sizes)) == 1:  # else no rows move, on every rank (their verdict fails anyway)
                me = self._t.rank
                self._exchange = self._t.posted_exchange(sent, self._record_bytes, self._packed, op=self._op,
                                                         device=self._device)
                self._firsts = prefix_sums([int(row[me]) for row in sent])[:-1]
        except BaseException as exc:  # raised to the caller by headers() / rows()
            self._error = exc
        finally:
            self._arrived.set()
            self._moved.set()

    def move_in_order(self) -> None:
        """``move`` on the transport's thread: when the caller took this post over, its next post waits
        until the rows of this one have moved (posts of one channel never overlap)."""
        self.move()
        self._moved.wait()

    def _wait(self, event: threading.Event) -> None:
        # NOTES: callers ask for posts in post order (the receive settles earlier calls first), so a post
        # taken over here never overtakes one still on the transport's thread
        self.move()
        # the thread's own waits have the deadline; this bound only guards against a lost thread
        if not event.wait(3 * self._t.timeout_s + 10):
            raise CommTimeoutError(self._op, self._t.rank, self._t.timeout_s, None,
                                   "the transport's posting thread did not finish this call")

    def headers(self) -> torch.Tensor:
        self._wait(self._arrived)
        if self._header_error is not None:
            raise self._header_error
        return self._got[:, self._lead:]

    def rows(self) -> tuple[torch.Tensor, list[int]]:
        self._wait(self._moved)
        if self._error is not None:
            raise self._error
        if self._exchange is None:
            raise RuntimeError(f"{self._op}: rank {self._t.rank}: ranks posted rows of different sizes")
        return self._exchange.wait(), self._firsts

    def last_call_header(self, rank: int) -> Optional[torch.Tensor]:
        return None

    def release(self) -> None:
        # the rows move whatever the verdict: every rank's exchanges must stay in the same order
        self._wait(self._moved)
        if self._exchange is not None:
            self._exchange.release()
            self._exchange = None
        self._packed = self._packed[:0]

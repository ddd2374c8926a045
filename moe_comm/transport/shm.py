"""The ``shm`` transport: ranks on one host exchange rows through POSIX shared memory, one copy each way.

Every rank maps its own segment and its host peers' (``shm_segment``). A sender writes its rows
straight into the receiver's data slot, at its block's offset (known from the exchange's count
matrix), then publishes with a release store of the exchange's sequence number into the receiver's
``arrived`` flag. The receiver waits with acquire loads, reads the rows in place and stores its
``consumed`` flag, which a sender checks before it writes that slot again. Every wait has the
buffer's deadline and checks, every 20 ms, that the ranks it waits for still run.

Two slots per channel give DeepEP's double buffering. Before a rank reuses a slot of its own that
still holds an unreleased exchange, it moves those rows to private memory ("spill"), so a third
exchange in flight never waits on a caller's hook.

Ranks on other hosts (or other emulated nodes, ``MOE_COMM_RANKS_PER_NODE``) go through the collective transport, like
DeepEP's NVLink + RDMA split; their rows are copied into the data slot on arrival, so a receiver
sees one block per source rank either way.
"""
from __future__ import annotations

import math

import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from ..core.errors import CommTimeoutError, PeerExitedError
from ..core.native import cpu_threads, native
from .base import Exchange, Gathered, Pending, Posted, Rows, Transport, own_counts, prefix_sums
from .collective import CollectiveTransport
from .shm_segment import DATA, META, NUM_SLOTS, Segment, SegmentLayout, meta_cell_bytes, segment_name, sweep_stale

__all__ = ["ShmTransport"]

_MIN_CAPACITY = 1 << 20
_NAME_BYTES = 64
# After a peer is found exited, or a failure while mapping, how long to wait for a dying peer to let
# go of its segment (its last threads may still be exiting) before sweeping without it.
_DYING_PEER_S = 2.0


class _Waiter:
    """Deadline-bounded waits on flags set by ranks of this transport, with clear errors."""

    def __init__(self, transport: "ShmTransport") -> None:
        self._t = transport

    def until(self, flags: list[int], targets: list[int], ranks: list[int], op: str, exact: bool = False,
              timeout_s: Optional[float] = None) -> None:
        """Waits until each flag (an address) reaches its target (exactly, with ``exact``: an
        ``arrived`` flag past the exchange waited for means the sender is out of step, and the rows
        in the slot are not this exchange's); ranks[i] sets flags[i]. ``timeout_s``: how long (default:
        the transport's deadline; the error names that deadline either way)."""
        if not flags:
            return
        t = self._t
        index, outcome = native().flags_wait(flags, targets, [t.pids[r] for r in ranks],
                                             t.timeout_s if timeout_s is None else timeout_s, exact)
        if outcome != native().WaitOutcome.REACHED:
            self.raise_for(outcome, flags, targets, ranks, index, op)

    def raise_for(self, outcome: object, flags: list[int], targets: list[int], ranks: list[int], index: int,
                  op: str) -> None:
        """The error of a wait of ``until`` that ended with ``outcome`` (not REACHED) at flag ``index``."""
        t = self._t
        pids = [t.pids[r] for r in ranks]
        outcomes = native().WaitOutcome
        if outcome == outcomes.PEER_EXITED:
            sweep_stale(exited=[pids[index]], wait_s=_DYING_PEER_S)  # what it held until it died
            raise PeerExitedError(op, t.rank, ranks[index], pids[index])
        if outcome == outcomes.PAST_TARGET:
            raise RuntimeError(f"{op}: rank {t.rank}: rank {ranks[index]} is out of step (it published exchange "
                               f"{native().flag_load(flags[index])} where this rank waits for {targets[index]}); "
                               f"ranks must make the same calls in the same order, and a rank that was masked "
                               f"while alive cannot rejoin this Buffer: build a new one")
        late = sorted({r for f, goal, r in zip(flags, targets, ranks) if native().flag_load(f) < goal})
        dead = [r for r in late if not native().process_alive(t.pids[r])]
        if dead:
            sweep_stale(exited=[t.pids[r] for r in dead], wait_s=_DYING_PEER_S)
        raise CommTimeoutError(op, t.rank, t.timeout_s, late,
                               ", ".join(f"rank {r} (pid {t.pids[r]}) has exited" for r in dead))


    def late(self, flags: list[int], targets: list[int], ranks: list[int], op: str, timeout_s: float,
             exact: bool = False) -> list[int]:
        """``until`` that survives ranks which never come: returns the ranks whose flag did not reach
        its target within ``timeout_s`` or whose process exited (ascending), instead of raising. An
        exact flag past its target still raises: this rank is out of step."""
        t, native_ = self._t, native()
        start, late = time.monotonic(), []
        while flags:
            left = max(timeout_s - (time.monotonic() - start), 0.0)
            index, outcome = native_.flags_wait(flags, targets, [t.pids[r] for r in ranks], left, exact)
            if outcome == native_.WaitOutcome.REACHED:
                break
            if outcome == native_.WaitOutcome.PAST_TARGET:
                raise RuntimeError(f"{op}: rank {t.rank} is out of step: rank {ranks[index]} is past its exchange "
                                   f"{targets[index]}; a rank that was masked while alive cannot rejoin this "
                                   f"Buffer: build a new one")
            if outcome == native_.WaitOutcome.PEER_EXITED:
                gone = [index]
            else:  # the deadline: everything below its target is late
                gone = [i for i, (f, goal) in enumerate(zip(flags, targets)) if native_.flag_load(f) < goal]
            late += [ranks[i] for i in gone]
            keep = [i for i in range(len(flags)) if i not in gone]
            flags, targets, ranks = [flags[i] for i in keep], [targets[i] for i in keep], [ranks[i] for i in keep]
        return sorted(late)


class _MetaPending:
    """A small all-to-all: local rows in meta cells, remote rows through the collective transport."""

    def __init__(self, transport: "ShmTransport", segments: list[Segment], slot: int, seq: int, op: str,
                 output: torch.Tensor, output_splits: list[int], remote: Optional[tuple], sources: list[int]) -> None:
        self._t, self._segments, self._slot, self._seq, self._op = transport, segments, slot, seq, op
        self._output, self._splits, self._remote, self._sources = output, output_splits, remote, sources
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        t, me = self._t, self._segments[self._t.local_index]
        layout = me.layout
        t.waiter.until([me.flag(layout.arrived(META, self._slot, t.local.index(r))) for r in self._sources],
                       [self._seq] * len(self._sources), self._sources, self._op, exact=True)
        out = self._output.view(torch.uint8).view(self._output.shape[0], -1) if self._output.numel() else None
        starts = prefix_sums(self._splits)
        for src in self._sources:
            i = t.local.index(src)
            rows = self._splits[src]
            if rows:
                nbytes = rows * out.shape[1]
                out[starts[src]:starts[src] + rows].view(-1).copy_(me.view(layout.meta_cell(self._slot, i), nbytes))
        native().flag_store(me.flag(layout.consumed(META, self._slot)), self._seq)
        if self._remote is not None:
            pending, received, sources = self._remote
            pending.wait()
            _scatter_blocks(received, out, sources, self._splits)


class _ShmExchange:
    """A payload exchange whose rows land in this rank's data slot."""

    def __init__(self, transport: "ShmTransport", segment: Segment, slot: int, seq: int, op: str,
                 received: torch.Tensor, recv_counts: list[int], remote: Optional[tuple], sources: list[int]) -> None:
        self._t, self._segment, self._slot, self._seq, self._op = transport, segment, slot, seq, op
        self._received, self._recv_counts, self._remote, self._sources = received, recv_counts, remote, sources
        self._arrived = False
        self.released = False

    def wait(self) -> torch.Tensor:
        if not self._arrived:
            t, layout = self._t, self._segment.layout
            t.waiter.until([self._segment.flag(layout.arrived(DATA, self._slot, t.local.index(r)))
                            for r in self._sources], [self._seq] * len(self._sources), self._sources, self._op,
                           exact=True)
            if self._remote is not None:
                pending, received, sources = self._remote
                pending.wait()
                _scatter_blocks(received, self._received, sources, self._recv_counts)
            self._arrived = True
        return self._received

    def spill(self) -> None:
        """Moves the rows to private memory and frees the slot (the slot is about to be reused)."""
        if not self.released:
            self._received = self.wait().clone()
            self._free_slot()

    def release(self) -> None:
        if not self.released:
            self._free_slot()
        self._received = None

    def _free_slot(self) -> None:
        self.released = True
        native().flag_store(self._segment.flag(self._segment.layout.consumed(DATA, self._slot)), self._seq)


class _ShmPost:
    """A low-latency call in this rank's data slot: a header cell and a fixed region of rows per source
    (``ShmTransport.post``). ``waited``: its deadline was spent already (a prepared call's receive waited
    natively), so its first wait only looks again."""

    def __init__(self, transport: "ShmTransport", segment: Segment, slot: int, seq: int, op: str,
                 header_bytes: int, region_rows: int, record_bytes: int, waited: bool = False) -> None:
        self._t, self._segment, self._slot, self._seq, self._op = transport, segment, slot, seq, op
        self._header_bytes, self._region_rows, self._record_bytes = header_bytes, region_rows, record_bytes
        self._arrived_flags = transport._slot_addresses(slot)[3]  # of `segment`, this rank's mapping now
        self._waited = waited
        self._arrived = False
        self._private: Optional[torch.Tensor] = None  # the slot's bytes, once spilled
        self.released = False

    def _bytes(self, offset: int, nbytes: int) -> torch.Tensor:
        if self._private is not None:
            return self._private[offset:offset + nbytes]
        return self._segment.view(self._segment.layout.data_slot(self._slot) + offset, nbytes)

    def headers(self) -> torch.Tensor:
        t = self._t
        if not self._arrived:
            t.waiter.until(self._arrived_flags, [self._seq] * len(t.local), list(t.local), self._op, exact=True,
                           timeout_s=0.0 if self._waited else None)
            self._arrived = True
        return self._bytes(0, len(t.local) * self._header_bytes).view(len(t.local), self._header_bytes)

    def rows(self) -> tuple[torch.Tensor, list[int]]:
        self.headers()
        R, rb = len(self._t.local), self._record_bytes
        region = self._region_rows
        records = self._bytes(_post_rows_offset(R, self._header_bytes), R * region * rb).view(R * region, rb)
        return records, [s * region for s in range(R)]

    def last_call_header(self, rank: int) -> Optional[torch.Tensor]:
        """The header cell ``rank`` last wrote here, in either slot (the one with the later exchange)."""
        segment, t = self._t._segments[self._t.local_index], self._t
        layout, i = segment.layout, t.local.index(rank)
        seqs = [native().flag_load(segment.flag(layout.arrived(DATA, slot, i))) for slot in range(NUM_SLOTS)]
        slot = max(range(NUM_SLOTS), key=lambda k: seqs[k])
        if seqs[slot] <= 0:
            return torch.empty(0, dtype=torch.uint8)
        return segment.view(layout.data_slot(slot) + i * self._header_bytes, self._header_bytes).clone()

    def spill(self) -> None:
        """Moves the slot's bytes to private memory and frees it (the slot is about to be reused)."""
        if not self.released:
            self.headers()
            R = len(self._t.local)
            nbytes = _post_rows_offset(R, self._header_bytes) + R * self._region_rows * self._record_bytes
            self._private = self._bytes(0, nbytes).clone()
            self._free()

    def release(self) -> None:
        if not self.released:
            self._free()
        self._private = None

    def _free(self) -> None:
        self.released = True
        native().flag_store(self._segment.flag(self._segment.layout.consumed(DATA, self._slot)), self._seq)


def _post_rows_offset(num_local: int, header_bytes: int) -> int:
    """Where the rows of a post start in a data slot: after one header cell per source, 4 KiB aligned."""
    return -(-num_local * header_bytes // 4096) * 4096


def _require_cpu(op: str, device: torch.device) -> None:
    if device.type != "cpu":
        raise ValueError(f"{op}: the shm transport moves CPU tensors, got tensors on {device}; create the Buffer "
                         f"with transport='collective' (or on a process group of the device's backend)")


def _scatter_blocks(received: torch.Tensor, out: torch.Tensor, sources: list[int], counts: Sequence[int]) -> None:
    """Copies the collective transport's blocks (sources in rank order, packed) to their rows of out
    (``counts[r]`` rows from each rank r, in rank order)."""
    starts, begin = prefix_sums(counts), 0
    for src in sources:
        rows = int(counts[src])
        if rows:
            out[starts[src]:starts[src] + rows].copy_(received[begin:begin + rows])
        begin += rows


class ShmTransport(Transport):
    """Shared memory between the ranks of a host; the collective transport between hosts."""

    name = "shm"

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, buffer_bytes: int = 0) -> None:
        """Maps one segment per host rank whose two data slots share ``buffer_bytes`` (at least
        1 MiB each; grown on demand). Collective over ``group``; CPU tensors only."""
        super().__init__()
        self._coll = CollectiveTransport(group, timeout_s, between_nodes_only=True)
        self.rank, self.num_ranks, self.timeout_s = self._coll.rank, self._coll.num_ranks, timeout_s
        self.device = torch.device("cpu")
        self.pids = [pid for _, pid in self._coll.peers]
        self.nodes = self._coll.nodes
        self.gatherer = self._coll.gatherer
        self.absent = self._coll.absent  # (no node of theirs: their host is unknown, see ``_meet``)
        self.local = next(node for node in self.nodes if self.rank in node)
        self.local_index = self.local.index(self.rank)
        self.remote = [r for r in range(self.num_ranks) if r not in self.local]
        self.waiter = _Waiter(self)
        self._seq = [0, 0]
        #: how many times the segments were mapped: addresses taken from an earlier mapping are stale
        self.mapping = 0
        self._held: dict[tuple[int, int], object] = {}
        self._segments: list[Segment] = []
        self._addresses: dict[int, tuple[list[int], list[int], list[int], list[int]]] = {}
        self._local_pids = [self.pids[r] for r in self.local]
        slot_bytes = buffer_bytes // NUM_SLOTS
        self._map(max(_MIN_CAPACITY, -(-slot_bytes // _MIN_CAPACITY) * _MIN_CAPACITY), [1, 1])

    # ------------------------------------------------------------------ segments
    def _map(self, capacity: int, next_seq: list[int]) -> None:
        """Creates this rank's segment, maps the host peers' and unlinks the name once all have
        mapped it. Collective. ``next_seq[channel]`` is the first exchange to use the new segments.

        Slots start free for their first use and no further: a sender of exchange q waits for
        consumed >= q - NUM_SLOTS, so consumed starts at next_seq - 1 (>= first use - NUM_SLOTS,
        and below every first use, so the second use of a slot waits for the receiver's release).

        A rank that dies in here leaves its segment's name held only until it has exited: its peers
        fail and sweep it (waiting briefly for a dying peer), or the next start-up on the host does."""
        layout = SegmentLayout(len(self.local), capacity, meta_cell_bytes(self.num_ranks))
        sweep_stale()
        mine = Segment.create(segment_name(), layout)
        try:
            for channel in (META, DATA):
                for slot in range(NUM_SLOTS):
                    native().flag_store(mine.flag(layout.consumed(channel, slot)), next_seq[channel] - 1)
            names = self._gather_names(mine.name)
            segments = [mine if r == self.rank else Segment.open(names[r], layout) for r in self.local]
            self._coll.barrier(op="shm transport: mapping segments")
        except BaseException:
            mine.unlink()
            sweep_stale(exited=[self.pids[r] for r in self.local if r != self.rank], wait_s=_DYING_PEER_S)
            raise
        mine.unlink()
        self._segments = segments
        self._addresses.clear()
        self.mapping += 1

    def _gather_names(self, name: str) -> list[str]:
        encoded = name.encode()
        row = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        row[:len(encoded)] = torch.tensor(list(encoded), dtype=torch.uint8)
        got = self._coll.all_gather_rows(row, op="shm transport: exchanging segment names")
        return [bytes(r).rstrip(b"\0").decode() for r in got.tolist()]

    @property
    def capacity(self) -> int:
        """Bytes of one data slot."""
        return self._segments[0].layout.capacity

    @property
    def metadata_room(self) -> int:
        """Bytes of one rank's rows to another in ``all_to_all``: a metadata cell."""
        return self._segments[0].layout.cell

    # ------------------------------------------------------------------ slots
    def _next(self, channel: int) -> tuple[int, int]:
        """(sequence number, slot) of the next exchange on ``channel``; settles this rank's own
        unfinished exchange in that slot first."""
        self._seq[channel] += 1
        seq = self._seq[channel]
        slot = seq % NUM_SLOTS
        held = self._held.pop((channel, slot), None)
        if held is not None:
            held.wait() if channel == META else held.spill()
        return seq, slot

    def _send(self, channel: int, slot: int, seq: int, dest: int, write: Callable[[Segment], None], op: str) -> None:
        """Waits until host rank ``dest`` has freed ``slot``, lets ``write`` fill it, publishes."""
        segment = self._segments[self.local.index(dest)]
        layout = segment.layout
        self.waiter.until([segment.flag(layout.consumed(channel, slot))], [seq - NUM_SLOTS], [dest], op)
        write(segment)
        native().flag_store(segment.flag(layout.arrived(channel, slot, self.local_index)), seq)

    def _remote_exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int],
                         op: str, skip: frozenset[int], bulk: bool) -> tuple:
        """Starts the collective all-to-all of the rows to and from other hosts (zero for this host), on
        the collective transport's payload channel when ``bulk``, else on its metadata channel."""
        remote = [r for r in self.remote if r not in skip]
        send_remote = [send_counts[r] if r in remote else 0 for r in range(self.num_ranks)]
        recv_remote = [recv_counts[r] if r in remote else 0 for r in range(self.num_ranks)]
        received = torch.empty(sum(recv_remote), *send.shape[1:], dtype=send.dtype)
        post = self._coll.bulk_all_to_all if bulk else self._coll.all_to_all
        pending = post(received, send, recv_remote, send_remote, op=op, skip=skip)
        return pending, received, remote

    def exited_ranks(self) -> list[int]:
        return self._coll.exited_ranks()

    def posted_exchange(self, sent: Sequence[Sequence[int]], record_bytes: int, packed: torch.Tensor, *, op: str,
                        device: torch.device) -> Exchange:
        """The rows of a post through ``exchange``: straight into the data slots of this host's ranks, whatever
        their size (the data slots grow, every rank seeing the same counts), the rest through the collective
        transport."""
        def rows(dest: int, first: int, out: torch.Tensor) -> None:
            out.copy_(packed[first:first + out.shape[0]])

        return self.exchange(sent, record_bytes, rows, op=op, device=device)

    def _consumed(self, rank: int, channel: int) -> int:
        """The last exchange of ``channel`` that host rank ``rank`` has consumed in its own segment: one
        at or past an exchange this rank still waits for means ``rank`` went on without it."""
        segment = self._segments[self.local.index(rank)]
        return max(native().flag_load(segment.flag(segment.layout.consumed(channel, k))) for k in range(NUM_SLOTS))

    @property
    def tolerant(self) -> bool:
        return not self.remote or self._coll.tolerant

    def gather_tolerant(self, row: Sequence[int], send_to: Sequence[int], recv_from: Sequence[int], *,
                        op: str) -> tuple[dict[int, list[int]], list[int]]:
        """Through the metadata cells when every rank is on this host (one exchange of the metadata
        channel, in its order with ``all_to_all``); else through the rendezvous store. A rank of
        ``send_to`` that is not in ``recv_from`` (a late one) gets the row only if its cell is free at
        once: nobody waits for it, and it is not reported."""
        if self.remote:
            return super().gather_tolerant(row, send_to, recv_from, op=op)
        seq, slot = self._next(META)
        data = torch.tensor([int(v) for v in row], dtype=torch.int64).view(torch.uint8)
        if data.numel() > self.metadata_room:
            raise ValueError(f"{op}: shm transport: {data.numel()} bytes of metadata exceed the "
                             f"{self.metadata_room}-byte cell")
        me, late = self.rank, []
        for dest in send_to:
            if dest == me:
                continue
            segment = self._segments[self.local.index(dest)]
            layout = segment.layout
            expected = dest in recv_from
            if self.waiter.late([segment.flag(layout.consumed(META, slot))], [seq - NUM_SLOTS], [dest], op,
                                self.timeout_s if expected else 0.0):
                if expected:
                    late.append(dest)  # it never freed the cell: it stopped, or died
                continue
            segment.view(layout.meta_cell(slot, self.local_index), data.numel()).copy_(data)
            native().flag_store(segment.flag(layout.arrived(META, slot, self.local_index)), seq)
        mine = self._segments[self.local_index]
        layout = mine.layout
        sources = [r for r in recv_from if r != me and r not in late]
        missing = self.waiter.late([mine.flag(layout.arrived(META, slot, self.local.index(r))) for r in sources],
                                   [seq] * len(sources), sources, op, self.timeout_s, exact=True)
        ahead = [r for r in missing if self._consumed(r, META) >= seq]
        if ahead:
            raise RuntimeError(f"{op}: rank {me} is out of step: ranks {ahead} went past its exchange {seq} without "
                               f"it (they masked it, or it skipped calls); a rank that was masked while alive "
                               f"cannot rejoin this Buffer: build a new one")
        late += missing
        got = {me: [int(v) for v in row]} if me in recv_from else {}
        for r in sources:
            if r not in late:
                cell = mine.view(layout.meta_cell(slot, self.local.index(r)), data.numel())
                got[r] = cell.clone().view(torch.int64).tolist()
        native().flag_store(mine.flag(layout.consumed(META, slot)), seq)
        return got, sorted(set(late))

    # ------------------------------------------------------------------ low-latency posts
    def post_room(self, header_bytes: int, record_bytes: int) -> Optional[int]:
        if self.remote:
            return None
        L = len(self.local)
        return max(self.capacity - _post_rows_offset(L, header_bytes), 0) // L // max(record_bytes, 1)

    def post(self, header: torch.Tensor, counts: Sequence[int], record_bytes: int, rows: Rows, *, op: str,
             device: torch.device, background: bool = False) -> Posted:
        """With every rank on this host: the header and rows go straight into each receiver's data slot,
        source s's at fixed places (its header cell, its region of ``post_room`` rows) that do not depend
        on any rank's arguments, so a receiver reads every header before it trusts any count. The only
        wait is for the slot to be free (the receiver consumed the post two exchanges back)."""
        if self.remote:
            return super().post(header, counts, record_bytes, rows, op=op, device=device, background=background)
        _require_cpu(op, device)
        header_bytes = header.numel()
        room = self.post_room(header_bytes, record_bytes)
        if max(counts, default=0) > room:
            raise ValueError(f"{op}: shm transport: {max(counts)} rows of {record_bytes} bytes for one rank exceed "
                             f"the {room} rows a data slot of {self.capacity} bytes holds per rank; create the "
                             f"Buffer with a larger num_rdma_bytes")
        seq, slot = self._next(DATA)
        me, firsts = self.local_index, prefix_sums(counts)
        rows_at = _post_rows_offset(len(self.local), header_bytes) + me * room * record_bytes
        header = header.reshape(-1)
        if isinstance(rows, Gathered):
            self._post_natively(slot, seq, header, counts, firsts, rows_at, rows, op)
        else:
            for dest in self.local:
                count = int(counts[dest])

                def write(segment: Segment, dest: int = dest, count: int = count) -> None:
                    base = segment.layout.data_slot(slot)
                    segment.view(base + me * header_bytes, header_bytes).copy_(header)
                    if count:
                        out = segment.view(base + rows_at, count * record_bytes)
                        rows(dest, firsts[dest], out.view(count, record_bytes))

                self._send(DATA, slot, seq, dest, write, op)
        posted = _ShmPost(self, self._segments[me], slot, seq, op, header_bytes, room, record_bytes)
        self._held[(DATA, slot)] = posted
        return posted

    def _slot_addresses(self, slot: int) -> tuple[list[int], list[int], list[int], list[int]]:
        """Of data slot ``slot``, per host rank: where it starts, its consumed flag, its arrived flag for
        this rank's rows; and this rank's arrived flags, per source (fixed until the segments are remapped)."""
        found = self._addresses.get(slot)
        if found is None:
            pairs = [(segment, segment.layout) for segment in self._segments]
            mine = self._segments[self.local_index]
            found = self._addresses[slot] = (
                [segment.base + layout.data_slot(slot) for segment, layout in pairs],
                [segment.flag(layout.consumed(DATA, slot)) for segment, layout in pairs],
                [segment.flag(layout.arrived(DATA, slot, self.local_index)) for segment, layout in pairs],
                [mine.flag(mine.layout.arrived(DATA, slot, i)) for i in range(len(self.local))])
        return found

    def _post_natively(self, slot: int, seq: int, header: torch.Tensor, counts: Sequence[int], firsts: list[int],
                       rows_at: int, rows: Gathered, op: str) -> None:
        """``post``'s writes in one native call (``moe_comm._C.post_records``): per host rank, the wait for a
        free slot, the header, the rows, the publish."""
        bases, consumed, arrived, _ = self._slot_addresses(slot)
        index, outcome = native().post_records(
            bases, consumed, arrived, self._local_pids, self.capacity, seq - NUM_SLOTS, seq, self.timeout_s,
            header.data_ptr(), header.numel(), self.local_index * header.numel(), rows_at,
            [int(counts[r]) for r in self.local], [firsts[r] for r in self.local], rows.segments,
            rows.src_rows.data_ptr(), rows.src_rows.shape[0], rows.record_bytes,
            0 if rows.words is None else rows.words.data_ptr(), rows.word_offset, cpu_threads())
        if index >= 0:
            self.post_failed(slot, seq, index, outcome, op)

    def post_failed(self, slot: int, seq: int, index: int, outcome: object, op: str) -> None:
        """Raises the error of a post of exchange ``seq`` into ``slot`` whose wait for host rank ``index``'s
        slot to be free ended with ``outcome`` (``moe_comm._C.WaitOutcome``, not REACHED)."""
        consumed = self._slot_addresses(slot)[1]
        self.waiter.raise_for(outcome, [consumed[index]], [seq - NUM_SLOTS], [self.local[index]], 0, op)

    # ------------------------------------------------------------------ prepared calls
    def prepared_plan(self, header_bytes: int, record_bytes: int) -> Optional[tuple]:
        """Where a prepared low-latency call (``moe_comm._C.ShmPostPlan``) posts calls whose headers have
        ``header_bytes`` and records ``record_bytes``, as ``post`` would: (per data slot, per host rank:
        where the slot starts, its consumed flag, its arrived flag for this rank's rows, and this rank's
        arrived flag per source; the ranks' pids; the slot's bytes; where the rows start; the rows each
        source's region holds; the mapping these addresses belong to). None when some rank is on another
        host: posts then travel through the collective transport."""
        if self.remote:
            return None
        slots = [self._slot_addresses(slot) for slot in range(NUM_SLOTS)]
        rows_at = _post_rows_offset(len(self.local), header_bytes)
        return (slots, list(self._local_pids), self.capacity, rows_at, self.post_room(header_bytes, record_bytes),
                self.mapping)

    def metadata_plan(self) -> tuple[list[tuple[list[int], ...]], int]:
        """(per metadata slot: per host rank this rank's cell there, its arrived flag for this rank and its
        consumed flag; per host rank as a source its cell here and its arrived flag here; the cells' bytes), for
        a prepared normal-mode call's count exchange (as ``all_to_all`` moves it)."""
        mine = self._segments[self.local_index]
        me, n = self.local_index, len(self.local)
        slots = []
        for slot in range(NUM_SLOTS):
            pairs = [(segment, segment.layout) for segment in self._segments]
            slots.append(([segment.base + layout.meta_cell(slot, me) for segment, layout in pairs],
                          [segment.flag(layout.arrived(META, slot, me)) for segment, layout in pairs],
                          [segment.flag(layout.consumed(META, slot)) for segment, layout in pairs],
                          [mine.base + mine.layout.meta_cell(slot, s) for s in range(n)],
                          [mine.flag(mine.layout.arrived(META, slot, s)) for s in range(n)]))
        return slots, self.metadata_room

    def next_exchanges(self, mapping: int, metadata: bool) -> Optional[tuple[int, int]]:
        """(the first of the next two data exchange numbers, the next metadata one or 0) when a prepared normal-mode
        call may take them now (a handshake's post, then a payload exchange; with ``metadata`` a count exchange
        between them): the segments are still those of ``mapping`` and the slots they would use are free here;
        else None."""
        if mapping != self.mapping:
            return None
        seq, meta = self._seq[DATA] + 1, self._seq[META] + 1
        for key in [(DATA, seq % NUM_SLOTS), (DATA, (seq + 1) % NUM_SLOTS)] + ([(META, meta % NUM_SLOTS)] if metadata
                                                                               else []):
            held = self._held.get(key)
            if held is not None and not (held.done if key[0] == META else held.released):
                return None
        return seq, meta if metadata else 0

    def exchanged(self, first: int, last: int, meta: int) -> None:
        """A prepared normal-mode call took data exchanges ``first`` to ``last`` and metadata exchange ``meta`` (0:
        none), and holds nothing in their slots."""
        for key in [(DATA, seq % NUM_SLOTS) for seq in range(first, last + 1)] + ([(META, meta % NUM_SLOTS)] if meta
                                                                                   else []):
            self._held.pop(key, None)
        self._seq[DATA] = last
        if meta:
            self._seq[META] = meta

    def wait_failed(self, channel: int, slot: int, seq: int, index: int, outcome: object, op: str) -> None:
        """Raises the error of a prepared call's wait for every host rank's ``arrived`` flag of exchange ``seq`` in
        ``slot`` of ``channel`` that ended with ``outcome`` at host rank ``index``."""
        mine = self._segments[self.local_index]
        flags = [mine.flag(mine.layout.arrived(channel, slot, i)) for i in range(len(self.local))]
        self.waiter.raise_for(outcome, flags, [seq] * len(flags), list(self.local), index, op)

    def metadata_post_failed(self, slot: int, seq: int, index: int, outcome: object, op: str) -> None:
        """Raises the error of a prepared call's wait for host rank ``index``'s metadata cell ``slot`` to be free."""
        segment = self._segments[index]
        self.waiter.raise_for(outcome, [segment.flag(segment.layout.consumed(META, slot))], [seq - NUM_SLOTS],
                              [self.local[index]], 0, op)

    def grow(self, need: int, seq: int) -> None:
        """Data slots of at least ``need`` bytes before exchange ``seq`` (collective: every rank sees the same
        counts and grows here together)."""
        self._map(max(need, 2 * self.capacity), [self._seq[META] + 1, seq])

    def next_post(self, mapping: int) -> int:
        """The exchange number a prepared call's post takes next, or 0 when it may not post now: the segments
        were mapped again since ``mapping``, or this rank still holds the exchange in the data slot it would
        use (``post`` moves it away first)."""
        if mapping != self.mapping:
            return 0
        seq = self._seq[DATA] + 1
        held = self._held.get((DATA, seq % NUM_SLOTS))
        return 0 if held is not None and not held.released else seq

    def posted(self, seq: int, held: Optional[object]) -> None:
        """A prepared call posted exchange ``seq`` (``next_post``); ``held``: what holds its data slot until
        received (with ``released`` and ``spill()``), None when it was received already."""
        self._seq[DATA] = seq
        if held is None:
            self._held.pop((DATA, seq % NUM_SLOTS), None)
        else:
            self._held[(DATA, seq % NUM_SLOTS)] = held

    def posted_call(self, slot: int, seq: int, op: str, header_bytes: int, record_bytes: int) -> Posted:
        """The post of exchange ``seq`` in ``slot`` as ``post`` returns it, for a prepared call whose receive
        could not finish natively (its deadline spent: the first wait only looks again)."""
        return _ShmPost(self, self._segments[self.local_index], slot, seq, op, header_bytes,
                        self.post_room(header_bytes, record_bytes), record_bytes, waited=True)

    # ------------------------------------------------------------------ Transport
    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int], *, op: str,
                   skip: frozenset[int] = frozenset()) -> Pending:
        _require_cpu(op, input.device)
        seq, slot = self._next(META)
        local = [r for r in self.local if r not in skip]
        output_splits, input_splits = [int(n) for n in output_splits], [int(n) for n in input_splits]
        # rows as bytes, also when this rank sends none: the rows it receives from other hosts are sized
        # by this view (an empty int64 input kept as int64 made them 1-byte rows)
        row_bytes = math.prod(input.shape[1:]) * input.element_size()
        data = input.contiguous().view(torch.uint8).view(input.shape[0], row_bytes)
        starts = prefix_sums(input_splits)
        remote = None
        if self.remote:
            keep = torch.cat([data[starts[r]:starts[r + 1]] if r not in skip else data[:0] for r in self.remote]) \
                if data.numel() else data
            remote = self._remote_exchange(keep, input_splits, output_splits, op, skip, bulk=False)
        for dest in local:
            nbytes = input_splits[dest] * row_bytes
            if nbytes > self.metadata_room:
                raise ValueError(f"{op}: shm transport: {nbytes} bytes of metadata for rank {dest} exceed the "
                                 f"{self.metadata_room}-byte cell")

            def write(segment: Segment, dest: int = dest, nbytes: int = nbytes) -> None:
                if nbytes:
                    segment.view(segment.layout.meta_cell(slot, self.local_index), nbytes).copy_(
                        data[starts[dest]:starts[dest + 1]].reshape(-1))

            self._send(META, slot, seq, dest, write, op)
        pending = _MetaPending(self, self._segments, slot, seq, op, output, output_splits, remote, local)
        self._held[(META, slot)] = pending
        return pending

    def exchange(self, sent: Sequence[Sequence[int]], record_bytes: int, rows: Rows, *, op: str,
                 device: torch.device, skip_self: bool = False, skip: frozenset[int] = frozenset()) -> Exchange:
        _require_cpu(op, device)
        seq, slot = self._next(DATA)
        local = [r for r in self.local if r not in skip]
        me = self.rank
        send_counts, recv_counts = own_counts(sent, me, skip_self)
        firsts = prefix_sums(sent[me])
        # rows_to[i][j]: what actually travels from i to j
        rows_to = [[0 if skip_self and i == j else int(n) for j, n in enumerate(row)] for i, row in enumerate(sent)]
        need = max(sum(row[j] for row in rows_to) for j in range(self.num_ranks)) * record_bytes
        if need > self.capacity:  # every rank sees the same matrix, so all grow here together
            self.grow(need, seq)
        remote = None
        if self.remote:
            # A fresh buffer: the collective transport reads it in the background.
            packed = torch.empty(sum(send_counts[r] for r in self.remote), record_bytes, dtype=torch.uint8)
            begin = 0
            for dest in self.remote:
                if send_counts[dest]:
                    rows(dest, firsts[dest], packed[begin:begin + send_counts[dest]])
                begin += send_counts[dest]
            remote = self._remote_exchange(packed, send_counts, recv_counts, op, skip, bulk=True)
        for dest in local:
            offset = sum(rows_to[i][dest] for i in range(me)) * record_bytes
            count = send_counts[dest]

            def write(segment: Segment, dest: int = dest, offset: int = offset, count: int = count) -> None:
                if not count:
                    return
                out = segment.view(segment.layout.data_slot(slot) + offset, count * record_bytes)
                rows(dest, firsts[dest], out.view(count, record_bytes))

            self._send(DATA, slot, seq, dest, write, op)
        segment = self._segments[self.local_index]
        received = segment.view(segment.layout.data_slot(slot), sum(recv_counts) * record_bytes)
        exchange = _ShmExchange(self, segment, slot, seq, op, received.view(sum(recv_counts), record_bytes),
                                recv_counts, remote, local)
        self._held[(DATA, slot)] = exchange
        return exchange

    def close(self) -> None:
        self._held.clear()
        self._segments = []
        self.workspace.clear()
        self._coll.close()
        sweep_stale()  # anything a peer that died after the last wait left

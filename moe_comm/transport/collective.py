"""The ``collective`` transport: ``torch.distributed.all_to_all_single`` with uneven splits.

Works on every backend that implements ``all_to_all_single`` (gloo on CPU, nccl, hccl, cncl, ...)
and on any device, with no copy through the host. It is the semantic reference that the other
transports are tested against.

Two channels: on gloo, the small ``all_to_all`` exchanges (handshakes, counts) run on a second gloo
group of the same ranks, because gloo runs one group's collectives strictly in order: a handshake
posted while a payload is in flight would otherwise wait for the whole payload (a 16-byte all-to-all
behind a 16 MB one took 6.8 ms instead of 0.4 ms here), and with it any overlap of the next step.
Payloads (``bulk_all_to_all``) run on the group itself.

Deadlines: every exchange is posted asynchronously and waited with the buffer's deadline. Before
posting, each rank records in the process group's store how many exchanges it has entered, so a
rank that times out can name the ranks that never arrived, and say whether a peer on this host has
exited (ranks swap host and pid when the transport is built).
"""
from __future__ import annotations

import collections
import datetime
import os
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from ..errors import CommTimeoutError, CrossRankMismatchError
from .base import Pending, Transport, host_id, peer_blocks

__all__ = ["CollectiveTransport"]

# Types gloo's all-to-all cannot carry; they travel as their bytes.
_BYTE_VIEW_DTYPES = {d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "bool",
    "uint16", "uint32", "uint64", "complex64", "complex128")) if d is not None}


def _as_wire(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as the backend will send it: dtypes it lacks as bytes (splits count rows, so a
    wider last dimension changes nothing)."""
    return tensor.view(torch.uint8) if tensor.dtype in _BYTE_VIEW_DTYPES else tensor


_KEEP_RECENT = 6  # exchanges whose tensors stay referenced: two operations' worth


class _ArrivalBook:
    """Per-rank counters in the process group's store: how many exchanges each rank has entered."""

    def __init__(self, store: Optional[dist.Store], prefix: str, rank: int, num_ranks: int) -> None:
        self._store, self._prefix, self._rank, self._num_ranks = store, prefix, rank, num_ranks
        self.entered = 0

    def enter(self) -> None:
        self.entered += 1
        if self._store is not None:
            self._store.set(f"{self._prefix}/{self._rank}", str(self.entered))

    def missing(self) -> Optional[list[int]]:
        """Ranks that have entered fewer exchanges than this one, or None without a store."""
        if self._store is None:
            return None
        late = []
        for peer in range(self._num_ranks):
            key = f"{self._prefix}/{peer}"
            seen = int(self._store.get(key)) if self._store.check([key]) else 0
            if seen < self.entered:
                late.append(peer)
        return late


class _CollectivePending:
    def __init__(self, transport: "CollectiveTransport", works: list[dist.Work], op: str) -> None:
        self._transport, self._works, self._op = transport, works, op

    def wait(self) -> None:
        works, self._works = self._works, []
        transport = self._transport
        deadline = time.monotonic() + transport.timeout_s  # one deadline for all of the exchange's works
        for work in works:
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 1e-3)))
            except RuntimeError as exc:
                transport.raise_failure(self._op, exc)


class CollectiveTransport(Transport):
    """``all_to_all_single`` over a ``torch.distributed`` process group."""

    name = "collective"

    def __init__(self, group: dist.ProcessGroup, timeout_s: float, buffer_bytes: int = 0) -> None:
        """Collective over ``group``: every rank of the group must construct it, in the same order
        as any other transport on the group (the n-th construction on each rank pairs up).
        ``buffer_bytes`` is unused: buffers are allocated per exchange."""
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.num_ranks = dist.get_world_size(group)
        self.timeout_s = timeout_s
        self._backend = str(dist.get_backend(group))
        self.device = torch.device("cuda", torch.cuda.current_device()) if self._backend == "nccl" \
            else torch.device("cpu")
        store = _default_store()
        scope = f"moe_comm/{getattr(group, 'group_name', 'default')}"
        instance = store.add(f"{scope}/instances/{self.rank}", 1) if store is not None else 0
        self._book = _ArrivalBook(store, f"{scope}/arrivals/{instance}", self.rank, self.num_ranks)
        # NOTES: gloo's worker thread drops its reference to a finished exchange shortly *after* the
        # waiter wakes up. If that is the last reference, the worker frees the work and its tensors,
        # which takes the GIL, and that aborts the process during interpreter exit. The works (and
        # tensors) of the last few exchanges stay referenced here, so the last reference is always
        # dropped by Python on the main thread, long after the worker has moved on.
        self._recent: collections.deque = collections.deque(maxlen=_KEEP_RECENT)
        self._host = host_id()
        # NOTES: a failure inside _meet reports liveness from _peers, so give it a placeholder first.
        self._peers = [(self._host, os.getpid())] * self.num_ranks
        self._metadata: Optional[dist.ProcessGroup] = None  # _meet runs on the group itself
        self._peers = self._meet(instance)
        self._metadata = self._metadata_channel(store, f"{scope}/metadata/{instance}")

    def _metadata_channel(self, store: Optional[dist.Store], prefix: str) -> Optional[dist.ProcessGroup]:
        """The second gloo group that carries ``all_to_all`` (see the module docstring); None off gloo,
        for one rank, or without the rendezvous store. Every rank builds it after ``_meet`` (so the
        instances agree), within the deadline."""
        if self._backend != "gloo" or self.num_ranks == 1 or store is None:
            return None
        try:
            return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), self.rank, self.num_ranks,
                                         datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            self.raise_failure("Buffer()", exc)

    def _meet(self, instance: int) -> list[tuple[int, int]]:
        """Exchanges (host, pid, instance) with every rank, with the deadline; checks the pairing."""
        mine = torch.tensor([self._host, os.getpid(), instance], dtype=torch.int64, device=self.device)
        rows = self.gather_rows(mine, op="Buffer()").cpu().tolist()
        instances = [r[2] for r in rows]
        if len(set(instances)) > 1:
            raise CrossRankMismatchError(
                f"Buffer(): ranks have created different numbers of buffers on this group "
                f"({', '.join(f'rank {r}: {n}' for r, n in enumerate(instances))}); create buffers collectively, "
                f"in the same order on every rank")
        return [(host, pid) for host, pid, _ in rows]

    @property
    def peers(self) -> list[tuple[int, int]]:
        """(host hash, pid) of every rank."""
        return list(self._peers)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor,
                   output_splits: Sequence[int], input_splits: Sequence[int], *, op: str,
                   skip: frozenset[int] = frozenset()) -> Pending:
        return self._post(output, input, output_splits, input_splits, op, skip, self._metadata)

    def bulk_all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                        input_splits: Sequence[int], *, op: str, skip: frozenset[int] = frozenset()) -> Pending:
        return self._post(output, input, output_splits, input_splits, op, skip, None)

    def _post(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
              input_splits: Sequence[int], op: str, skip: frozenset[int],
              channel: Optional[dist.ProcessGroup]) -> Pending:
        """Starts the all-to-all on ``channel`` (the metadata group, whose ranks are the group's) or,
        when None, on the group itself."""
        self._book.enter()
        if self.num_ranks == 1:
            if input.numel():
                output.copy_(input)
            return _CollectivePending(self, [], op)
        try:
            if skip:
                works = self._point_to_point(output, input, output_splits, input_splits, skip, channel)
            elif channel is not None:
                works = [channel.alltoall_base(_as_wire(output), _as_wire(input), [int(n) for n in output_splits],
                                               [int(n) for n in input_splits], dist.AllToAllOptions())]
            else:
                works = [dist.all_to_all_single(_as_wire(output), _as_wire(input), list(output_splits),
                                                list(input_splits), group=self.group, async_op=True)]
        except RuntimeError as exc:
            self.raise_failure(op, exc)
        self._recent.append((works, output, input))
        return _CollectivePending(self, works, op)

    def _point_to_point(self, output: torch.Tensor, input: torch.Tensor, output_splits: Sequence[int],
                        input_splits: Sequence[int], skip: frozenset[int],
                        channel: Optional[dist.ProcessGroup]) -> list[dist.Work]:
        """The all-to-all as sends and receives between the ranks not in ``skip`` (a collective
        would wait for them). Blocks of skipped ranks stay as they are."""
        works = []
        for peer, send, recv in peer_blocks(output, input, output_splits, input_splits, self.rank, skip):
            if channel is not None:  # the metadata group: its own ranks, tag 0
                if send.shape[0]:
                    works.append(channel.send([_as_wire(send)], peer, 0))
                if recv.shape[0]:
                    works.append(channel.recv([_as_wire(recv)], peer, 0))
                continue
            dst = dist.get_global_rank(self.group, peer)
            if send.shape[0]:
                works.append(dist.isend(_as_wire(send), dst, group=self.group))
            if recv.shape[0]:
                works.append(dist.irecv(_as_wire(recv), dst, group=self.group))
        return works

    def raise_failure(self, op: str, exc: RuntimeError) -> None:
        """Re-raises a backend error as CommTimeoutError (deadline) or RuntimeError naming ranks."""
        missing = self._book.missing()
        detail = self._liveness([r for r in range(self.num_ranks) if r != self.rank])
        if "timed out" in str(exc).lower() or "timeout" in str(exc).lower():
            raise CommTimeoutError(op, self.rank, self.timeout_s, missing, detail) from exc
        who = "unknown" if missing is None else str(missing)
        raise RuntimeError(f"{op}: rank {self.rank}: {self._backend} exchange failed ({exc}); "
                           f"ranks not heard from: {who}" + (f"; {detail}" if detail else "")) from exc

    def exited_ranks(self) -> list[int]:
        """Ranks on this host whose process has exited."""
        return [peer for peer, (host, pid) in enumerate(self._peers)
                if host == self._host and peer != self.rank and not _process_alive(pid)]

    def _liveness(self, ranks: list[int]) -> str:
        """Which of ``ranks`` run on this host and have exited."""
        dead = []
        for peer in ranks:
            peer_host, pid = self._peers[peer]
            if peer_host != self._host:
                continue
            if not _process_alive(pid):
                dead.append(f"rank {peer} (pid {pid}) has exited")
        return ", ".join(dead)

    def close(self) -> None:
        self._book = _ArrivalBook(None, "", self.rank, self.num_ranks)
        self._recent.clear()
        self._metadata = None
        self.workspace.clear()


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host; an exited process that is not yet reaped (zombie) counts as dead."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: fall back to signal 0
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True


def _default_store() -> Optional[dist.Store]:
    # NOTES: the default store is how torch.distributed itself rendezvoused; it is private API, so
    # losing it only costs the names of late ranks in timeout errors.
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None

"""All-gathers of small int64 rows that survive ranks which never arrive: the rendezvous store.

A shrinking Buffer (``enable_shrink=True``) must find out which ranks missed a low-latency call's
deadline without breaking the channel it talks on, and gloo cannot: a receive that times out closes
every pair of its process group. The rendezvous store (torch.distributed's TCP or file store) can:
a key that never appears is just a key that is not there. Each gather, every rank writes its row
under ``<prefix>/<seq>/<rank>`` and counts its gathers in ``<prefix>/at/<rank>``; a reader polls the
rows it needs until the deadline. A rank whose row is missing then is late, unless its counter is
past this gather: then the reader is the one out of step, which is an error, never a shrink.

(The ``shm`` transport gathers through its own metadata cells when every rank is on its host; this
serves the other transports, and groups across hosts.)

Rows of gather ``seq - 2`` are deleted by their writer when it posts ``seq``: by then every rank that
takes part has read them (it posted ``seq - 1`` only after reading ``seq - 2``), so the store holds
at most two rows per rank.
"""
from __future__ import annotations

import array
import datetime
import time
from typing import Callable, Sequence

import torch.distributed as dist

from ..core.errors import CommTimeoutError

__all__ = ["StoreGather"]

#: how often a wait looks for exited ranks
_SLICE_S = 0.5


def _encode(row: Sequence[int]) -> bytes:
    return array.array("q", [int(v) for v in row]).tobytes()


def _decode(data: bytes) -> list[int]:
    values = array.array("q")
    values.frombytes(data)
    return values.tolist()


class StoreGather:
    """Deadline-tolerant all-gathers through ``store`` under ``prefix`` (the same on every rank of
    the group, unique to one transport). Every rank that takes part calls ``gather`` in the same
    order; ranks left out by a caller's ``sources`` may call it or not."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, timeout_s: float,
                 exited: Callable[[], list[int]]) -> None:
        self._store, self._prefix, self._rank, self._timeout_s, self._exited = store, prefix, rank, timeout_s, exited
        self.seq = 0  # gathers posted by this rank

    def _key(self, seq: int, rank: int) -> str:
        return f"{self._prefix}/{seq}/{rank}"

    def gather(self, row: Sequence[int], sources: Sequence[int], *, op: str) -> tuple[dict[int, list[int]], list[int]]:
        """Posts ``row`` and collects the rows of ``sources`` (this rank's own included if listed).
        Returns (rows by rank, late ranks: sources whose row did not come within the deadline or whose
        process exited). Raises RuntimeError when a source is past this gather (this rank is out of
        step), CommTimeoutError when the store itself fails."""
        store, me = self._store, self._rank
        self.seq += 1
        seq = self.seq
        try:
            store.set(self._key(seq, me), _encode(row))
            store.add(f"{self._prefix}/at/{me}", 1)
            if seq > 2:
                store.delete_key(self._key(seq - 2, me))
            got = {me: [int(v) for v in row]} if me in sources else {}
            pending = {r: self._key(seq, r) for r in sources if r != me}
            late = self._collect(pending)
            if pending:
                got.update(zip(pending, (_decode(v) for v in store.multi_get(list(pending.values())))))
            ahead = [r for r in late if store.add(f"{self._prefix}/at/{r}", 0) > seq]
        except (RuntimeError, ValueError) as exc:  # the store is gone: nothing can be agreed
            raise CommTimeoutError(op, me, self._timeout_s, None, f"the rendezvous store failed ({exc})") from exc
        if ahead:
            raise RuntimeError(f"{op}: rank {me} is out of step: ranks {ahead} are past its exchange {seq} of the "
                               f"shrink protocol; ranks must make the same low-latency calls in the same order, "
                               f"and a rank that was masked while alive cannot rejoin this Buffer: build a new one")
        return got, late

    def _collect(self, pending: dict[int, str]) -> list[int]:
        """Waits until every key of ``pending`` exists or the deadline; removes the ranks that are late
        (no key by then, or exited) from ``pending`` and returns them, ascending. The store's own wait
        blocks on its server until the keys are set; it is cut into slices so that exited ranks are
        found within a slice (the store logs a line for each slice that ends without the keys)."""
        store = self._store
        deadline = time.monotonic() + self._timeout_s
        waiting = dict(pending)  # keys not seen yet
        late: list[int] = []
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining > 0:
                try:
                    store.wait(list(waiting.values()), datetime.timedelta(seconds=min(remaining, _SLICE_S)))
                    break
                except dist.DistStoreError:  # this slice ended first
                    pass
            waiting = {r: key for r, key in waiting.items() if not store.check([key])}
            exited = set(self._exited())
            for r in [r for r in waiting if r in exited or time.monotonic() >= deadline]:
                late.append(r)
                del waiting[r], pending[r]
        return sorted(late)

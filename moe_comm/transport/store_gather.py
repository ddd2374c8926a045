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

A writer deletes its row of gather ``seq - KEPT`` when it posts ``seq``, so the store holds at most
``KEPT`` rows per rank. Two would do for the ranks it waits for (each posted ``seq - 1`` only after
reading ``seq - 2``), but not for a rank it found late, which may still come: in a shrink round the
late rank's row can reach a third rank, whose note lets the writer go on, before the late rank itself
reads the writer's row. With only two kept, it found that row gone, raised "out of step" without
sending its note, and the third rank, waiting for that note, was masked in turn by the writer (seen
beside two busy loops). Rows are read without waiting (``compare_set`` with a value no row has), so
a row deleted between the check that it exists and its read leaves that reader out of step, never
blocked on a key that will not come back.
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

#: rows of its own a writer keeps in the store (see the module's docstring)
KEPT = 8

#: what a read of a missing row returns: one byte, and every row is a whole number of int64s
_ABSENT = b"\x00"


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
            if seq > KEPT:
                store.delete_key(self._key(seq - KEPT, me))
            got = {me: [int(v) for v in row]} if me in sources else {}
            pending = {r: self._key(seq, r) for r in sources if r != me}
            late = self._collect(pending)
            for r, key in pending.items():
                value = store.compare_set(key, _ABSENT, _ABSENT)  # a missing key is not waited for, nor set
                if value == _ABSENT:  # deleted since it was seen: its writer went on without this rank
                    late.append(r)
                else:
                    got[r] = _decode(value)
            late.sort()
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
            # whole milliseconds: a store reads a wait of 0 ms as "no deadline" (FileStore and HashStore
            # then wait forever), so less than one left is no wait at all
            if remaining >= 1e-3:
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

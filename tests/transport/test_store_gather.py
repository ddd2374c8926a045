"""The deadline-tolerant gathers of a shrinking Buffer through the rendezvous store
(moe_comm/transport/store_gather.py), on torch's own in-process store: rows arrive, a missing row
is late at the deadline, and a reader whose writer went on without it is out of step at once, never
blocked on a row that was deleted after it was seen."""
from __future__ import annotations

import datetime
import threading
import time
import types

import pytest
import torch.distributed as dist

from moe_comm.transport.collective import bounded
from moe_comm.transport.store_gather import KEPT, StoreGather

from helpers.deadlines import before

TIMEOUT_S = 2.0
#: every gather runs under ``bounded``: one that never ends fails its test instead of hanging the session
BOUND_S = TIMEOUT_S + 5.0


def _gatherers(store: dist.Store, ranks: int) -> list[StoreGather]:
    return [StoreGather(store, "test/shrink", r, TIMEOUT_S, lambda: []) for r in range(ranks)]


def test_rows_of_every_rank_arrive():
    store = dist.HashStore()
    ranks = _gatherers(store, 3)
    results: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda r=r: results.update({r: ranks[r].gather([r, 10 * r], [0, 1, 2],
                                                                                         op="test")}))
               for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(3):
        assert results[r] == ({0: [0, 0], 1: [1, 10], 2: [2, 20]}, []), (r, results[r])


def test_a_row_that_never_comes_is_late_at_the_deadline():
    reader = _gatherers(dist.HashStore(), 2)[1]
    start = time.monotonic()
    got, late = bounded(lambda: reader.gather([7], [0, 1], op="test"), BOUND_S, "the gather")
    assert (got, late) == ({1: [7]}, [0])
    assert TIMEOUT_S <= time.monotonic() - start < TIMEOUT_S + 1.0


class _DeletesAfterWait:
    """The store as a late reader sees it: right after its wait saw the writer's row, the writer
    (which found the reader late and went on) posts ``gathers`` more gathers."""

    def __init__(self, store: dist.Store, writer: StoreGather, gathers: int) -> None:
        self._store, self._writer, self._gathers = store, writer, gathers

    def wait(self, keys, timeout):
        self._store.wait(keys, timeout)
        for _ in range(self._gathers):
            self._writer.gather([0], [0], op="writer")

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_a_row_deleted_after_it_was_seen_makes_the_reader_out_of_step_not_blocked():
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))  # a blocking read of the deleted row waits this long
    writer, _ = _gatherers(store, 2)
    writer.gather([0], [0], op="writer")  # the writer's row of gather 1, then it goes on alone
    reader = StoreGather(_DeletesAfterWait(store, writer, KEPT), "test/shrink", 1, TIMEOUT_S, lambda: [])
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 is out of step: ranks \[0\] are past its exchange 1"):
        bounded(lambda: reader.gather([1], [0, 1], op="test"), BOUND_S, "the gather")
    assert time.monotonic() - start < before(TIMEOUT_S)


def test_a_late_reader_still_reads_a_row_its_writer_went_past():
    """A shrink round: the writer found rank 1 late and went on for two more gathers (rank 2's note
    let it) before rank 1 read the writer's row; rank 1 must still get it (and then learn from the
    notes that it was masked), not find it gone and leave its peers waiting for a note it never sends."""
    store = dist.HashStore()
    writer, _ = _gatherers(store, 2)
    writer.gather([5], [0], op="writer")
    reader = StoreGather(_DeletesAfterWait(store, writer, 2), "test/shrink", 1, TIMEOUT_S, lambda: [])
    assert bounded(lambda: reader.gather([1], [0, 1], op="test"), BOUND_S, "the gather") == ({0: [5], 1: [1]}, [])


@pytest.mark.parametrize("left_ms", [0.4, 0.999])
def test_the_last_slice_of_a_deadline_never_waits_without_one(monkeypatch, left_ms):
    """A store reads a wait of under 1 ms as "no deadline" (HashStore and FileStore then wait
    forever): a deadline with less than that left must end the wait, not start an endless one."""
    import moe_comm.transport.store_gather as store_gather
    real = time.monotonic
    start = real()
    looks = iter([start, start + TIMEOUT_S - left_ms / 1000])  # sets the deadline, then finds this much left
    # the module's own clock only (``bounded`` below reads the real one)
    monkeypatch.setattr(store_gather, "time", types.SimpleNamespace(monotonic=lambda: next(looks, None) or real()))
    reader = _gatherers(dist.HashStore(), 2)[1]
    try:
        assert bounded(lambda: reader.gather([7], [0, 1], op="test"), BOUND_S, "the gather") == ({1: [7]}, [0])
    finally:
        monkeypatch.undo()

"""The store protocol of a replacement's admission (``moe_comm/transport/admission.py``) on a real TCP store,
its members as threads: every member reads the same decision; an abort waits for the survivors still building
and not for members known dead; invitations and announcements belong to one incarnation. And the shrink
notes that carry who is ready to rejoin (``protocol/shrink.py``)."""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch.distributed as dist

from helpers.deadlines import well_before
from helpers.ports import free_port
from moe_comm.protocol.shrink import note, read_note
from moe_comm.transport.admission import ABORT, COMMIT, Admissions

R = 4


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, timeout=timedelta(seconds=10),
                         wait_for_workers=False)


def _decide_all(store, epoch: int, built: dict[int, float | None], survivors=(), dead=tuple, deadline_s=5.0,
                absent=frozenset()):
    """Each rank of ``built`` (rank -> seconds until its side is built, None: it fails) decides on a thread, the
    ranks of ``survivors`` waiting for each other on an abort (a joiner waits for nobody); returns
    {rank: (outcome, seconds it took)}."""
    out, start = {}, time.monotonic()

    def member(rank: int, after: float | None) -> None:
        time.sleep(after or 0.0)
        outcome = Admissions(store, "job", rank, R).decide(epoch, after is not None, start + deadline_s,
                                                           survivors if rank in survivors else (), dead, absent)
        out[rank] = (outcome, time.monotonic() - start)

    threads = [threading.Thread(target=member, args=item) for item in built.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_commit_needs_every_member():
    got = _decide_all(_store(), 1, {0: 0.0, 1: 0.1, 2: 0.2, 3: 0.3})
    assert {o for o, _ in got.values()} == {COMMIT}, got


def test_an_epoch_with_absent_ranks_commits_among_its_members():
    # rank 1 is absent (masked, no replacement yet): the others commit without it, and do not wait for it
    got = _decide_all(_store(), 3, {0: 0.0, 2: 0.1, 3: 0.2}, survivors=(0, 3), absent=frozenset({1}),
                      deadline_s=20.0)
    assert {o for o, _ in got.values()} == {COMMIT} and max(s for _, s in got.values()) < 5.0, got


def test_a_start_short_of_ranks_agrees_on_its_members():
    # ranks 0, 2 and 3 start, rank 1 does not come before the deadline: the three start; rank 1, later, is
    # told it is not a member (it joins as a replacement); fewer than min_ranks at the deadline: None
    store, out = _store(), {}

    def rank(r: int, after: float, min_ranks: int, deadline_s: float) -> None:
        time.sleep(after)
        me = Admissions(store, "job", r, R)
        me.arrive(host=1)
        out[r] = me.start_members(min_ranks, time.monotonic() + deadline_s)

    threads = [threading.Thread(target=rank, args=(r, 0.0, 3, 0.5)) for r in (0, 2, 3)]
    threads.append(threading.Thread(target=rank, args=(1, 1.0, 3, 0.5)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert out == {r: (frozenset({0, 2, 3}), [1]) for r in range(R)}, out
    few = Admissions(_store(), "job", 0, R)
    few.arrive(host=1)
    assert few.start_members(2, time.monotonic() + 0.2) == (None, [1, 2, 3])


def test_a_rank_that_comes_after_a_failed_start_fails_too():
    # ranks 0 and 2 give up at their deadline (min_ranks 3); rank 1 comes after that: with 3 ranks there it
    # must not start with two that have gone, and it learns so at once, not at its own deadline
    store = _store()
    early = [Admissions(store, "job", r, R) for r in (0, 2)]
    for me in early:
        me.arrive(host=1)
    assert [me.start_members(3, time.monotonic() + 0.2) for me in early] == [(None, [1, 3])] * 2
    late = Admissions(store, "job", 1, R)
    late.arrive(host=1)
    start = time.monotonic()
    assert late.start_members(3, start + 30.0) == (None, [1, 3])
    assert time.monotonic() - start < well_before(30.0)


def test_one_failure_aborts_everyone_and_survivors_leave_together():
    # rank 3 (a joiner) fails at once; rank 1 (a survivor) takes 1 s to finish its side: rank 0 and 2 abort
    # at once but wait for rank 1 before they go back to their calls
    got = _decide_all(_store(), 1, {0: 0.0, 1: 1.0, 2: 0.0, 3: None}, survivors=(0, 1, 2))
    assert {o for o, _ in got.values()} == {ABORT}, got
    assert got[0][1] >= 1.0 and got[2][1] >= 1.0, got
    assert got[3][1] < well_before(1.0), got  # the joiner waits for nobody (rank 1's 1 s)


def test_a_member_known_dead_aborts_without_the_deadline():
    got = _decide_all(_store(), 1, {0: 0.0, 1: 0.0, 2: 0.0}, survivors=(0, 1, 2), dead=lambda: [3],
                      deadline_s=20.0)
    assert {o for o, _ in got.values()} == {ABORT} and max(s for _, s in got.values()) < 5.0, got


def test_a_member_that_never_comes_aborts_at_the_deadline():
    got = _decide_all(_store(), 2, {0: 0.0, 1: 0.0, 2: 0.0}, survivors=(0, 1, 2), deadline_s=1.0)
    assert {o for o, _ in got.values()} == {ABORT} and min(s for _, s in got.values()) >= 1.0, got


def test_invitations_and_announcements_belong_to_one_incarnation():
    store = _store()
    joiner, survivor = Admissions(store, "job", 2, R), Admissions(store, "job", 0, R)
    first = joiner.announce(host=1)
    assert survivor.ready([1, 2]) == {2: first}
    survivor.invite({2: first}, 5, frozenset({1, 3}))  # ranks 1 and 3 have no replacement yet: absent
    assert joiner.invitation(first, time.monotonic() + 1) == (5, frozenset({1, 3}))
    second = joiner.announce(host=1)  # a new incarnation: the old invitation is not its own
    assert joiner.invitation(second, time.monotonic() + 0.3) is None
    survivor.withdraw({2: first})  # an old token withdrawn: the new announcement stays
    assert survivor.ready([2]) == {2: second}
    survivor.withdraw({2: second})
    assert survivor.ready([2]) == {}


def test_a_token_invited_to_an_aborted_epoch_is_not_ready_again():
    # a survivor done with its side of an aborted epoch before the others withdrew the joiner's token must not
    # flag it again; the joiner's next announcement is ready
    store = _store()
    joiner, survivor = Admissions(store, "job", 2, R), Admissions(store, "job", 0, R)
    first = joiner.announce(host=1)
    survivor.invite({2: first}, 4)
    assert survivor.ready([2]) == {2: first}  # invited, undecided
    assert survivor.decide(4, False, time.monotonic() + 1) == ABORT
    assert survivor.ready([2]) == {}
    second = joiner.announce(host=1)
    assert survivor.ready([2]) == {2: second}


def test_shrink_notes_carry_ready_ranks():
    row = note(7, [1], [3], [1], 5)
    assert read_note(row, 5) == (7, frozenset({1}), frozenset({3}), frozenset({1}))
    assert read_note(row[:-1], 5)[0] == -1  # not a note

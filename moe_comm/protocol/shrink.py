"""Shrink by timeout: how a shrinking Buffer's low-latency handshake masks ranks that miss its deadline,
the same ranks on every rank that carries on (DeepEP's ``enable_shrink``).

Each round has two deadline-tolerant gathers (``Transport.gather_tolerant``) among the ranks not yet
masked:

1. the handshake vectors; a rank whose vector does not come by the deadline (it stopped calling,
   or died) is *late*;
2. notes: every rank's masked set and late set. Every rank that hears every note takes the union
   ``U`` of them all.

If every note's masked set already equals ``U`` (nobody was late, all masked the same ranks), the
vectors of step 1 are the handshake, judged as usual. Otherwise every rank masks ``U`` and runs the
round again with the vectors rebuilt for ``U`` (a token's experts on masked ranks are dropped), so
the call completes among the ranks left. Each extra round masks one more rank at least.

A rank that finds itself in ``U`` (it was late on some peer's side, e.g. it stopped calling for a
while) cannot rejoin as it is: its buffer refuses further use, saying who masked it. A new process in
its place can (``Buffer(..., rejoin=True)``): in a dispatch's notes every rank also flags the masked
ranks whose replacement it found ready (``transport/admission.py``); each rank that returns from the
call decided, alike, to admit the union of those flags at its next low-latency dispatch (``Buffer``
builds the next epoch there; the masked ranks with no replacement ready stay masked in it). A rank that misses a
note of step 2 cannot know ``U`` and breaks its buffer; the others then find it on another call at
their next handshake and break theirs too. Either way nobody returns rows shaped by a mask that
differs from a peer's.
"""
from __future__ import annotations

from typing import Iterable

__all__ = ["MARK", "note", "read_note", "ranks_of"]

#: the first slot of a step-2 note (a handshake vector starts with an Op code, which is smaller)
MARK = 1 << 40


def _bitmap(ranks: Iterable[int], num_ranks: int) -> list[int]:
    flags = [0] * num_ranks
    for r in ranks:
        flags[r] = 1
    return flags


def ranks_of(flags: list[int]) -> frozenset[int]:
    """The ranks whose flag is set."""
    return frozenset(r for r, flag in enumerate(flags) if flag)


def note(call: int, masked: Iterable[int], late: Iterable[int], ready: Iterable[int], num_ranks: int) -> list[int]:
    """One rank's step-2 note: MARK, its call number, then flags of the ranks it masked before step 1,
    of those it found late in step 1, and of the masked ranks whose replacement it found ready."""
    return [MARK, call] + _bitmap(masked, num_ranks) + _bitmap(late, num_ranks) + _bitmap(ready, num_ranks)


def read_note(row: list[int], num_ranks: int) -> tuple[int, frozenset[int], frozenset[int], frozenset[int]]:
    """(call number or -1 when ``row`` is no note, masked ranks, late ranks, ranks ready to rejoin) of a
    step-2 note."""
    R = num_ranks
    if len(row) != 2 + 3 * R or row[0] != MARK:
        return -1, frozenset(), frozenset(), frozenset()
    return row[1], ranks_of(row[2:2 + R]), ranks_of(row[2 + R:2 + 2 * R]), ranks_of(row[2 + 2 * R:])

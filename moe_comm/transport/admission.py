"""Admission of replacement ranks through the rendezvous store: announce, invite, commit.

An elastic Buffer (``enable_shrink=True``) keeps serving with a dead rank masked. A process started to
replace it (``Buffer(..., rejoin=True)``) cannot reach the survivors' groups, but it reaches the
rendezvous store, which outlives ranks. Under ``prefix`` (one per elastic Buffer of the job):

- ``ready/<rank>``: the replacement's token (host, pid, a random number), set when it is ready.
- ``invite/<rank>``: ``"<token> <epoch> <absent>"``, set by the survivors once they all decided, in one
  call's handshake, to admit it (``CallAgreement``): which epoch it joins, for which incarnation, and which
  ranks no process holds in that epoch (masked ranks with no replacement yet, comma-separated, ``-``: none).
- ``start/...``: a job that starts short of ranks (``min_ranks``: reserved slots): each rank that starts sets
  ``start/arrived/<rank>``; the first to see every rank, or at least ``min_ranks`` at its deadline, sets
  ``start/members`` (``compare_set``), and those ranks build epoch 1 with the others absent. A rank that
  arrives after that fills its slot as a replacement does. The first to reach its deadline with fewer than
  ``min_ranks`` sets it to ``failed:<ranks that came>``: the start fails on every rank, one that comes later
  included (it would otherwise start with ranks that had given up).
- ``epoch/<e>/...``: the epoch's own gloo group (``StoreGroup``), then the commit: each member sets
  ``done/<rank>`` to ``ok`` once its side of the epoch is built, or to ``fail``; the first member to see
  every ``ok`` sets ``decision`` to ``commit``, the first to fail or to reach its deadline sets it to
  ``abort`` (``compare_set``: one writer wins). Every member then reads the same decision, so a member
  that built its side while another failed does not go on alone. An aborted epoch leaves the survivors
  on the epoch they had (the replacement stays masked), and withdraws the replacement's token; each
  survivor first waits (the same deadline) until every other survivor is done with its side, so that
  they go back to their calls together: one that left early would find the others late and mask them.
"""
from __future__ import annotations

import os
import secrets
import time
from typing import Callable, Iterable, Optional

import torch.distributed as dist

__all__ = ["Admissions", "COMMIT", "ABORT", "START_EPOCH"]

COMMIT, ABORT = "commit", "abort"
#: the epoch a job that starts short of ranks starts in (epoch 0 is the caller's group, which needs every rank)
START_EPOCH = 1
#: how often a wait looks at the store again
_SLICE_S = 0.005
_START_FAILED = "failed:"  # the start members word of a start that fewer than min_ranks came to, then its ranks


class Admissions:
    """The store protocol of one elastic Buffer (the same ``prefix`` on every process of the job)."""

    def __init__(self, store: dist.Store, prefix: str, rank: int, num_ranks: int) -> None:
        self.store, self.prefix, self.rank, self.num_ranks = store, prefix, rank, num_ranks

    def _key(self, *parts: object) -> str:
        return "/".join([self.prefix, *(str(p) for p in parts)])

    def epoch_scope(self, epoch: int) -> str:
        """Where epoch ``epoch`` builds its group."""
        return self._key("epoch", epoch)

    # ------------------------------------------------------------------ the replacement's side
    def announce(self, host: int) -> str:
        """Says this rank is ready to join; returns its token."""
        token = f"{host:x}:{os.getpid()}:{secrets.token_hex(8)}"
        self.store.set(self._key("invite", self.rank), "")
        self.store.set(self._key("ready", self.rank), token)
        return token

    def invitation(self, token: str, deadline: float) -> Optional[tuple[int, frozenset[int]]]:
        """(The epoch this rank was invited to, the ranks absent from it), from its token in
        ``invite/<rank>``, or None at ``deadline``."""
        key = self._key("invite", self.rank)
        while True:
            words = self.store.get(key).decode().split()
            if len(words) == 3 and words[0] == token:
                return int(words[1]), _ranks(words[2])
            if time.monotonic() >= deadline:
                return None
            time.sleep(_SLICE_S)

    # ------------------------------------------------------------------ the survivors' side
    def ready(self, ranks: Iterable[int]) -> dict[int, str]:
        """The tokens of those of ``ranks`` that announced themselves, were not withdrawn, and were not invited
        to an epoch that was aborted. Why the last: the survivors withdraw a token once their side of an
        aborted epoch is done, and one that is done first must not find it still there and flag it again (a
        replacement whose epoch aborted announces itself anew, with a new token, if it lives)."""
        got = {}
        for r in ranks:
            key = self._key("ready", r)
            if self.store.check([key]):
                token = self.store.get(key).decode()
                if token and not self._spent(r, token):
                    got[r] = token
        return got

    def _spent(self, rank: int, token: str) -> bool:
        """Whether ``token`` (``rank``'s) was invited to an epoch that was aborted."""
        key = self._key("invite", rank)
        words = self.store.get(key).decode().split() if self.store.check([key]) else []
        return len(words) == 3 and words[0] == token and self.decision(int(words[1])) == ABORT

    def invite(self, tokens: dict[int, str], epoch: int, absent: frozenset[int] = frozenset()) -> None:
        """Tells each replacement (rank -> its token) the epoch it joins and the ranks absent from it; every
        survivor writes the same."""
        for r, token in tokens.items():
            self.store.set(self._key("invite", r), f"{token} {epoch} {_text(absent)}")

    def withdraw(self, tokens: dict[int, str]) -> None:
        """Forgets the announcements of an aborted admission (unless a new incarnation replaced them)."""
        for r, token in tokens.items():
            self.store.compare_set(self._key("ready", r), token, "")

    # ------------------------------------------------------------------ a start short of ranks
    def arrive(self, host: int) -> None:
        """Says this rank has started (``start/arrived/<rank>``)."""
        self.store.set(self._key("start", "arrived", self.rank), f"{host:x}:{os.getpid()}")

    def start_members(self, min_ranks: int, deadline: float) -> tuple[Optional[frozenset[int]], list[int]]:
        """(The ranks the job starts with, or None when fewer than ``min_ranks`` had started by the deadline of
        the first rank to give up: the same on every rank, one that comes later included; the ranks that had not
        started when it was decided)."""
        key = self._key("start", "members")
        arrived = [self._key("start", "arrived", r) for r in range(self.num_ranks)]
        while True:
            here = frozenset(r for r, k in enumerate(arrived) if self.store.check([k]))
            if self.store.check([key]):
                word = self.store.get(key).decode()
            elif len(here) == self.num_ranks or (len(here) >= min_ranks and time.monotonic() >= deadline):
                word = self._settle(key, _text(here))
            elif time.monotonic() >= deadline:
                # the start fails for everyone: a rank that comes after this one gave up must not start with it
                word = self._settle(key, _START_FAILED + _text(here))
            else:
                time.sleep(_SLICE_S)
                continue
            failed = word.startswith(_START_FAILED)
            members = _ranks(word[len(_START_FAILED):] if failed else word)
            return None if failed else members, [r for r in range(self.num_ranks) if r not in members]

    # ------------------------------------------------------------------ both sides
    def decide(self, epoch: int, built: bool, deadline: float, survivors: Iterable[int] = (),
               dead: Callable[[], Iterable[int]] = tuple, absent: frozenset[int] = frozenset()) -> str:
        """The commit round of ``epoch`` (see the module docstring) among its members (every rank but
        ``absent``): COMMIT or ABORT, the same on every member; on ABORT, returns once each of ``survivors`` is
        done with its side too (or at ``deadline``). ``dead()``: members known to have died, whose side never
        comes (abort without waiting for them)."""
        decision = self._key("epoch", epoch, "decision")
        done = {r: self._key("epoch", epoch, "done", r) for r in range(self.num_ranks) if r not in absent}
        self.store.set(done[self.rank], "ok" if built else "fail")
        outcome = None if built else self._settle(decision, ABORT)
        while outcome is None:
            if self.store.check([decision]):
                outcome = self.store.get(decision).decode()
            elif self.store.check(list(done.values())) and all(self.store.get(k) == b"ok" for k in done.values()):
                outcome = self._settle(decision, COMMIT)
            elif time.monotonic() >= deadline or any(True for _ in dead()):
                outcome = self._settle(decision, ABORT)
            else:
                time.sleep(_SLICE_S)
        if outcome == ABORT:
            waiting = [r for r in survivors if r != self.rank]
            while waiting and time.monotonic() < deadline:
                gone = set(dead())
                waiting = [r for r in waiting if r not in gone and not self.store.check([done[r]])]
                if waiting:
                    time.sleep(_SLICE_S)
        return outcome

    def decision(self, epoch: int) -> Optional[str]:
        """The decision of ``epoch`` once a member set it (COMMIT or ABORT), else None."""
        key = self._key("epoch", epoch, "decision")
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _settle(self, key: str, mine: str) -> str:
        """Sets ``key`` to ``mine`` unless a member set it first; returns what it holds."""
        return self.store.compare_set(key, "", mine).decode()


def _text(ranks: frozenset[int]) -> str:
    """``ranks`` as one word of the store's values (``-``: none)."""
    return ",".join(str(r) for r in sorted(ranks)) or "-"


def _ranks(word: str) -> frozenset[int]:
    """The ranks ``_text`` wrote."""
    return frozenset() if word == "-" else frozenset(int(r) for r in word.split(","))

"""Admission of replacement ranks through the rendezvous store: announce, invite, commit.

An elastic Buffer (``enable_shrink=True``) keeps serving with a dead rank masked. A process started to
replace it (``Buffer(..., rejoin=True)``) cannot reach the survivors' groups, but it reaches the
rendezvous store, which outlives ranks. Under ``prefix`` (one per elastic Buffer of the job):

- ``ready/<rank>``: the replacement's token (host, pid, a random number), set when it is ready.
- ``invite/<rank>``: ``"<token> <epoch>"``, set by the survivors once they all decided, in one call's
  handshake, to admit it (``CallAgreement``): which epoch it joins, for which incarnation.
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

__all__ = ["Admissions", "COMMIT", "ABORT"]

COMMIT, ABORT = "commit", "abort"
#: how often a wait looks at the store again
_SLICE_S = 0.005


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

    def invitation(self, token: str, deadline: float) -> Optional[int]:
        """The epoch this rank was invited to (its token in ``invite/<rank>``), or None at ``deadline``."""
        key = self._key("invite", self.rank)
        while True:
            words = self.store.get(key).decode().split()
            if len(words) == 2 and words[0] == token:
                return int(words[1])
            if time.monotonic() >= deadline:
                return None
            time.sleep(_SLICE_S)

    # ------------------------------------------------------------------ the survivors' side
    def ready(self, ranks: Iterable[int]) -> dict[int, str]:
        """The tokens of those of ``ranks`` that announced themselves and were not withdrawn."""
        got = {}
        for r in ranks:
            key = self._key("ready", r)
            if self.store.check([key]):
                token = self.store.get(key).decode()
                if token:
                    got[r] = token
        return got

    def invite(self, tokens: dict[int, str], epoch: int) -> None:
        """Tells each replacement (rank -> its token) the epoch it joins; every survivor writes the same."""
        for r, token in tokens.items():
            self.store.set(self._key("invite", r), f"{token} {epoch}")

    def withdraw(self, tokens: dict[int, str]) -> None:
        """Forgets the announcements of an aborted admission (unless a new incarnation replaced them)."""
        for r, token in tokens.items():
            self.store.compare_set(self._key("ready", r), token, "")

    # ------------------------------------------------------------------ both sides
    def decide(self, epoch: int, built: bool, deadline: float, survivors: Iterable[int] = (),
               dead: Callable[[], Iterable[int]] = tuple) -> str:
        """The commit round of ``epoch`` (see the module docstring): COMMIT or ABORT, the same on every
        member; on ABORT, returns once each of ``survivors`` is done with its side too (or at ``deadline``).
        ``dead()``: members known to have died, whose side never comes (abort without waiting for them)."""
        decision = self._key("epoch", epoch, "decision")
        done = [self._key("epoch", epoch, "done", r) for r in range(self.num_ranks)]
        self.store.set(done[self.rank], "ok" if built else "fail")
        outcome = None if built else self._settle(decision, ABORT)
        while outcome is None:
            if self.store.check([decision]):
                outcome = self.store.get(decision).decode()
            elif self.store.check(done) and all(self.store.get(k) == b"ok" for k in done):
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

    def _settle(self, key: str, mine: str) -> str:
        """Sets ``key`` to ``mine`` unless a member set it first; returns what it holds."""
        return self.store.compare_set(key, "", mine).decode()

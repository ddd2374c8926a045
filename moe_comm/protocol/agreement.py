"""Call agreement: every rank of a Buffer agrees on which call it is in, or every rank fails it.

Every collective call of a ``Buffer`` takes the next number of the buffer's call sequence, rejected
calls included, and its handshake (``handshake.py``) carries that number, the operation and whether
this rank rejected its own arguments:

* a rank that rejects its arguments (a bad tensor, a bad handle, a double-buffering conflict, even a
  wrong number of positional arguments) still takes part in the call's handshake, carrying the
  rejection and its message: it raises its own error, every other rank raises the same
  ``CrossRankMismatchError`` naming it, and all stay in step, so the buffer stays usable;
* ranks whose handshakes carry different call numbers are out of step (a rank skipped a call, or
  failed one before this protocol could see it): every rank that sees it breaks the buffer;
* any other failure once a call has started communicating (a missed deadline, an exited peer, an
  error on one rank in the middle of a call, an interrupt), and any failure of a pending hook or
  event, breaks the buffer: its transport may be out of step with its peers'.

A broken buffer refuses every later call, hook and event wait with ``BufferUnusableError`` saying
why; it never returns stale or shifted rows. Its peers find out at their next wait on it: at once
when their wait sees this rank's process exit, else at their deadline.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ..core.errors import BufferUnusableError, CrossRankMismatchError
from ..transport import Transport
from . import call_header
from .codes import UNKNOWN, Field, Op
from .handshake import Handshake, check, show, vector
from .shrink import note, read_note

__all__ = ["CallAgreement", "Proposal", "Rejecter", "is_agreed", "mark_agreed", "no_rows"]

_MESSAGE_BYTES = 1024  # a rejection's message on the wire, truncated to fit
#: the calls whose handshake masks late ranks in a shrinking buffer (``shrink.py``)
_SHRINKING = (Op.LOW_LATENCY_DISPATCH, Op.LOW_LATENCY_COMBINE, Op.CLEAN_LOW_LATENCY_BUFFER)

#: ``propose(skip)``: a rank's handshake entries rebuilt for a larger set of masked ranks, as keyword
#: arguments of ``CallAgreement.handshake`` (send_counts, expected, sent_digests, expected_digests)
Proposal = Callable[[frozenset[int]], Mapping[str, Any]]

#: ``rejecter(op, number, message)``: delivers a rejection of call ``number`` the way the call's peers
#: expect it (a low-latency call: a header with the rejected bit, ``call_header``)
Rejecter = Callable[[str, int, str], None]


def mark_agreed(exc: BaseException) -> BaseException:
    """``exc``, marked as a verdict every rank reached alike (``is_agreed``)."""
    exc.moe_comm_agreed = True  # type: ignore[attr-defined]
    return exc


def is_agreed(exc: BaseException) -> bool:
    """Whether ``exc`` is a verdict every rank reached alike (the ranks stay in step)."""
    return bool(getattr(exc, "moe_comm_agreed", False))


@dataclass
class _Call:
    op: str
    number: int
    started: bool = False  # its handshake was posted: from here a failure may leave ranks out of step
    rejection: Optional[str] = None  # this rank's rejection message, while it takes part with it
    agreed: dict = field(default_factory=dict)  # fields its handshakes also compare (``agree_also``)


class CallAgreement:
    """The call protocol of one Buffer over its transport (see the module docstring)."""

    def __init__(self, transport: Transport, shrink: bool = False) -> None:
        self.transport, self.rank, self.num_ranks = transport, transport.rank, transport.num_ranks
        #: DeepEP's enable_shrink: low-latency handshakes mask the ranks that miss their deadline
        self.shrink = shrink
        #: masked ranks (DeepEP's mask buffer): low-latency calls neither send to nor wait for them
        self.masked: set[int] = set()
        #: ``joinable(masked)``: which masked ranks have a replacement ready (an elastic Buffer's store,
        #: ``transport/admission.py``), asked in each shrinking dispatch's handshake; None: nobody rejoins
        self.joinable: Optional[Callable[[frozenset[int]], frozenset[int]]] = None
        #: masked ranks that every rank decided, in one handshake, to admit at its next dispatch
        self.admit: frozenset[int] = frozenset()
        self.calls = 0  # collective calls begun, rejected ones included
        self.broken: Optional[str] = None  # why this buffer refuses further use
        self.destroyed = False
        self._current: Optional[_Call] = None
        #: ops whose calls agree through headers in the data path: how a rejection reaches their peers
        self.rejecters: dict[str, Rejecter] = {}
        #: run before every handshake: work of earlier calls that must move first (``Transport.post``)
        self.before_handshake: list[Callable[[], None]] = []
        #: ``announce(op, code)`` before a handshake posts its vector: where low-latency calls agree
        #: outside the transport (the CUDA kernels' header cells), a handshake tells them it runs
        self.announcers: list[Callable[[str, Op], None]] = []

    # ------------------------------------------------------------------ state
    def refuse(self, op: str) -> None:
        """Raises if the buffer was destroyed or is broken."""
        if self.destroyed:
            raise RuntimeError(f"{op}: this Buffer was destroyed")
        if self.broken is not None:
            raise BufferUnusableError(op, self.rank, self.broken)

    def breaks(self, reason: str) -> None:
        """Marks the buffer unusable; the first reason is kept."""
        if self.broken is None:
            self.broken = reason

    # ------------------------------------------------------------------ calls
    def call(self, op: str, body: Callable[[], Any], skipped: Callable[[], frozenset[int]]) -> Any:
        """Runs ``body`` as the next collective call ``op`` (see the module docstring); ``skipped()``
        gives the ranks the call leaves out (masked ranks), so that a rejection meets the same ranks
        the call would have."""
        self.refuse(op)
        self.calls += 1
        call = self._current = _Call(op, self.calls)
        try:
            return body()
        except BaseException as exc:
            self._failed(call, exc, skipped)
            raise
        finally:
            self._current = None

    def _failed(self, call: _Call, exc: BaseException, skipped: Callable[[], frozenset[int]]) -> None:
        if self.broken is not None or is_agreed(exc):
            return
        if call.started:
            self.failed_started(call.op, call.number, exc)
            return
        # Nothing of this call has moved: meet the other ranks' handshake with the rejection, so
        # that they fail this call too instead of pairing with this rank's next one.
        call.rejection = f"{type(exc).__name__}: {exc}"
        try:
            rejecter = None if self.shrink else self.rejecters.get(call.op)
            if rejecter is not None:
                rejecter(call.op, call.number, call.rejection)
                return
            self.handshake(call.op, Op.of_method(call.op), {}, [0] * self.num_ranks, [0] * self.num_ranks, (),
                           self.transport.device, skipped())
        except BaseException as failure:  # the rejection could not be delivered: ranks may wait for it
            self.breaks(f"{type(failure).__name__} while rank {self.rank} reported its rejected {call.op} "
                        f"(call {call.number}): {failure}")
            if not isinstance(failure, Exception):  # an interrupt goes on up
                raise
            if hasattr(exc, "add_note"):
                exc.add_note(f"moe-comm: the other ranks could not be told ({failure}); this Buffer is unusable")

    def failed_started(self, op: str, number: int, exc: BaseException) -> None:
        """Call ``number`` of ``op`` failed with ``exc`` once it had started communicating (a prepared call's
        too, which runs outside ``call``): breaks the buffer, unless ``exc`` is a verdict every rank reached."""
        if not is_agreed(exc):
            self.breaks(f"{type(exc).__name__} in {op} (call {number}) on rank {self.rank}: {exc}")

    def agree_also(self, fields: Mapping[Field, int]) -> None:
        """Adds ``fields`` to what every handshake of the call running now compares across ranks: a layer that
        builds one call of its own out of a Buffer's calls (``ElasticBuffer``) agrees on its own arguments in
        the same handshakes, so a mismatch fails the call on every rank before any byte moves."""
        self._current.agreed.update(fields)

    def deferred(self, op: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
        """Decorates ``finish``, the pending half of call ``op`` (a hook, an event wait): refused once
        the buffer is broken, and breaking it when it fails."""
        def wrap(finish: Callable[[], None]) -> Callable[[], None]:
            def complete() -> None:
                self.refuse(op)
                try:
                    finish()
                except BaseException as exc:
                    if is_agreed(exc):  # every rank fails this call alike and stays in step
                        raise
                    self.breaks(f"{type(exc).__name__} while completing {op} on rank {self.rank}: {exc}")
                    raise
            return complete
        return wrap

    # ------------------------------------------------------------------ headers in the data path
    @property
    def number(self) -> int:
        """The number of the call running now."""
        return self._current.number

    @property
    def vector_len(self) -> int:
        """Words of a handshake vector (``handshake.vector``) of this group: the fields, then four per rank."""
        return len(Field) + 4 * self.num_ranks

    def header(self, code: Op, fields: Mapping[Field, int], send_counts: Sequence[int],
               expected: Optional[Sequence[int]] = None, sent_digests: Optional[Sequence[int]] = None,
               expected_digests: Optional[Sequence[int]] = None, number: Optional[int] = None) -> torch.Tensor:
        """The header of the running call (``call_header``), which then counts as started: a failure
        from here on breaks the buffer. Arguments as ``handshake``'s. With ``number`` (a prepared call's
        template, ``backends/portable/prepared.py``, which writes the call number and the per-rank words
        itself): the header of call ``number``, outside any running call."""
        if number is None:
            call = self._current
            number, call.started = call.number, True
        scalars = {**fields, Field.OP: code, Field.CALL: number, Field.REJECTED: 0}
        return call_header.encode(vector(scalars, send_counts, expected, sent_digests, expected_digests,
                                         self.num_ranks), None)

    def rejection_header(self, code: Op, number: int, message: str) -> torch.Tensor:
        """The header of rejected call ``number``: no rows, the rejected bit, ``message``."""
        zeros = [0] * self.num_ranks
        row = vector({Field.OP: code, Field.CALL: number, Field.REJECTED: 1}, zeros, zeros, None, None, self.num_ranks)
        return call_header.encode(row, message)

    def judge(self, op: str, headers: torch.Tensor, compare: Sequence[Field],
              verdict: Optional[Callable[[Handshake], None]] = None) -> Handshake:
        """The verdict on every rank's header of one call (`[R, header_bytes]`), as ``handshake``
        reaches it: BufferUnusableError when ranks are on different calls (the buffer breaks);
        CrossRankMismatchError, the same on every rank and leaving the buffer usable, when a rank
        rejected its arguments or the headers disagree."""
        width = self.vector_len
        shake = Handshake(call_header.decode(headers, width))
        # the rejecting rank never receives its rejected call: whoever judges here did not reject it
        self._verdict(shake, op, compare, verdict, lambda rejected: call_header.messages(headers, width, rejected),
                      rejected_here=False)
        return shake

    def receive_counts(self, op: str, headers: torch.Tensor, compare: Sequence[Field]) -> list[int]:
        """The rows each rank sends this one in the call of ``headers`` (`[R, header_bytes]`), once they
        agree; else ``judge``'s verdict. The headers are first compared natively
        (``call_header.agree``); only when they differ (or are not on the CPU) are they judged in Python,
        which words the error."""
        sent = call_header.agree(headers, self.vector_len, len(Field), self.rank,
                                 call_header.compare_mask(compare), int(Field.REJECTED))
        if sent is not None:
            return sent
        return self.judge(op, headers, compare).recv_counts(self.rank)

    def meet(self, op: str, header: torch.Tensor, compare: Sequence[Field]) -> None:
        """Joins, with this rank's ``header`` (``call_header``) of a call that agrees outside the
        transport, the handshake a peer announced instead (its header there named another operation):
        every rank's vector over the transport, then the handshake's verdict, which raises on every rank
        alike."""
        width = self.vector_len
        rows, texts = self._post_vector(op, call_header.decode(header.reshape(1, -1), width)[0], None,
                                        self.transport.device)
        self._verdict(Handshake(rows), op, compare, None, lambda rejected: [texts[r] for r in rejected],
                      rejected_here=False)
        raise AssertionError(f"{op}: a peer announced a handshake, but every rank's vector agrees")

    def _same_call(self, shake: Handshake, op: str) -> None:
        if len(set(shake.field(Field.CALL))) > 1:
            ops = shake.field(Field.OP)
            calls = ", ".join(f"rank {r}: call {n} ({show(Field.OP, ops[r])})"
                              for r, n in enumerate(shake.field(Field.CALL)))
            self.breaks(f"its ranks were found on different calls ({calls}): a rank skipped a call, or failed "
                        f"one alone")
            raise BufferUnusableError(op, self.rank, self.broken)

    # ------------------------------------------------------------------ the handshake
    def handshake(self, op: str, code: Op, fields: Mapping[Field, int], send_counts: Sequence[int],
                  expected: Optional[Sequence[int]], compare: Sequence[Field], device: torch.device,
                  skip: frozenset[int] = frozenset(), sent_digests: Optional[Sequence[int]] = None,
                  expected_digests: Optional[Sequence[int]] = None,
                  verdict: Optional[Callable[[Handshake], None]] = None,
                  propose: Optional[Proposal] = None) -> Handshake:
        """Exchanges this rank's vector with every rank and judges them. Collective; blocks the host.

        Args:
            code: the operation's code.
            fields: values of ``codes.Field`` slots (the call's number and rejection are added).
            send_counts: rows this rank will send to each rank.
            expected: rows this rank expects from each rank, or None when unknown before the exchange.
            compare: fields that must be equal on every rank.
            device: where the vectors travel (the transport's device: NCCL moves CUDA tensors only, shm CPU ones).
            skip: masked ranks, left out; their vectors read as this rank's fields with no rows sent
                or expected (this rank must send them nothing).
            sent_digests, expected_digests: ``digest.digests`` of the token keys of the rows sent
                to / expected from each rank, where this rank knows them.
            verdict: a further check on the vectors, raising CrossRankMismatchError (on every rank alike).
            propose: in a shrinking buffer's low-latency calls, rebuilds this rank's entries when more
                ranks get masked during the call (default: the same entries).
        Returns the judged vectors; ``skip`` of the result is the masked ranks the call ran without
        (larger than ``skip`` when a shrinking buffer masked late ranks, see ``shrink.py``).
        Raises:
            BufferUnusableError when ranks are on different calls; CrossRankMismatchError, the same on
            every rank, when a rank rejected its arguments or ops, fields, counts or digests disagree;
            CommTimeoutError / PeerExitedError from the transport.
        """
        for settle in self.before_handshake:
            settle()
        self.refuse(op)  # settling an earlier call may have broken the buffer
        call = self._current
        R = self.num_ranks
        scalars = {**fields, **call.agreed, Field.OP: code, Field.CALL: call.number,
                   Field.REJECTED: int(call.rejection is not None)}
        compare = tuple(compare) + tuple(f for f in call.agreed if f not in compare)
        entries = dict(send_counts=send_counts, expected=expected, sent_digests=sent_digests,
                       expected_digests=expected_digests)
        call.started = True
        texts: Optional[dict[int, str]]
        if self.shrink and code in _SHRINKING:
            rows, skip = self._shrinking(call, op, scalars, entries, skip, propose)
            texts = None
        else:  # ranks are masked only in shrinking buffers
            assert not skip, "masked ranks without shrink"
            for announce in self.announcers:
                announce(op, code)
            rows, texts = self._post_vector(op, vector(scalars, num_ranks=R, **entries), call.rejection, device)
        F = len(Field)
        for r in skip:
            rows[r] = rows[self.rank][:F] + [0] * R + [UNKNOWN] * (3 * R)
        shake = Handshake(rows, skip)
        self._verdict(shake, op, compare, verdict,
                      (lambda rejected: [texts[r] for r in rejected]) if texts is not None else
                      (lambda rejected: self._rejected_texts(call, op, device, skip, rejected)),
                      rejected_here=call.rejection is not None)
        return shake

    def _post_vector(self, op: str, row: list[int], rejection: Optional[str],
                     device: torch.device) -> tuple[list[list[int]], dict[int, str]]:
        """Every rank's vector, and the rejecting ranks' messages: a post with no rows
        (``Transport.post``), the very exchange that carries a low-latency call's header, so that a
        handshake and a low-latency call that meet are judged alike."""
        R = self.num_ranks
        posted = self.transport.post(call_header.encode(row, rejection), [0] * R, 0, no_rows, op=op, device=device)
        try:
            headers = posted.headers()
            rows = call_header.decode(headers, len(row))
            rejected = _rejecting(Handshake(rows))
            texts = dict(zip(rejected, call_header.messages(headers, len(row), rejected))) if rejected else {}
        finally:
            posted.release()
        return rows, texts

    def _shrinking(self, call: _Call, op: str, scalars: Mapping[Field, int], entries: dict[str, Any],
                   skip: frozenset[int], propose: Optional[Proposal]) -> tuple[list[list[int]], frozenset[int]]:
        """A shrinking buffer's handshake exchange (``shrink.py``): (every rank's vector, masked
        ranks), the same on every rank that returns; breaks the buffer of a rank that was masked."""
        R, me, transport = self.num_ranks, self.rank, self.transport
        joinable = self.joinable if op == "low_latency_dispatch" and skip else None
        ready = joinable(skip) if joinable is not None else frozenset()
        while True:
            sources = [r for r in range(R) if r not in skip]
            got, late = transport.gather_tolerant(vector(scalars, num_ranks=R, **entries), sources, sources, op=op)
            if len({row[Field.CALL] for row in got.values()}) > 1:  # out of step: the verdict says so
                return [got.get(r, []) for r in range(R)], skip | frozenset(late)
            # sent to the late ranks too: one that is only slow learns that it was masked
            notes, missed = transport.gather_tolerant(note(call.number, skip, late, ready, R), sources,
                                                      [r for r in sources if r not in late], op=op)
            union, masked_by, masks, joiners = set(skip) | set(late) | set(missed), [], [], set()
            for r, row in notes.items():
                number, masked, seen_late, seen_ready = read_note(row, R)
                masks.append(masked)
                joiners |= seen_ready
                if number != call.number:
                    self.breaks(f"rank {r} was found on another call than call {call.number} ({op}) in the shrink "
                                f"protocol: a rank skipped a call, or failed one alone")
                    raise BufferUnusableError(op, me, self.broken)
                union |= masked | seen_late
                if me in masked | seen_late:
                    masked_by.append(r)
            self.masked |= union - {me}
            if me in union:
                self.breaks(f"rank {me} was masked by ranks {masked_by} in call {call.number} ({op}): they masked "
                            f"it earlier, or it did not arrive within their {transport.timeout_s:g} s deadline; "
                            f"a rank masked while alive cannot rejoin this Buffer")
                raise BufferUnusableError(op, me, self.broken)
            if missed:
                self.breaks(f"ranks {missed} did not send their shrink notes of call {call.number} ({op}) within "
                            f"the deadline, so this rank cannot know which ranks the others masked")
                raise BufferUnusableError(op, me, self.broken)
            if all(masked == union for masked in masks):
                if joiners:  # masked ranks with a replacement waiting (the others stay masked: absent)
                    self.admit = frozenset(joiners)
                return [got.get(r, []) for r in range(R)], skip
            skip = frozenset(union)
            if propose is not None:
                entries = {**entries, **propose(skip)}

    def _verdict(self, shake: Handshake, op: str, compare: Sequence[Field],
                 verdict: Optional[Callable[[Handshake], None]], texts_of: Callable[[list[int]], list[str]],
                 rejected_here: bool) -> None:
        """The verdict on every rank's vector, the same on every rank: BufferUnusableError when ranks are on
        different calls; CrossRankMismatchError (marked agreed) when a rank rejected its arguments (its
        reason from ``texts_of(rejected ranks)``, which every rank calls: it may exchange them; a rank that
        rejected, ``rejected_here``, returns and raises its own error) or the vectors disagree."""
        self._same_call(shake, op)
        try:
            rejected = _rejecting(shake)
            if rejected:
                texts = texts_of(rejected)
                if not rejected_here:
                    raise _rejected_error(op, rejected, texts)
            else:
                check(shake, op, compare)
                if verdict is not None:
                    verdict(shake)
        except CrossRankMismatchError as exc:
            raise mark_agreed(exc)

    def _rejected_texts(self, call: _Call, op: str, device: torch.device, skip: frozenset[int],
                        rejected: list[int]) -> list[str]:
        """(A shrinking buffer's handshake, whose vectors carry no messages.) The messages of the ``rejected``
        ranks, exchanged among the ranks not in ``skip``."""
        R = self.num_ranks
        text = (call.rejection or "").encode()[:_MESSAGE_BYTES]
        mine = torch.zeros(R, _MESSAGE_BYTES, dtype=torch.uint8, device=device)
        mine[:, :len(text)] = torch.tensor(list(text), dtype=torch.uint8, device=device)
        got = torch.zeros_like(mine)
        self.transport.all_to_all(got, mine, [1] * R, [1] * R, op=op, skip=skip).wait()
        got = got.cpu()
        return [bytes(got[r].tolist()).rstrip(bytes(1)).decode(errors="replace") for r in rejected]

def _rejecting(shake: Handshake) -> list[int]:
    """The ranks whose vector carries the rejected bit."""
    return [r for r, flag in enumerate(shake.field(Field.REJECTED)) if flag > 0]


def no_rows(dest: int, first: int, out: torch.Tensor) -> None:
    """The rows of a post that sends none (a handshake, a rejection)."""
    raise AssertionError("this post sends no rows")


def _rejected_error(op: str, rejected: list[int], texts: list[str]) -> CrossRankMismatchError:
    """What every rank but the rejecting ones raises when ranks ``rejected`` rejected their arguments."""
    said = "; ".join(f"rank {r} rejected its arguments ({text})" for r, text in zip(rejected, texts))
    return CrossRankMismatchError(f"{op}: {said}; every rank fails this call, and the Buffer stays usable")

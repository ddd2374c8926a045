"""A kernel launch's error record (``csrc/cuda/protocol/wait.h``) as the exception the host raises."""
from __future__ import annotations

from typing import Optional

from ...core.errors import CommTimeoutError, PeerExitedError

__all__ = ["HeadersDisagree", "raise_for"]

#: What each wait waited for (``WaitKind``), for messages.
_WAITED_FOR = {"BARRIER": "its arrival at the barrier", "RING_SPACE": "free ring slots (its receiver)",
               "RING_DATA": "ring data (its sender)", "COUNT": "its low-latency dispatch count",
               "COMBINE_FLAG": "its low-latency combine rows",
               "RDMA_SPACE": "free RDMA ring slots (its receiver across nodes)",
               "RDMA_DATA": "RDMA ring data (its sender across nodes)", "HEADER": "its low-latency call header",
               "CONSUMED": "it to receive this rank's call two calls back (flow control)"}


class HeadersDisagree(Exception):
    """A low-latency receive found the call's headers unlike (or a rank's rejected bit): the caller
    reads them and raises the verdict (``CallAgreement.judge``), the same on every rank."""


def raise_for(kernels, op: str, timeout_s: float, pids: list[int],
              record: Optional[tuple[int, int, int, int, int, int, int]]) -> None:
    """Raises CommTimeoutError or PeerExitedError naming the peer when ``record`` (a launch's result
    from ``kernels``, moe_comm._cuda_host or moe_comm._cuda) is an error; returns when it is None."""
    if record is None:
        return
    code, kind, rank, peer, where, observed, expected = record
    kind_name = kernels.WaitKind(kind).name
    outcome = kernels.WaitOutcome(code)
    if outcome == kernels.WaitOutcome.PEER_EXITED:
        raise PeerExitedError(op, rank, peer, pids[peer])
    if outcome == kernels.WaitOutcome.MISMATCH:
        raise HeadersDisagree(f"{op}: rank {peer}'s call header differs from rank {rank}'s in word {where}")
    if outcome == kernels.WaitOutcome.PAST_TARGET:  # not agreed: the buffer breaks
        raise RuntimeError(f"{op}: rank {rank} waits for call {expected}, but rank {peer} already sent call "
                           f"{observed} ({_WAITED_FOR.get(kind_name, kind_name)}): the ranks are out of step (a "
                           f"rank skipped a call, or failed one alone)")
    detail = (f"the kernel waited for rank {peer}: {_WAITED_FOR.get(kind_name, kind_name)} (wait {kind_name}, "
              f"channel/expert {where}; flag {observed}, wanted >= {expected})")
    raise CommTimeoutError(op, rank, timeout_s, [peer], detail)

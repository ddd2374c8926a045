"""What the kernel dispatches of both layouts (``normal.py`` intranode, ``internode.py`` across nodes) share:
their inputs by address, the check of notify's counts, and what they do with their outputs once the
launch is queued."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...protocol.normal_layout import fill_padding
from ..base import DispatchResult

__all__ = ["cached_result", "check_notify", "finish_dispatch", "kernel_topk_ids", "pinned_inputs"]


def pinned_inputs(pin: Any, x: torch.Tensor, scales: Optional[torch.Tensor], topk_idx: Optional[torch.Tensor],
                  topk_weights: Optional[torch.Tensor]) -> tuple[int, int, int, int]:
    """A dispatch's inputs as the kernels read them, by address (``pin``: a ``Pins``; 0 for None): x
    (contiguous), scales, top-k ids as int64, top-k weights as float32."""
    return (pin(x.contiguous()), pin(None if scales is None else scales.contiguous()),
            pin(None if topk_idx is None else topk_idx.to(torch.int64).contiguous()),
            pin(None if topk_weights is None else topk_weights.to(torch.float32).contiguous()))


def check_notify(rank: int, what: str, kernel: torch.Tensor, agreed: torch.Tensor) -> None:
    """Raises unless the notify kernel's ``what`` equals what the handshake (or the handle) agreed: a
    difference is a protocol bug in csrc/cuda, never a caller's error."""
    if not torch.equal(kernel.cpu(), agreed.cpu()):
        raise RuntimeError(f"dispatch: rank {rank}: the notify kernel's {what} {kernel.tolist()} differs from the "
                           f"handshake's {agreed.tolist()} (a protocol bug in csrc/cuda)")


def kernel_topk_ids(recv_topk_idx: Optional[torch.Tensor], device: torch.device) -> Optional[torch.Tensor]:
    """Where the dispatch kernel writes the received top-k ids (int64): the caller's tensor when it is
    int64, else a scratch one ``finish_dispatch`` copies from."""
    if recv_topk_idx is None or recv_topk_idx.dtype == torch.int64:
        return recv_topk_idx
    return torch.empty(recv_topk_idx.shape, dtype=torch.int64, device=device)


def finish_dispatch(agreement: Any, job: Any, outputs: tuple, idx64: Optional[torch.Tensor],
                    received: int) -> Callable[[], None]:
    """The deferred end of a non-cached kernel dispatch (``dispatch_outputs``' five tensors): waits for the
    launch, copies the top-k ids into the caller's dtype, and pads the rows past the ``received`` ones."""
    recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx = outputs

    @agreement.deferred("dispatch")
    def finish() -> None:
        job.wait()
        if idx64 is not recv_topk_idx:
            recv_topk_idx[:received].copy_(idx64[:received])
        fill_padding([recv_x, recv_scales, recv_topk_idx, recv_topk_weights, recv_src_idx], [0, 0, -1, 0.0, -1],
                     received)

    return finish


def cached_result(agreement: Any, job: Any, recv_x: torch.Tensor, recv_scales: Optional[torch.Tensor],
                  received: int) -> DispatchResult:
    """A cached kernel dispatch's result: ``recv_x`` and ``recv_scales`` (None: no scales), filled by the
    deferred end, which waits for the launch and pads the rows past the ``received`` ones."""

    @agreement.deferred("dispatch")
    def finish() -> None:
        job.wait()
        fill_padding([recv_x, recv_scales], [0, 0], received)

    return DispatchResult(recv_x, recv_scales, None, None, None, None, finish)

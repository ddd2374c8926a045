"""What the kernel dispatches of both layouts (``normal.py`` intranode, ``internode.py`` across nodes) do
with their outputs once the launch is queued."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..portable.normal import fill_padding

__all__ = ["finish_dispatch", "kernel_topk_ids"]


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

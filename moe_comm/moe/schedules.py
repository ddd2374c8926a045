"""The orders in which an EP-MoE forward runs its steps (``stages.py``), one function per mode.

Each returns this rank's `[T, H]` bf16 output, tokens in input order. Every rank must run the same
mode with the same number of micro-batches (each step is collective, in the same order everywhere).
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..buffer.buffer import Buffer
from .experts import Experts
from .stages import LowLatencyStages, NormalStages

__all__ = ["MODES", "LOW_LATENCY_MODES", "num_micro_batches", "micro_batches", "stages_for", "run", "sequential",
           "chunked", "two_batch", "low_latency"]

MODES = ("sequential", "chunked", "two_batch", "low_latency")
#: the modes that run on the low-latency calls (a Buffer with low_latency_mode=True)
LOW_LATENCY_MODES = ("two_batch", "low_latency")


def num_micro_batches(mode: str, num_chunks: int) -> int:
    """How many micro-batches ``mode`` splits each rank's tokens into."""
    return {"chunked": num_chunks, "two_batch": 2}.get(mode, 1)


def micro_batches(num_tokens: int, count: int) -> list[slice]:
    """``count`` consecutive token ranges, the first ``num_tokens % count`` one token longer (some may
    be empty); the split every mode and the reference use."""
    # (no divmod: torch.compile traces this with a symbolic num_tokens)
    size, extra = num_tokens // count, num_tokens % count
    bounds = [slice(i * size + min(i, extra), (i + 1) * size + min(i + 1, extra)) for i in range(count)]
    return bounds


def stages_for(mode: str, buffer: Buffer, experts: Experts, num_experts: int,
               num_max_dispatch_tokens_per_rank: Optional[int], impl: Optional[str] = None) -> Any:
    """The steps ``mode`` runs: low-latency calls (with M = ``num_max_dispatch_tokens_per_rank``) or normal ones."""
    if mode in LOW_LATENCY_MODES:
        return LowLatencyStages(buffer, experts, num_experts, num_max_dispatch_tokens_per_rank, impl)
    return NormalStages(buffer, experts, num_experts, impl)


def run(mode: str, stages: Any, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
        num_chunks: int) -> torch.Tensor:
    """``mode``'s schedule over ``stages`` (``stages_for``'s, or any object with the same three steps)."""
    if mode == "chunked":
        return chunked(stages, x, topk_idx, topk_weights, num_chunks)
    return {"sequential": sequential, "two_batch": two_batch, "low_latency": low_latency}[mode](
        stages, x, topk_idx, topk_weights)


def sequential(stages: NormalStages, x: torch.Tensor, topk_idx: torch.Tensor,
               topk_weights: torch.Tensor) -> torch.Tensor:
    """Normal mode, one step after the other: dispatch, experts, combine."""
    received = stages.dispatch(x, topk_idx, topk_weights)
    return stages.combine(stages.compute(received), received)[0]


def chunked(stages: NormalStages, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
            num_chunks: int) -> torch.Tensor:
    """Normal mode over ``num_chunks`` micro-batches, pipelined: while the experts run on chunk i, the
    dispatch of chunk i + 1 and the combine of chunk i - 1 are in flight (``async_finish`` events).
    Each step's blocking count handshake happens where it is posted."""
    parts = micro_batches(x.shape[0], num_chunks)
    received = [None] * num_chunks
    outs: list[torch.Tensor] = []
    combining = None  # (out, event) of the previous chunk's combine
    received[0] = stages.dispatch(x[parts[0]], topk_idx[parts[0]], topk_weights[parts[0]], async_finish=True)
    for i in range(num_chunks):
        if i + 1 < num_chunks:
            nxt = parts[i + 1]
            received[i + 1] = stages.dispatch(x[nxt], topk_idx[nxt], topk_weights[nxt], async_finish=True)
        partial = stages.compute(received[i])
        if combining is not None:
            combining[1].current_stream_wait()
        combining = stages.combine(partial, received[i], async_finish=True)
        received[i] = None  # its rows are no longer needed
        outs.append(combining[0])
    combining[1].current_stream_wait()
    return torch.cat(outs) if num_chunks > 1 else outs[0]


def two_batch(stages: LowLatencyStages, x: torch.Tensor, topk_idx: torch.Tensor,
              topk_weights: torch.Tensor) -> torch.Tensor:
    """Low-latency mode over two micro-batches A and B with receive hooks (SGLang's two-batch overlap):
    send A, send B, receive A and run its experts while B travels, send A's combine, receive B and
    run its experts while A's combine travels, send B's combine, receive both. The two micro-batches
    use DeepEP's two low-latency buffers."""
    a, b = micro_batches(x.shape[0], 2)
    got_a = stages.dispatch(x[a], topk_idx[a], topk_weights[a], hook=True)
    got_b = stages.dispatch(x[b], topk_idx[b], topk_weights[b], hook=True)
    out_a, hook_a = stages.combine(stages.compute(got_a), got_a, hook=True)
    out_b, hook_b = stages.combine(stages.compute(got_b), got_b, hook=True)
    hook_a()
    hook_b()
    return torch.cat([out_a, out_b])


def low_latency(stages: LowLatencyStages, x: torch.Tensor, topk_idx: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
    """Low-latency mode on one batch (decode): dispatch, experts on the masked layout, weighted combine."""
    received = stages.dispatch(x, topk_idx, topk_weights)
    return stages.combine(stages.compute(received), received)[0]

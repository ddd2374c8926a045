"""Recommended ``Config``s per rank count (DeepEP's tables), for any rank count."""
from __future__ import annotations

from .checks import check_int
from .config import Config

__all__ = ["dispatch_config", "combine_config"]

# num_ranks -> (nvl_send, nvl_recv, rdma_send, rdma_recv): DeepEP v1's tuned tables (deep_ep/buffer.py).
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
             24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
             96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
            24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
            96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _pick(table: dict[int, tuple[int, int, int, int]], num_ranks: int, num_sms: int, op: str) -> Config:
    check_int(op, "num_ranks", num_ranks, minimum=1)
    # No whitelist: a rank count DeepEP never tuned takes the nearest tuned entry at or above it
    # (the largest for bigger groups); 1 rank takes the 2-rank entry.
    key = min((k for k in table if k >= num_ranks), default=max(table))
    return Config(num_sms, *table[key])


def dispatch_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended dispatch ``Config`` for ``num_ranks`` (any value >= 1)."""
    return _pick(_DISPATCH, num_ranks, num_sms, "get_dispatch_config")


def combine_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended combine ``Config`` for ``num_ranks`` (any value >= 1)."""
    return _pick(_COMBINE, num_ranks, num_sms, "get_combine_config")

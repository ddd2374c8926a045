"""Bitwise comparison that lets NaN payloads differ (torch's own NaN bits depend on the tensor's size)."""
from __future__ import annotations

import torch


def assert_same_bits_or_both_nan(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """Same shape and dtype, NaN at the same places, every other element bit for bit."""
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.dtype} {list(got.shape)} vs " \
                                                                f"{want.dtype} {list(want.shape)}"
    if not want.dtype.is_floating_point:
        assert torch.equal(got, want), f"{what}: {int((got != want).sum())} elements differ"
        return
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan), f"{what}: NaN positions differ"
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    got_bits, want_bits = got.view(as_int)[~nan], want.view(as_int)[~nan]
    assert torch.equal(got_bits, want_bits), f"{what}: {int((got_bits != want_bits).sum())} elements differ"

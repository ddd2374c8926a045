"""The native GEMM's fp32 weight cache: the same bits as converting on every call, never stale, bounded."""
import gc

import pytest
import torch

from moe_comm import ops
from moe_comm.ops import weight_cache
from moe_comm.ops.fp8 import per_block_cast_to_fp8


def _ffn(x, w13, w2, offsets, **scales):
    return ops.expert_ffn(x, w13, w2, expert_offsets=offsets, impl="native", **scales)


@pytest.fixture
def fresh_cache():
    weight_cache.clear()
    yield
    weight_cache.clear()


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cached_weights_give_the_same_bits(fresh_cache, monkeypatch, fp8):
    experts, hidden, inter = 3, 256, 128
    w13, w2 = torch.randn(experts, 2 * inter, hidden) / 16, torch.randn(experts, hidden, inter) / 11
    x = torch.randn(20, hidden).bfloat16()
    offsets = torch.tensor([0, 7, 7, 20])  # expert 1 has no rows
    scales = {}
    if fp8:
        (w13, s13), (w2, s2) = per_block_cast_to_fp8(w13), per_block_cast_to_fp8(w2)
        x, x_scales = ops.quantize(x, "e4m3")
        scales = dict(x_scales=x_scales, w13_scales=s13, w2_scales=s2)
    else:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    monkeypatch.setenv("MOE_COMM_WEIGHT_CACHE_BYTES", "0")
    uncached = _ffn(x, w13, w2, offsets, **scales)
    assert weight_cache.cache_stats()["entries"] == 0
    monkeypatch.delenv("MOE_COMM_WEIGHT_CACHE_BYTES")
    first, again = _ffn(x, w13, w2, offsets, **scales), _ffn(x, w13, w2, offsets, **scales)
    stats = weight_cache.cache_stats()
    assert stats["hits"] >= 1 and stats["entries"] >= 1
    assert torch.equal(first.view(torch.int16), uncached.view(torch.int16))
    assert torch.equal(again.view(torch.int16), uncached.view(torch.int16))


def test_cache_follows_in_place_changes_and_frees_with_the_weights(fresh_cache):
    w13, w2 = torch.randn(2, 256, 128).bfloat16(), torch.randn(2, 128, 128).bfloat16()
    x, offsets = torch.randn(9, 128).bfloat16(), torch.tensor([0, 4, 9])
    before = _ffn(x, w13, w2, offsets)
    w13.mul_(2)  # same tensor, new values: the cached copy must not be used
    after = _ffn(x, w13, w2, offsets)
    fresh = _ffn(x, w13.clone(), w2, offsets)
    assert torch.equal(after.view(torch.int16), fresh.view(torch.int16))
    assert not torch.equal(after.view(torch.int16), before.view(torch.int16))
    held = weight_cache.cache_stats()["bytes"]
    assert held > 0
    del w13, fresh
    gc.collect()
    assert weight_cache.cache_stats()["bytes"] < held


def test_cache_stays_within_its_limit(fresh_cache, monkeypatch):
    one = 2 * 256 * 128 * 4  # bytes of one fp32 copy of a [2, 256, 128] w13
    monkeypatch.setenv("MOE_COMM_WEIGHT_CACHE_BYTES", str(one + one // 2))
    w2 = torch.randn(2, 128, 128).bfloat16()
    x, offsets = torch.randn(6, 128).bfloat16(), torch.tensor([0, 3, 6])
    weights = [torch.randn(2, 256, 128).bfloat16() for _ in range(3)]
    for w13 in weights:
        _ffn(x, w13, w2, offsets)
        assert weight_cache.cache_stats()["bytes"] <= one + one // 2
    stats = weight_cache.cache_stats()
    assert stats["misses"] >= 3 and 1 <= stats["entries"] <= 2  # the older copies were evicted

"""DeepEP V2's ``ElasticBuffer`` on CPU ranks (every world kind: the portable transports and the cuda_host
kernels): dispatch, its expanded layout, FP8 scale factors, cached repeats and combine, bitwise against a
reference written from V2's semantics; and a bad argument on one rank failing the call on every rank."""
import pytest

from helpers.elastic_cases import facts, one_rank_rejects, roundtrip
from helpers.tiers import exhaustive

CASES = [
    # world, tokens, hidden, topk, experts, keywords
    (2, 24, 256, 4, 8, {}),
    (2, 24, 256, 4, 8, dict(expand=True, alignment=8, num_bias=2)),
    (3, 16, 128, 3, 9, dict(fp8=True, masked=True, num_bias=1)),
    (3, 16, 256, 4, 12, dict(fp8=True, expand=True, alignment=4, tma_sf=True, cpu_sync=False)),
    (4, 12, 128, 6, 16, dict(masked=True, cpu_sync=False)),
    (2, 1, 128, 2, 4, dict(expand=True)),
    (4, 16, 128, 6, 16, dict(ranks_per_node=2, num_bias=2, masked=True)),   # hybrid: 2 nodes of 2
    (4, 16, 128, 4, 8, dict(ranks_per_node=2, expand=True, alignment=4)),
    (4, 3, 128, 4, 8, dict(ranks_per_node=2, expand=True, multi=False, num_bias=1)),   # rank 3 sends nothing
    (3, 12, 128, 4, 12, dict(multi=False, masked=True, num_bias=2)),
    exhaustive(4, 32, 512, 8, 32, dict(fp8=True, expand=True, alignment=16, masked=True, num_bias=2)),
]


@pytest.mark.parametrize("world_size,tokens,hidden,topk,experts,kw", CASES)
def test_elastic_dispatch_combine(worlds, world_size, tokens, hidden, topk, experts, kw):
    results = worlds(world_size).run(roundtrip, tokens, hidden, topk, experts, kw)
    assert [r["rank"] for r in results] == list(range(world_size))
    assert all(r["checks"] >= 9 for r in results)
    assert sum(r["num_recv"] for r in results) > 0


@pytest.mark.parametrize("case,error,words", [
    ("num_sms", "ValueError", "num_sms must be >= 0"),
    ("too_many_tokens", "ValueError", "at most num_max_tokens_per_rank=4 rows"),
    ("duplicate_expert", "ValueError", "distinct experts in each token's row"),
    ("zero_padding_without_expand", "ValueError", "do_zero_padding must be False unless do_expand=True"),
    ("weights_shape", "ValueError", "topk_weights must be shaped"),
])
def test_elastic_bad_argument_fails_every_rank(worlds, case, error, words):
    results = worlds(2).run(one_rank_rejects, case)
    (err0, msg0), (err1, msg1) = [r["outcome"] for r in results]
    assert err0 == error and words in msg0, (err0, msg0)
    assert err1 == "CrossRankMismatchError" and "rank 0" in msg1, (err1, msg1)


def test_elastic_num_max_tokens_per_rank_must_agree(worlds):
    """Every rank fails alike, naming the field and each rank's value, before any byte moves."""
    results = worlds(2).run(one_rank_rejects, "num_max_tokens_differs")
    for r in results:
        err, msg = r["outcome"]
        assert err == "CrossRankMismatchError" and "num_max_dispatch_tokens_per_rank" in msg, (err, msg)
        assert "16" in msg and "8" in msg, msg


def test_elastic_sizes_domains_barrier_and_refusals(worlds):
    results = worlds(2).run(facts)
    for r in results:
        assert r["refused"] == [True] * 4
        assert "explicitly_destroy=False" in r["destroy"], r["destroy"]

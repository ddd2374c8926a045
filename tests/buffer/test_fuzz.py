"""A seeded fuzz of malformed calls on every transport: each bad call raises a clear error on every
rank, and the correct calls after it are right bit for bit (never shifted, stale or crashed)."""
import os

import pytest

from helpers.fuzz_cases import CORRUPTIONS, fuzz

SEED = int(os.environ.get("MOE_COMM_TEST_SEED", "0"))
STEPS = 150  # per world size: 300 malformed calls per transport


@pytest.mark.parametrize("world_size", [2, 3])
def test_malformed_calls_never_shift_corrupt_or_crash_later_ones(worlds, world_size):
    results = worlds(world_size).run(fuzz, SEED + world_size, STEPS)
    for rank, stats in enumerate(results):
        assert sum(stats["cases"].values()) == STEPS, stats
        assert stats["rebuilt"] == 0, stats.get("broken_by")  # no malformed call may break a buffer
        assert not stats["unclear"], stats["unclear"]  # every message names its operation
    # the fuzz reaches most corruptions (300 draws over ~90 names)
    reached = set().union(*(set(r["cases"]) for r in results))
    assert len(reached) >= 0.6 * len(CORRUPTIONS), sorted(set(CORRUPTIONS) - reached)

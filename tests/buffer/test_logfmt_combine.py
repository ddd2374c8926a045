"""``low_latency_combine(use_logfmt=True)`` on every transport and backend: bitwise the LogFMT formula
(``moe_comm.ops.logfmt``), within DeepEP's accuracy bound (its test_low_latency: calc_diff < 1e-5 for
BF16 dispatch), and the same bits everywhere."""
import pytest

from helpers.logfmt_combine_cases import logfmt_combine

_SEEN: dict = {}


@pytest.mark.every_transport  # each run is compared with the first transport's
@pytest.mark.parametrize("world_size,hidden", [(2, 1024), (3, 1024), (2, 640)])  # 640: chunks of 512, the last 128
def test_logfmt_combine(worlds, transport, world_size, hidden):
    results = worlds(world_size).run(logfmt_combine, 24, hidden, 6 * world_size, 4)
    assert all(d < 1e-5 for r in results for d in r["diffs"]), [r["diffs"] for r in results]
    digests = [r["digests"] for r in results]
    first = _SEEN.setdefault((world_size, hidden), digests)
    assert digests == first, f"{transport} differs from the first transport run"

"""async_finish=True returns before the payload exchange completes; waiting on the event completes it."""
import pytest

from helpers.async_cases import overlapped, returns_before_delayed_payload
from helpers.deadlines import well_before

DELAY_S = 1.5  # how late the last rank packs its payloads


def test_async_calls_return_before_a_late_peers_payload_arrives(worlds, transport):
    """The other ranks' async dispatch and combine return well before the late rank's rows can have
    arrived (they cannot before DELAY_S), pending and with their outputs unwritten, and the wait
    fills the outputs with the synchronous calls' results."""
    if transport == "cuda_host":
        pytest.skip("the late rank is made late by delaying its transport's payload, which the cuda_host kernels "
                    "do not use (their launches run on the buffer's stream thread: test_exchanges_in_flight_*)")
    results = worlds(3).run(returns_before_delayed_payload, DELAY_S)
    for rank, result in enumerate(results):
        for op in ("dispatch", "combine"):
            r = result[op]
            assert r["equal"], (rank, op, r)  # written by the wait (the call's outputs were overwritten)
            if rank == len(results) - 1:
                continue  # the late rank itself: its call packed its own rows, so returned late
            assert result["rows_from_late"][op] > 0, (rank, op, result)
            assert r["pending"], (rank, op, r)
            assert r["returned_s"] < well_before(DELAY_S), (rank, op, r)
            assert r["done_s"] >= DELAY_S, (rank, op, r)  # the wait is what received the late rows


def test_exchanges_in_flight_complete_on_wait(worlds):
    for result in worlds(3).run(overlapped):
        assert result["pending_before"] == (True, True)
        assert result["pending_after_chain"] is False  # previous_event was waited on
        assert result["sync_event_empty"]

"""async_finish=True returns before the payload exchange completes; waiting on the event completes it."""
from async_cases import overlapped


def test_exchanges_in_flight_complete_on_wait(worlds):
    for result in worlds(3).run(overlapped):
        assert result["pending_before"] == (True, True)
        assert result["pending_after_chain"] is False  # previous_event was waited on
        assert result["sync_event_empty"]

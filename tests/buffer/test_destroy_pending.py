"""Asynchronous results, pending hooks and cached dispatches left unfinished across ``Buffer.destroy()``:
no process aborts, and a new Buffer on the group works (on the collective transport, a post left on the
destroyed buffer's thread once fell back to the group and met the new buffer's handshake: gloo aborted)."""
import pytest

from helpers.destroy_cases import PENDING, pending_then_new_buffer


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("pending", PENDING)
def test_pending_calls_across_destroy_leave_the_group_usable(worlds, world_size, pending):
    results = worlds(world_size).run(pending_then_new_buffer, pending)
    for rank, result in enumerate(results):
        assert result["held"] >= 1, (rank, result)
        assert result["dispatch_equal"] and result["combine_equal"], (rank, result)


@pytest.mark.every_transport  # the case the collective transport failed, on its own: on every world kind
def test_late_post_rows_across_destroy_leave_the_group_usable(worlds):
    """Rank 0's post thread moves a hooked call's rows at once, the others' 0.3 s late, after the buffer is
    destroyed and the next one is meeting on the group (before the fix, a rank's process aborted)."""
    for rank, result in enumerate(worlds(3).run(pending_then_new_buffer, "ll_hook_late_rows")):
        assert result["held"] == 1 and result["dispatch_equal"] and result["combine_equal"], (rank, result)

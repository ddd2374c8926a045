"""The CUDA kernels' host build (moe_comm._cuda_host, the cuda_host backend): the same bits as the
portable backend with rings small enough to wrap, and kernel waits that end at their deadline or
when the peer's process is gone, naming the peer."""
from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from moe_comm import _cuda_host as kernels
from moe_comm.backends.cuda.kernel_errors import raise_for
from moe_comm.backends.cuda.low_latency import reserved_bytes
from moe_comm.buffer.low_latency_args import low_latency_buffer_bytes
from moe_comm.core.errors import CommTimeoutError, PeerExitedError

from helpers.cuda_host_cases import both_backends, tampered_internode_handle
from helpers.deadlines import before, found_within
from helpers.tiers import exhaustive
from helpers.transports import local_world

# DeepEP's defaults, and rings of 4 slots fed 1-3 tokens at a time: senders wait for room, slots wrap.
CONFIGS = {"default": dict(num_sms=20), "tiny_rings": dict(num_sms=4, num_max_nvl_chunked_send_tokens=3,
                                                           num_max_nvl_chunked_recv_tokens=4),
           "one_slot_chunks": dict(num_sms=6, num_max_nvl_chunked_send_tokens=1, num_max_nvl_chunked_recv_tokens=2)}


#: Every config on 1-4 ranks; the fast tier runs each config once, on 2, 3 and 4 ranks in turn.
_SAME_BITS = [pytest.param(w, c, id=f"{w}-{c}", marks=() if w == 2 + i % 3 else pytest.mark.exhaustive)
              for i, c in enumerate(sorted(CONFIGS)) for w in (1, 2, 3, 4)]


@pytest.mark.parametrize("world_size,config", _SAME_BITS)
def test_same_bits_as_portable(world_size, config):
    """Dispatch (top-k, weights, alignment, FP8 input, cached, num_worst_tokens), combine with biases,
    and low-latency dispatch (bf16 and the three FP8 formats) and combine: every output bitwise equal."""
    with local_world(world_size, "shm", timeout_s=240, threads_per_rank=1) as world:
        for rank, equal in enumerate(world.run(both_backends, 3, CONFIGS[config])):
            assert all(equal), (rank, [i for i, e in enumerate(equal) if not e])


# Across nodes also DeepEP's internode combine rule (NVL send chunk <= recv / nodes), and RDMA rings of
# 2-4 slots fed 1-2 tokens at a time.
INTERNODE_CONFIGS = {"default": dict(num_sms=20),
                     "tiny_rings": dict(num_sms=4, num_max_nvl_chunked_send_tokens=2, num_max_nvl_chunked_recv_tokens=4,
                                        num_max_rdma_chunked_send_tokens=1, num_max_rdma_chunked_recv_tokens=2),
                     "one_slot_nvl": dict(num_sms=6, num_max_nvl_chunked_send_tokens=1,
                                          num_max_nvl_chunked_recv_tokens=2, num_max_rdma_chunked_send_tokens=2,
                                          num_max_rdma_chunked_recv_tokens=4),
                     "four_nodes": dict(num_sms=4, num_max_nvl_chunked_send_tokens=1, num_max_nvl_chunked_recv_tokens=4,
                                        num_max_rdma_chunked_send_tokens=1, num_max_rdma_chunked_recv_tokens=2)}


@pytest.mark.parametrize("world_size,ranks_per_node,config", [
    exhaustive(4, 2, "default"), (4, 2, "tiny_rings"), exhaustive(4, 2, "one_slot_nvl"), exhaustive(6, 3, "tiny_rings"),
    (4, 1, "four_nodes"), exhaustive(2, 1, "one_slot_nvl")])
def test_same_bits_as_portable_across_nodes(world_size, ranks_per_node, config):
    """The same calls on a group split into nodes (MOE_COMM_RANKS_PER_NODE): normal mode through the kernels'
    two hops (RDMA rings to the forwarders, NVL rings to the ranks; the two-level combine sum), the
    internode handle, and low latency: every output bitwise equal to the portable backend's."""
    with local_world(world_size, "shm", timeout_s=240, threads_per_rank=1) as world:
        for rank, equal in enumerate(world.run(both_backends, 5, INTERNODE_CONFIGS[config], ranks_per_node)):
            assert all(equal), (rank, [i for i, e in enumerate(equal) if not e])


def test_a_tampered_internode_handle_is_refused_on_every_rank():
    """The forwarders index by the handle's forwarded-token prefix: changed in place on one rank, that
    rank's combine raises naming handle[3], the others the same CrossRankMismatchError, and the buffer
    goes on (nothing moved)."""
    with local_world(4, "shm", timeout_s=120, threads_per_rank=1) as world:
        results = world.run(tampered_internode_handle)
    (kind0, message0, ok0), *others = results
    assert kind0 == "ValueError" and "handle[3] (recv_rdma_channel_prefix_matrix)" in message0, message0
    for kind, message, _ in others:
        assert kind == "CrossRankMismatchError" and "rank 0 rejected its arguments" in message, message
    assert ok0 and all(ok for _, _, ok in others)


def _buffers(num_ranks: int, nbytes: int) -> list[torch.Tensor]:
    return [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(num_ranks)]


def _normal(bufs: list[torch.Tensor], pids: list[int], timeout_s: float):
    return kernels.Normal([b.data_ptr() for b in bufs], pids, 0, timeout_s, 1, 1, 1, 4, 64)


def test_barrier_wait_times_out_naming_the_peer():
    """Rank 0's launch alone: its barrier wait for rank 1 ends at the deadline with a record naming rank 1."""
    bufs = _buffers(2, kernels.normal_bytes(2, 1, 1, 4, 64))
    begin = time.monotonic()
    record = _normal(bufs, [os.getpid(), os.getpid()], 0.5).prologue(1)
    elapsed = time.monotonic() - begin
    assert 0.5 <= elapsed < found_within(0.5), elapsed
    code, kind, rank, peer, channel, observed, expected = record
    assert (kernels.WaitOutcome(code), kernels.WaitKind(kind), rank, peer, observed, expected) == \
        (kernels.WaitOutcome.TIMEOUT, kernels.WaitKind.BARRIER, 0, 1, 0, 2)  # launch 1 opens with barrier 2
    with pytest.raises(CommTimeoutError, match=r"combine: rank 0 timed out after 0.5 s; ranks not heard from: \[1\]; "
                                               r"the kernel waited for rank 1: its arrival at the barrier"):
        raise_for(kernels, "combine", 0.5, [os.getpid()] * 2, record)


def _exited_pid() -> int:
    child = multiprocessing.get_context("spawn").Process(target=os.getpid)
    child.start()
    child.join()
    return child.pid


def test_wait_for_an_exited_peer_fails_at_once():
    """A wait for a rank whose process has exited fails long before its deadline, as PeerExitedError."""
    pids = [os.getpid(), _exited_pid()]
    bufs = _buffers(2, kernels.normal_bytes(2, 1, 1, 4, 64))
    begin = time.monotonic()
    record = _normal(bufs, pids, 30.0).prologue(1)
    assert time.monotonic() - begin < before(30.0)
    assert kernels.WaitOutcome(record[0]) == kernels.WaitOutcome.PEER_EXITED and record[3] == 1, record
    with pytest.raises(PeerExitedError, match=rf"rank 1 \(pid {pids[1]}\) has exited"):
        raise_for(kernels, "dispatch", 30.0, pids, record)


def test_low_latency_receive_times_out_naming_the_sender():
    """A low-latency receive whose sender never sent: the count wait names it (and its local expert)."""
    R, L, M, H = 2, 1, 4, 128
    bufs = _buffers(R, kernels.low_latency_bytes(R, L, M, H))
    ll = kernels.LowLatency([b.data_ptr() for b in bufs], [os.getpid()] * R, 0, 0.3, L, M, H)
    skip = torch.zeros(R, dtype=torch.uint8)
    x, topk = torch.zeros(1, H, dtype=torch.bfloat16), torch.zeros(1, 1, dtype=torch.int64)
    recv_x, src = torch.zeros(L, R * M, H, dtype=torch.bfloat16), torch.zeros(L, R * M, dtype=torch.int32)
    ranges, count = torch.zeros(L, R, dtype=torch.int64), torch.zeros(L, dtype=torch.int32)
    args = (1, skip.data_ptr(), 1, 0, 1, False, False, False, x.data_ptr(), topk.data_ptr(), recv_x.data_ptr(), 0,
            src.data_ptr(), ranges.data_ptr(), count.data_ptr())
    assert ll.dispatch(False, *args) is None  # sends never wait
    record = ll.dispatch(True, *args)
    assert kernels.WaitKind(record[1]) == kernels.WaitKind.COUNT and record[3] == 1 and record[4] == 0, record
    skip[1] = 1  # a masked sender is not waited for (rank 0's own count was taken: it sends again)
    assert ll.dispatch(False, *args) is None and ll.dispatch(True, *args) is None
    assert count.tolist() == [1] and ranges.tolist() == [[1, 1 << 32]]  # begin << 32 | count, as portable


def test_a_call_number_with_a_header_is_counted_in_the_buffer():
    """With a call header, a launch takes its call number from the count in its own buffer, not from its
    ``call`` argument, as a CUDA graph replay needs (a replay passes the captured number again): rank 0
    passes call 1 three times, rank 1 the numbers 1, 3, 5 of half 0, and every call agrees and delivers.
    A launch that trusted its argument would post call 1 while rank 1 waits for call 3."""
    R, L, M, H = 2, 1, 4, 128
    bufs = _buffers(R, kernels.low_latency_bytes(R, L, M, H))
    ranks = [kernels.LowLatency([b.data_ptr() for b in bufs], [os.getpid()] * R, r, 2.0, L, M, H) for r in range(R)]
    fields, room = 24, kernels.low_latency_header_bytes(R)
    header = torch.zeros(room // 8, dtype=torch.int64)
    header[0] = 4  # the op word, compared (bit 0); rows and digests all 0 on every rank: alike
    post = (header.data_ptr(), room, 2, 8 * (fields + 4 * R), 1)
    skip = torch.zeros(R, dtype=torch.uint8)
    x = [torch.full((1, H), float(r + 1), dtype=torch.bfloat16) for r in range(R)]
    topk = torch.zeros(1, 1, dtype=torch.int64)  # each rank's token goes to expert 0 (rank 0)
    outs = [(torch.zeros(L, R * M, H, dtype=torch.bfloat16), torch.zeros(L, R * M, dtype=torch.int32),
             torch.zeros(L, R, dtype=torch.int64), torch.zeros(L, dtype=torch.int32)) for _ in range(R)]

    def args(r: int, call: int) -> tuple:
        recv_x, src, ranges, count = outs[r]
        return (call, skip.data_ptr(), 1, 0, 1, False, False, False, x[r].data_ptr(), topk.data_ptr(),
                recv_x.data_ptr(), 0, src.data_ptr(), ranges.data_ptr(), count.data_ptr(), post)

    for n in (1, 3, 5):
        calls = [1, n]  # rank 0 replays call 1
        for r in range(R):
            assert ranks[r].dispatch(False, *args(r, calls[r])) is None
        for r in range(R):
            assert ranks[r].dispatch(True, *args(r, calls[r])) is None, (n, r)
        recv_x, src, _, count = outs[0]
        assert count.tolist() == [2] and src[0, :2].tolist() == [0, 0], n
        assert recv_x[0, 0].eq(1).all() and recv_x[0, 1].eq(2).all(), n  # by source: rank 0's row, rank 1's
        assert outs[1][3].tolist() == [0], n


def test_low_latency_buffers_mapped_for_num_rdma_bytes_fit_every_call_it_allows():
    """What a low_latency_mode Buffer maps at construction (``reserved_bytes`` of DeepEP's num_rdma_bytes)
    holds the kernels' layout of every call whose DeepEP size hint fits in num_rdma_bytes: no call
    grows the buffers (a growth would meet every rank)."""
    worst = None
    for R in (1, 2, 3, 4, 5, 8, 16, 32, 64):
        for L in (1, 2, 3, 4, 9, 32):
            for M in (1, 2, 3, 7, 32, 128, 129, 1024):
                for H in (128, 256, 384, 512, 1024, 2048, 2560, 4096, 7168, 8192, 16384):
                    hint = low_latency_buffer_bytes(M, H, R * L)
                    need = kernels.low_latency_bytes(R, L, M, H) - kernels.low_latency_control_bytes(R)
                    if need > reserved_bytes(hint):
                        worst = (R, L, M, H, need, reserved_bytes(hint))
    assert worst is None, worst

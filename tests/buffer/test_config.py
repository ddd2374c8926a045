"""``moe_comm.Config``, ``Buffer``'s static helpers, ``EventHandle``/``EventOverlap`` and ``moe_comm.core.env``,
checked against DeepEP v1 at commit 567632d (its C++ ``Config`` and size hints, its Python ``Buffer``)."""
from __future__ import annotations

import re
import threading
import time

import pytest

from moe_comm import Buffer, Config, EventHandle, EventOverlap
from moe_comm.core import env
from moe_comm.core.topology import split_nodes

FIELDS = ("num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
          "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens")


def _values(config: Config) -> tuple[int, ...]:
    return tuple(getattr(config, name) for name in FIELDS)


def _deepep_values(num_sms, nvl_send, nvl_recv, rdma_send, rdma_recv) -> tuple[int, ...]:
    """What DeepEP's Config(...) holds: its constructor rounds rdma recv up to a multiple of rdma send."""
    return num_sms, nvl_send, nvl_recv, rdma_send, -(-rdma_recv // rdma_send) * rdma_send


def _assert_valid(config: Config) -> None:
    """DeepEP's Config invariants, as they hold after construction."""
    sms, nvl_send, nvl_recv, rdma_send, rdma_recv = _values(config)
    assert sms >= 0 and 0 < nvl_send < nvl_recv
    assert 0 < rdma_send < rdma_recv and rdma_recv % rdma_send == 0 and rdma_send <= rdma_recv // 2


@pytest.fixture
def restore_num_sms():
    saved = Buffer.num_sms
    yield
    Buffer.num_sms = saved


# ---------------------------------------------------------------------------------------- Config
def test_config_defaults():
    config = Config()
    assert _values(config) == (20, 6, 256, 6, 258)  # 256 rounds up to a multiple of 6, as in DeepEP
    assert config.num_channels == 10
    assert _values(Config(24, 8, 288, 16, 128)) == (24, 8, 288, 16, 128)
    assert repr(config) == ("Config(num_sms=20, num_max_nvl_chunked_send_tokens=6, num_max_nvl_chunked_recv_tokens=256, "
                            "num_max_rdma_chunked_send_tokens=6, num_max_rdma_chunked_recv_tokens=258)")


@pytest.mark.parametrize("rdma_send,rdma_recv,rounded", [
    (6, 125, 126), (6, 126, 126), (6, 128, 132), (20, 128, 140), (12, 128, 132), (1, 2, 2), (7, 8, 14)])
def test_config_rounds_rdma_recv_up_to_multiple_of_send(rdma_send, rdma_recv, rounded):
    config = Config(20, 6, 256, rdma_send, rdma_recv)
    assert config.num_max_rdma_chunked_recv_tokens == rounded
    _assert_valid(config)


@pytest.mark.parametrize("args,message", [
    ((-2, 6, 256, 6, 128), "num_sms must be >= 0, got -2"),
    ((20, 0, 256, 6, 128), "num_max_nvl_chunked_send_tokens must be > 0, got 0"),
    ((20, 6, 0, 6, 128), "num_max_nvl_chunked_recv_tokens must be > 0, got 0"),
    ((20, 6, 256, 0, 128), "num_max_rdma_chunked_send_tokens must be > 0, got 0"),
    ((20, 6, 256, 6, -1), "num_max_rdma_chunked_recv_tokens must be > 0, got -1"),
    ((20, 256, 256, 6, 128), "num_max_nvl_chunked_send_tokens must be < num_max_nvl_chunked_recv_tokens (256), got 256"),
    ((20, 300, 256, 6, 128), "num_max_nvl_chunked_send_tokens must be < num_max_nvl_chunked_recv_tokens (256), got 300"),
    # rdma recv rounds up to a multiple of send first: 6 -> 6 and 5 -> 8 both leave send == recv
    ((20, 6, 256, 6, 6), "num_max_rdma_chunked_send_tokens must be < and <= half of"),
    ((20, 6, 256, 8, 5), "num_max_rdma_chunked_send_tokens must be < and <= half of"),
])
def test_config_invariants_raise_value_error(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Config(*args)


@pytest.mark.parametrize("name,bad", [(n, v) for n in FIELDS for v in (8.0, "8", True, None)])
def test_config_rejects_non_int(name, bad):
    kwargs = dict(zip(FIELDS, (20, 6, 256, 6, 128)))
    kwargs[name] = bad
    with pytest.raises(TypeError, match=re.escape(f"{name} must be an int, got {bad!r}")):
        Config(**kwargs)


# ---------------------------------------------------------------------------------------- size hints
# DeepEP's C++ size hints, term by term (SourceMeta is two ints; an int4 is 16 bytes).
_MAX_TOPK, _MAX_SCALES, _SOURCE_META, _INT4, _NVL_PEERS = 128, 128, 8, 16, 8


def _align128(n: int) -> int:
    return (n + 127) // 128 * 128


def _deepep_nvl_hint(num_sms, nvl_recv, hidden_bytes, num_ranks):
    assert num_ranks < _NVL_PEERS or num_ranks % _NVL_PEERS == 0
    num_rdma_ranks = max(num_ranks // _NVL_PEERS, 1)
    num_nvl_ranks = min(num_ranks, _NVL_PEERS)
    slots = (num_sms // 2) * num_nvl_ranks
    n = slots * (2 * num_rdma_ranks + 3) * 4
    n += slots * nvl_recv * hidden_bytes
    n += slots * nvl_recv * _SOURCE_META
    n += slots * nvl_recv * _MAX_TOPK * 8
    n += slots * nvl_recv * _MAX_TOPK * 4
    n += slots * nvl_recv * _MAX_SCALES * 4
    return _align128(n)


def _deepep_rdma_hint(num_sms, rdma_recv, hidden_bytes, num_ranks):
    if num_ranks <= _NVL_PEERS:
        return 0
    slots = (num_sms // 2) * (num_ranks // _NVL_PEERS)
    n = slots * (_NVL_PEERS * 2 + 2) * 2 * 4
    n += slots * rdma_recv * hidden_bytes * 2
    n += slots * rdma_recv * _SOURCE_META * 2
    n += slots * rdma_recv * _MAX_TOPK * 8 * 2
    n += slots * rdma_recv * _MAX_TOPK * 4 * 2
    n += slots * rdma_recv * _MAX_SCALES * 4 * 2
    n += slots * rdma_recv * _INT4 * 2
    n += 1048576
    return _align128(n)


@pytest.mark.parametrize("num_ranks", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("args", [(20, 6, 256, 6, 128), (24, 36, 288, 20, 128), (8, 4, 288, 12, 128)])
@pytest.mark.parametrize("hidden_bytes", [7168 * 2, 4096 * 2, 2 * 2])
def test_buffer_size_hints_match_deepep(num_ranks, args, hidden_bytes):
    config = Config(*args)
    assert config.get_nvl_buffer_size_hint(hidden_bytes, num_ranks) == \
        _deepep_nvl_hint(args[0], args[2], hidden_bytes, num_ranks)
    assert config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) == \
        _deepep_rdma_hint(args[0], config.num_max_rdma_chunked_recv_tokens, hidden_bytes, num_ranks)
    if num_ranks <= 8:
        assert config.get_rdma_buffer_size_hint(hidden_bytes, num_ranks) == 0


def test_nvl_hint_known_value():
    # EP8, BF16 hidden 7168, DeepEP's dispatch config: 10 channels x 8 peers x (2 * 1 + 3 control ints
    # + 256 tokens x (14336 + 8 + 1024 + 512 + 512) bytes) = 335,709,760 -> 335,709,824 aligned.
    assert Config(20, 6, 256, 6, 128).get_nvl_buffer_size_hint(7168 * 2, 8) == 335_709_824


# ---------------------------------------------------------------------------------------- recommended configs
# DeepEP v1 (567632d) Buffer.get_dispatch_config / get_combine_config tables:
# num_ranks -> (nvl_send, nvl_recv, rdma_send, rdma_recv).
DEEPEP_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
                   24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
                   96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
DEEPEP_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
                  24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
                  96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


@pytest.mark.parametrize("num_ranks,expected", [(8, (6, 256, 6, 128)), (16, (36, 288, 20, 128)),
                                                (32, (32, 288, 8, 128)), (64, (32, 288, 8, 128)),
                                                (128, (20, 560, 12, 128))])
def test_dispatch_config_deepep_md_values(num_ranks, expected):
    assert _values(Buffer.get_dispatch_config(num_ranks)) == _deepep_values(Buffer.num_sms, *expected)


@pytest.mark.parametrize("num_ranks,expected", [(8, (4, 256, 6, 128)), (16, (4, 288, 12, 128)),
                                                (32, (1, 288, 8, 128)), (64, (1, 288, 8, 128))])
def test_combine_config_deepep_md_values(num_ranks, expected):
    assert _values(Buffer.get_combine_config(num_ranks)) == _deepep_values(Buffer.num_sms, *expected)


@pytest.mark.parametrize("num_ranks,expected", sorted(DEEPEP_DISPATCH.items()))
def test_dispatch_config_full_deepep_table(num_ranks, expected):
    assert _values(Buffer.get_dispatch_config(num_ranks)) == _deepep_values(Buffer.num_sms, *expected)


@pytest.mark.parametrize("num_ranks,expected", sorted(DEEPEP_COMBINE.items()))
def test_combine_config_full_deepep_table(num_ranks, expected):
    assert _values(Buffer.get_combine_config(num_ranks)) == _deepep_values(Buffer.num_sms, *expected)


@pytest.mark.parametrize("num_ranks", [1, 3, 5, 7, 12, 200])
def test_configs_for_untuned_rank_counts(num_ranks):
    for config in (Buffer.get_dispatch_config(num_ranks), Buffer.get_combine_config(num_ranks)):
        assert isinstance(config, Config) and config.num_sms == Buffer.num_sms
        _assert_valid(config)


@pytest.mark.parametrize("bad", [0, -1])
def test_configs_reject_num_ranks_below_one(bad):
    for fn, op in ((Buffer.get_dispatch_config, "get_dispatch_config"), (Buffer.get_combine_config, "get_combine_config")):
        with pytest.raises(ValueError, match=re.escape(f"{op}: num_ranks must be >= 1, got {bad}")):
            fn(bad)


@pytest.mark.parametrize("bad", ["8", 8.0, True, None])
def test_configs_reject_non_int_num_ranks(bad):
    for fn in (Buffer.get_dispatch_config, Buffer.get_combine_config):
        with pytest.raises(TypeError, match=re.escape(f"num_ranks must be an int, got {type(bad).__name__} {bad!r}")):
            fn(bad)


def test_set_num_sms(restore_num_sms):
    Buffer.set_num_sms(24)
    assert Buffer.num_sms == 24
    assert Buffer.get_dispatch_config(8).num_sms == 24 and Buffer.get_combine_config(8).num_sms == 24
    Buffer.set_num_sms(0)
    assert Buffer.num_sms == 0


@pytest.mark.parametrize("bad,exc,message", [(21, ValueError, "new_num_sms must be even, got 21"),
                                             (-2, ValueError, "new_num_sms must be >= 0, got -2"),
                                             (20.0, TypeError, "new_num_sms must be an int"),
                                             ("20", TypeError, "new_num_sms must be an int")])
def test_set_num_sms_rejects(restore_num_sms, bad, exc, message):
    before = Buffer.num_sms
    with pytest.raises(exc, match=re.escape(f"Buffer.set_num_sms: {message}")):
        Buffer.set_num_sms(bad)
    assert Buffer.num_sms == before


# ---------------------------------------------------------------------------------------- low-latency hint
def _deepep_ll_hint(m, hidden, num_experts):
    """DeepEP v1's LowLatencyLayout(...).total_bytes and get_low_latency_rdma_size_hint's rounding."""
    num_scales = hidden // 128
    dispatch_msg = 16 + max(hidden * 2, hidden + num_scales * 4)
    combine_msg = num_scales * 4 + hidden * 2
    send = max(m * dispatch_msg, num_experts * m * combine_msg)
    recv = max(num_experts * m * dispatch_msg, num_experts * m * combine_msg)
    signaling = _align128(num_experts * 4)
    total = send * 2 + recv * 2 + signaling * 2
    return (total + 128) // 128 * 128  # DeepEP adds 128 even to an aligned total


@pytest.mark.parametrize("args", [(128, 7168, 256), (128, 7168, 288), (256, 4096, 64), (1, 128, 1), (1, 128, 3)])
def test_low_latency_rdma_size_hint_matches_deepep(args):
    m, hidden, num_experts = args
    assert Buffer.get_low_latency_rdma_size_hint(m, hidden, 8, num_experts) == _deepep_ll_hint(m, hidden, num_experts)


def test_low_latency_rdma_size_hint_worked_example():
    # DeepEP's own number for M=128, H=7168, E=256 (about 1.9 GB)
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == 1_908_410_496


def test_low_latency_rdma_size_hint_ignores_num_ranks():
    values = {Buffer.get_low_latency_rdma_size_hint(128, 7168, r, 256) for r in (1, 2, 8, 16, 256)}
    assert len(values) == 1 and values.pop() % 128 == 0


@pytest.mark.parametrize("args,exc,message", [
    ((0, 7168, 8, 256), ValueError, "num_max_dispatch_tokens_per_rank must be >= 1, got 0"),
    ((128, 64, 8, 256), ValueError, "hidden must be >= 128, got 64"),
    ((128, 7168, 0, 256), ValueError, "num_ranks must be >= 1, got 0"),
    ((128, 7168, 8, 0), ValueError, "num_experts must be >= 1, got 0"),
    ((128.0, 7168, 8, 256), TypeError, "num_max_dispatch_tokens_per_rank must be an int"),
    ((128, "7168", 8, 256), TypeError, "hidden must be an int"),
    ((128, 7168, None, 256), TypeError, "num_ranks must be an int"),
    ((128, 7168, 8, True), TypeError, "num_experts must be an int"),
])
def test_low_latency_rdma_size_hint_rejects(args, exc, message):
    with pytest.raises(exc, match=re.escape(f"Buffer.get_low_latency_rdma_size_hint: {message}")):
        Buffer.get_low_latency_rdma_size_hint(*args)


def test_is_sm90_compiled_means_fp8_dispatch_is_available():
    """DeepEP's callers ask it before FP8 normal mode; every backend dispatches FP8 tuples."""
    assert Buffer.is_sm90_compiled() is True


# ---------------------------------------------------------------------------------------- events
def test_capture_returns_completed_event():
    event = Buffer.capture()
    assert isinstance(event, EventOverlap) and isinstance(event.event, EventHandle)
    assert not event.event.is_pending
    event.current_stream_wait()
    event.current_stream_wait()
    with event:
        pass


def test_empty_event_overlap():
    event = EventOverlap()
    assert event.event is None and event.extra_tensors is None
    with pytest.raises(RuntimeError, match="EventOverlap.current_stream_wait: this EventOverlap holds no event"):
        event.current_stream_wait()
    with event:  # an empty EventOverlap is a no-op context manager, as in DeepEP
        pass


def test_event_overlap_context_manager_finishes_once():
    calls = []
    extra = (object(),)
    event = EventOverlap(EventHandle(finish=lambda: calls.append("finish")), extra)
    assert event.extra_tensors is extra and event.event.is_pending
    with event as entered:
        assert entered is event
        assert calls == []  # the body overlaps: nothing finished yet
    assert calls == ["finish"] and not event.event.is_pending
    event.current_stream_wait()
    with event:
        pass
    assert calls == ["finish"]


def test_event_overlap_finishes_on_exit_from_an_exception():
    calls = []
    event = EventOverlap(EventHandle(finish=lambda: calls.append(1)))
    with pytest.raises(KeyError):
        with event:
            raise KeyError("body")
    assert calls == [1]


def test_event_handle_finish_error_is_reraised_on_every_wait():
    calls = []

    def finish():
        calls.append(1)
        raise TimeoutError("exchange timed out")

    handle = EventHandle(finish=finish)
    for _ in range(3):
        with pytest.raises(TimeoutError, match="exchange timed out"):
            handle.current_stream_wait()
    with pytest.raises(TimeoutError, match="exchange timed out"):
        EventOverlap(handle).current_stream_wait()
    assert calls == [1]


def test_event_handle_concurrent_waits_finish_once():
    calls = []

    def finish():
        time.sleep(0.05)
        calls.append(1)

    handle = EventHandle(finish=finish)
    done = []
    threads = [threading.Thread(target=lambda: (handle.current_stream_wait(), done.append(1))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert calls == [1] and len(done) == 8  # every waiter returned after the one finish


# ---------------------------------------------------------------------------------------- env
def test_env_timeout_s(monkeypatch):
    monkeypatch.delenv("MOE_COMM_TIMEOUT_S", raising=False)
    assert env.timeout_s() == 300.0
    monkeypatch.setenv("MOE_COMM_TIMEOUT_S", "12.5")
    assert env.timeout_s() == 12.5
    monkeypatch.setenv("MOE_COMM_TIMEOUT_S", "7")
    assert env.timeout_s() == 7.0


@pytest.mark.parametrize("value", ["abc", "0", "-3", "", " ", "1s", "nan", "inf"])
def test_env_timeout_s_rejects(monkeypatch, value):
    monkeypatch.setenv("MOE_COMM_TIMEOUT_S", value)
    with pytest.raises(ValueError, match=re.escape(f"MOE_COMM_TIMEOUT_S must be a positive float, got {value!r}")):
        env.timeout_s()


def test_env_num_threads(monkeypatch):
    monkeypatch.delenv("MOE_COMM_NUM_THREADS", raising=False)
    assert env.num_threads() is None
    monkeypatch.setenv("MOE_COMM_NUM_THREADS", "3")
    assert env.num_threads() == 3
    for bad in ("0", "-1", "2.5", "many"):
        monkeypatch.setenv("MOE_COMM_NUM_THREADS", bad)
        with pytest.raises(ValueError, match=re.escape(f"MOE_COMM_NUM_THREADS must be a positive int, got {bad!r}")):
            env.num_threads()


def test_env_transport(monkeypatch):
    monkeypatch.delenv("MOE_COMM_TRANSPORT", raising=False)
    assert env.transport() is None
    monkeypatch.setenv("MOE_COMM_TRANSPORT", "  ")
    assert env.transport() is None
    monkeypatch.setenv("MOE_COMM_TRANSPORT", " collective ")
    assert env.transport() == "collective"


def test_env_pool_bytes_and_ranks_per_node(monkeypatch):
    monkeypatch.delenv("MOE_COMM_POOL_BYTES", raising=False)
    assert env.pool_bytes() == 2 << 30
    monkeypatch.setenv("MOE_COMM_POOL_BYTES", "0")
    assert env.pool_bytes() == 0
    monkeypatch.setenv("MOE_COMM_POOL_BYTES", "-1")
    with pytest.raises(ValueError, match=re.escape("MOE_COMM_POOL_BYTES must be a non-negative int, got '-1'")):
        env.pool_bytes()
    monkeypatch.delenv("MOE_COMM_RANKS_PER_NODE", raising=False)
    assert env.ranks_per_node() is None
    for value, want in (("4", 4), (" 2 ", 2), ("", None)):
        monkeypatch.setenv("MOE_COMM_RANKS_PER_NODE", value)
        assert env.ranks_per_node() == want
    for value in ("0", "x", "-2"):
        monkeypatch.setenv("MOE_COMM_RANKS_PER_NODE", value)
        with pytest.raises(ValueError, match=re.escape(f"MOE_COMM_RANKS_PER_NODE must be a positive int (ranks per "
                                                       f"emulated node), got {value!r}")):
            env.ranks_per_node()
    monkeypatch.delenv("MOE_COMM_RANKS_PER_NODE")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # a launcher's or an engine's: never splits a host
    assert split_nodes([7, 7, 7], [0, 1, 2]) == [[0, 1, 2]]


def test_output_pool_recycles_blocks_once_tensors_die():
    import gc

    import torch

    from moe_comm.core.memory import empty, pool_stats
    first = empty((1024, 1024), torch.float32, torch.device("cpu"))  # 4 MiB: pooled
    address = first.data_ptr()
    view = first[10:20]
    del first
    gc.collect()
    second = empty((1024, 1024), torch.float32, torch.device("cpu"))
    assert second.data_ptr() != address  # the view still holds the block
    del view, second
    gc.collect()
    before = pool_stats()["hits"]
    third = empty((1000, 1024), torch.float32, torch.device("cpu"))  # same 2 MiB size class
    assert pool_stats()["hits"] == before + 1 and third.shape == (1000, 1024)
    small = empty((10,), torch.float32, torch.device("cpu"))  # below 1 MiB: a plain torch tensor
    assert small.numel() == 10


def test_zero_outputs_of_every_size():
    import torch

    from moe_comm.core.memory import zeros
    for shape in ((0, 128), (3, 0), (0,), (5, 7), (1024, 1024)):
        t = zeros(shape, torch.bfloat16, torch.device("cpu"))
        assert t.shape == shape and t.dtype == torch.bfloat16 and t.is_contiguous()
        assert not t.any()
        t.fill_(1)  # writable

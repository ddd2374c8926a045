"""``Config``: DeepEP's performance-tuning knobs, with the same constructor, invariants and size hints,
and DeepEP's recommended configs per rank count (for any rank count).

On moe-comm's transports the chunk sizes do not change results or speed; they are kept so that
code written for DeepEP runs unchanged, and ``num_sms // 2`` still sets the channel count recorded
in dispatch handles.
"""
from __future__ import annotations

from .checks import check_int
from .errors import bad_argument

__all__ = ["Config", "NUM_MAX_NVL_PEERS", "check_internode_combine_config", "dispatch_config", "combine_config"]

NUM_MAX_NVL_PEERS = 8
_MAX_TOPK = 128  # DeepEP sizes its buffers for up to 128 top-k entries and 128 scales per token
_MAX_SCALES = 128
_SOURCE_META_BYTES = 8
_INT4_BYTES = 16


def _align(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


class Config:
    """Tuning knobs of the normal (high-throughput) kernels.

    Invariants (checked here, as DeepEP does): ``num_sms >= 0``; NVL send/recv chunks > 0 and
    ``send < recv``; RDMA send/recv chunks > 0; the RDMA recv chunk is rounded up to a multiple of
    the send chunk, after which ``send < recv`` and ``send <= recv / 2``.
    """

    def __init__(self, num_sms: int = 20,
                 num_max_nvl_chunked_send_tokens: int = 6, num_max_nvl_chunked_recv_tokens: int = 256,
                 num_max_rdma_chunked_send_tokens: int = 6, num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        op = "Config"
        values = dict(num_sms=num_sms, num_max_nvl_chunked_send_tokens=num_max_nvl_chunked_send_tokens,
                      num_max_nvl_chunked_recv_tokens=num_max_nvl_chunked_recv_tokens,
                      num_max_rdma_chunked_send_tokens=num_max_rdma_chunked_send_tokens,
                      num_max_rdma_chunked_recv_tokens=num_max_rdma_chunked_recv_tokens)
        for name, value in values.items():
            if isinstance(value, bool) or not isinstance(value, int):
                bad_argument(op, name, "an int", repr(value), kind=TypeError)
        if num_sms < 0:
            bad_argument(op, "num_sms", ">= 0", num_sms)
        for name in ("num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                     "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"):
            if values[name] <= 0:
                bad_argument(op, name, "> 0", values[name])
        if num_max_nvl_chunked_send_tokens >= num_max_nvl_chunked_recv_tokens:
            bad_argument(op, "num_max_nvl_chunked_send_tokens",
                         f"< num_max_nvl_chunked_recv_tokens ({num_max_nvl_chunked_recv_tokens})",
                         num_max_nvl_chunked_send_tokens)
        rdma_recv = _align(num_max_rdma_chunked_recv_tokens, num_max_rdma_chunked_send_tokens)
        if not (num_max_rdma_chunked_send_tokens < rdma_recv and num_max_rdma_chunked_send_tokens <= rdma_recv // 2):
            bad_argument(op, "num_max_rdma_chunked_send_tokens",
                         f"< and <= half of num_max_rdma_chunked_recv_tokens rounded up to a multiple of it "
                         f"({rdma_recv})", num_max_rdma_chunked_send_tokens)
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = rdma_recv

    @property
    def num_channels(self) -> int:
        """Channels of the normal kernels: ``num_sms // 2`` (at least 1 for handle bookkeeping)."""
        return max(self.num_sms // 2, 1)

    def _values(self) -> tuple[int, ...]:
        return (self.num_sms, self.num_max_nvl_chunked_send_tokens, self.num_max_nvl_chunked_recv_tokens,
                self.num_max_rdma_chunked_send_tokens, self.num_max_rdma_chunked_recv_tokens)

    def __eq__(self, other: object) -> bool:
        """Configs of the same values are equal (callers make a new one per call: a prepared call's signature
        holds the config by its values)."""
        return isinstance(other, Config) and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP's intranode buffer needs for ``hidden_bytes`` per token (``hidden * max(elem, 2)``).

        Same formula as DeepEP; rank counts above 8 that are not multiples of 8 round the node count up
        instead of failing. moe-comm does not use this size itself (a Buffer's ``num_nvl_bytes`` sizes
        the shm transport's slots).
        """
        num_rdma_ranks = max(-(-num_ranks // NUM_MAX_NVL_PEERS) if num_ranks > NUM_MAX_NVL_PEERS else 1, 1)
        num_nvl_ranks = min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * num_nvl_ranks
        per_token = hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4
        total = slots * (2 * num_rdma_ranks + 3) * 4 + slots * self.num_max_nvl_chunked_recv_tokens * per_token
        return _align(total, 128)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        """Bytes DeepEP's internode (RDMA) buffer needs; 0 for 8 ranks or fewer, as in DeepEP."""
        if num_ranks <= NUM_MAX_NVL_PEERS:
            return 0
        num_rdma_ranks = -(-num_ranks // NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * num_rdma_ranks
        per_token = hidden_bytes + _SOURCE_META_BYTES + _MAX_TOPK * 8 + _MAX_TOPK * 4 + _MAX_SCALES * 4 + _INT4_BYTES
        total = slots * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
        total += slots * self.num_max_rdma_chunked_recv_tokens * per_token * 2
        total += 1 << 20  # DeepEP's safety margin
        return _align(total, 128)

    def __repr__(self) -> str:
        return (f"Config(num_sms={self.num_sms}, "
                f"num_max_nvl_chunked_send_tokens={self.num_max_nvl_chunked_send_tokens}, "
                f"num_max_nvl_chunked_recv_tokens={self.num_max_nvl_chunked_recv_tokens}, "
                f"num_max_rdma_chunked_send_tokens={self.num_max_rdma_chunked_send_tokens}, "
                f"num_max_rdma_chunked_recv_tokens={self.num_max_rdma_chunked_recv_tokens})")


# num_ranks -> (nvl_send, nvl_recv, rdma_send, rdma_recv): DeepEP v1's tuned tables (Buffer.get_*_config).
_DISPATCH = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128), 16: (36, 288, 20, 128),
             24: (32, 288, 8, 128), 32: (32, 288, 8, 128), 48: (32, 288, 8, 128), 64: (32, 288, 8, 128),
             96: (20, 480, 12, 128), 128: (20, 560, 12, 128), 144: (32, 720, 12, 128), 160: (28, 720, 12, 128)}
_COMBINE = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128), 16: (4, 288, 12, 128),
            24: (1, 288, 8, 128), 32: (1, 288, 8, 128), 48: (1, 288, 8, 128), 64: (1, 288, 8, 128),
            96: (1, 480, 8, 128), 128: (1, 560, 8, 128), 144: (2, 720, 8, 128), 160: (2, 720, 8, 128)}


def _pick(table: dict[int, tuple[int, int, int, int]], num_ranks: int, num_sms: int, op: str) -> Config:
    check_int(op, "num_ranks", num_ranks, minimum=1)
    # No whitelist: a rank count DeepEP never tuned takes the nearest tuned entry at or above it
    # (the largest for bigger groups); 1 rank takes the 2-rank entry.
    at_or_above = [k for k in table if k >= num_ranks]  # (a list, not min(generator, default=): torch.compile traces it)
    key = min(at_or_above) if at_or_above else max(table)
    return Config(num_sms, *table[key])


def dispatch_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended dispatch ``Config`` for ``num_ranks`` (any value >= 1)."""
    return _pick(_DISPATCH, num_ranks, num_sms, "get_dispatch_config")


def combine_config(num_ranks: int, num_sms: int) -> Config:
    """DeepEP's recommended combine ``Config`` for ``num_ranks`` (any value >= 1)."""
    return _pick(_COMBINE, num_ranks, num_sms, "get_combine_config")


def check_internode_combine_config(op: str, config: Config, num_nodes: int) -> None:
    """DeepEP's extra invariants of a combine config across ``num_nodes`` nodes (its NVLink queues are
    split per source node): ``num_max_nvl_chunked_recv_tokens % num_nodes == 0`` and
    ``num_max_nvl_chunked_send_tokens <= num_max_nvl_chunked_recv_tokens / num_nodes``."""
    recv, send = config.num_max_nvl_chunked_recv_tokens, config.num_max_nvl_chunked_send_tokens
    if recv % num_nodes:
        bad_argument(op, "config.num_max_nvl_chunked_recv_tokens", f"a multiple of the node count {num_nodes} "
                     f"(DeepEP's internode combine)", recv)
    if send > recv // num_nodes:
        bad_argument(op, "config.num_max_nvl_chunked_send_tokens", f"<= num_max_nvl_chunked_recv_tokens / nodes "
                     f"= {recv} / {num_nodes} = {recv // num_nodes} (DeepEP's internode combine)", send)

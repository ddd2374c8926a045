"""The harness of tools/gpu_check: inputs and launch sequences of csrc/cuda's normal and low-latency
kernels, written once for every way of running R ranks:

- ``HostSide``: R ranks as threads of ``moe_comm._cuda_host`` over CPU tensors (the reference);
- ``EmulatedSide``: one object of ``moe_comm._cuda`` serving ranks 0..R-1 in each launch (one GPU);
- ``ProcessSide``: rank r of R processes, its own launches on every rank's buffer mapped here:
  ``moe_comm._cuda`` on buffers shared over CUDA IPC (``_cuda.SharedBuffer``), or ``moe_comm._cuda_host``
  on files in /dev/shm (``device="cpu"``: the multi-process harness checked without a GPU).

Every side builds the same inputs from the same seeds (``normal_inputs``, ``low_latency_inputs``) and
returns every output on the CPU; ``compare`` says which differ, byte for byte. Nothing here needs a
GPU until a device side is built.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch

TIMEOUT_S = 30.0  # a kernel wait's deadline (a hang becomes an error record, not a stuck step)

#: dispatch formats of the low-latency kernels: (fp8, round_scale, ue8m0)
LL_FORMATS = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8_ue8m0": (True, True, True)}


class LaunchError(RuntimeError):
    """A launch returned an error record (a wait that timed out, a peer that exited)."""


def ptr(t: Optional[torch.Tensor]) -> int:
    return 0 if t is None else t.data_ptr()


# ---------------------------------------------------------------------- shapes and inputs
@dataclass(frozen=True)
class NormalShape:
    R: int = 2
    C: int = 2              # channels
    L: int = 2              # experts per rank
    H: int = 512
    T: int = 40             # tokens per rank
    K: int = 3
    chunk: int = 4          # dispatch send chunk (Config.num_max_nvl_chunked_send_tokens)
    combine_chunk: int = 4
    slots: int = 16         # ring slots (Config.num_max_nvl_chunked_recv_tokens)
    fp8: bool = False       # dispatch e4m3 codes (random bytes) + fp32 scales per 128 channels
    weights: bool = True    # combine returns the top-k weights too
    seed: int = 11

    @property
    def x_bytes(self) -> int:
        return self.H if self.fp8 else 2 * self.H

    @property
    def scale_bytes(self) -> int:
        return 4 * (self.H // 128) if self.fp8 else 0


@dataclass(frozen=True)
class InternodeShape(NormalShape):
    """Normal mode across nodes: R = nodes * node_ranks ranks, RDMA rings of ``rdma_slots`` slots fed
    ``rdma_chunk`` tokens at a time (Config.num_max_rdma_chunked_{recv,send}_tokens)."""
    node_ranks: int = 1
    rdma_slots: int = 8
    rdma_chunk: int = 2

    @property
    def nodes(self) -> int:
        return self.R // self.node_ranks


@dataclass(frozen=True)
class LowLatencyShape:
    R: int = 2
    L: int = 2              # experts per rank
    M: int = 8              # max tokens per rank (num_max_dispatch_tokens_per_rank)
    H: int = 512            # 4 groups of 128: UE8M0 packs them into one int32
    T: int = 7
    K: int = 3
    fmt: str = "bf16"
    seed: int = 12
    logfmt: bool = False    # the combine's rows travel LogFMT-10 encoded

    @property
    def num_scales(self) -> int:
        fp8, _, ue8m0 = LL_FORMATS[self.fmt]
        groups = self.H // 128
        return (groups // 4 if ue8m0 else groups) if fp8 else 0


def routing(R: int, L: int, T: int, K: int, seed: int, device: str = "cpu") -> tuple[torch.Generator, list]:
    """Per rank ``[T, K]`` int64 top-k expert ids (distinct per token, one slot dropped as -1)."""
    g = torch.Generator(device=device).manual_seed(seed)
    E = R * L
    topks = []
    for r in range(R):
        t = torch.rand(T, E, generator=g, device=device).argsort(dim=1)[:, :K].contiguous()
        if T:
            t[r % T, 0] = -1
        topks.append(t)
    return g, topks


def normal_inputs(s: NormalShape, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """Every rank's normal-mode inputs and routing (as Buffer.get_dispatch_layout and the handle give them)."""
    g, topks = routing(s.R, s.L, s.T, s.K, s.seed, device)
    R, C, T, E = s.R, s.C, s.T, s.R * s.L
    per = max(-(-T // C), 1)
    channel = torch.arange(T, device=device) // per
    tokens = torch.arange(T, device=device).unsqueeze(1).expand(T, s.K)
    ins = []
    for r in range(R):
        topk = topks[r]
        if s.fp8:
            x = torch.randint(0, 256, (T, s.H), dtype=torch.uint8, generator=g, device=device)
            scales = torch.rand(T, s.H // 128, generator=g, device=device)
        else:
            x = torch.randn(T, s.H, generator=g, device=device).to(torch.bfloat16)
            scales = None
        w = torch.rand(T, s.K, generator=g, device=device)
        valid = topk >= 0
        in_rank = torch.zeros(T, R, dtype=torch.uint8, device=device)
        in_rank[tokens[valid], topk[valid] // s.L] = 1
        chan = torch.zeros(R, C, dtype=torch.int64, device=device).index_add_(1, channel, in_rank.t().to(torch.int64))
        d = dict(x=x, topk=topk, w=w, in_rank=in_rank, rows=in_rank.sum(0).to(torch.int64),
                 per_expert=torch.bincount(topk[valid], minlength=E).to(torch.int64),
                 chan=chan.cumsum(1).contiguous(),
                 send_pos=torch.where(in_rank.bool(), in_rank.to(torch.int64).cumsum(0) - 1, -1).to(torch.int32))
        if scales is not None:
            d["scales"] = scales
        ins.append(d)
    if s.fp8:  # combine sums bf16 rows: its own input, one row per received row
        for r in range(R):
            n = int(sum(int(i["rows"][r]) for i in ins))
            gy = torch.Generator(device=device).manual_seed(s.seed * 7919 + r)
            ins[r]["y"] = torch.randn(n, s.H, generator=gy, device=device).to(torch.bfloat16)
    return ins


def internode_inputs(s: InternodeShape, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    """``normal_inputs`` plus each rank's node routing, as the internode handle gives it: ``rdma_chan`` [Rn, C]
    cumulative tokens to each node, ``rdma_head`` [T, Rn] int32 each token's position among its channel's
    tokens to node n (-1), and what the rank forwards: ``fwd_chan`` [Rn, C] (its rail peer in node n's
    rdma_chan for this rank's node) and ``fwd_bits`` [N_fwd] int32 (each forwarded token's destination bits
    in this node; source node ascending, then token)."""
    ins = normal_inputs(s, device)
    Rn, NL, C, T = s.nodes, s.node_ranks, s.C, s.T
    channel = torch.arange(T, device=device) // max(-(-T // C), 1)
    weights = 1 << torch.arange(NL, device=device)
    for i in ins:
        bits = (i["in_rank"].view(T, Rn, NL).to(torch.int64) * weights).sum(2)       # [T, Rn]
        to_node = bits > 0
        one_hot = torch.nn.functional.one_hot(channel, C).to(torch.int64)          # [T, C]
        per = (to_node.to(torch.int64).unsqueeze(2) * one_hot.unsqueeze(1))        # [T, Rn, C]
        before = per.cumsum(0) - per
        i["rdma_chan"] = per.sum(0).cumsum(1).contiguous()
        i["rdma_head"] = torch.where(to_node, before.gather(2, channel.view(T, 1, 1).expand(T, Rn, 1)).squeeze(2),
                                     -1).to(torch.int32).contiguous()
        i["_bits"] = bits
    for r, i in enumerate(ins):
        node, local = divmod(r, NL)
        rail = [ins[n * NL + local] for n in range(Rn)]
        i["fwd_chan"] = torch.stack([q["rdma_chan"][node] for q in rail]).contiguous()
        i["fwd_bits"] = torch.cat([q["_bits"][:, node][q["_bits"][:, node] > 0] for q in rail]).to(torch.int32)
    for i in ins:
        del i["_bits"]
    return ins


def low_latency_inputs(s: LowLatencyShape, device: str = "cpu") -> list[dict[str, torch.Tensor]]:
    g, topks = routing(s.R, s.L, s.T, s.K, s.seed, device)
    out = []
    for r in range(s.R):
        out.append(dict(x=torch.randn(s.T, s.H, generator=g, device=device).to(torch.bfloat16), topk=topks[r],
                        w=torch.rand(s.T, s.K, generator=g, device=device),
                        y=torch.randn(s.L, s.R * s.M, s.H, generator=g, device=device).to(torch.bfloat16)))
    return out


# ---------------------------------------------------------------------- sides
def merge(args: Sequence[tuple]) -> tuple:
    """Per-rank argument tuples as one emulated launch takes them: equal values once, the others as lists."""
    return tuple(v[0] if all(x == v[0] for x in v) else list(v) for v in zip(*args))


class HostSide:
    """R ranks as threads of moe_comm._cuda_host (CPU tensors): the reference."""

    name = "host"

    def __init__(self, R: int, timeout_s: float = TIMEOUT_S):
        from moe_comm import _cuda_host
        self.mod, self.R, self.timeout_s = _cuda_host, R, timeout_s
        self.device = torch.device("cpu")
        self.served = list(range(R))
        self._keep: list = []

    def buffers(self, nbytes: int) -> list[int]:
        bufs = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(self.R)]
        self._keep += bufs
        return [ptr(b) for b in bufs]

    def rdma_buffers(self, nbytes: int) -> list[int]:
        return self.buffers(nbytes)

    def normal(self, bases, C, chunk, L, slots, slot_bytes):
        return [self.mod.Normal(bases, [os.getpid()] * self.R, r, self.timeout_s, C, chunk, L, slots, slot_bytes)
                for r in range(self.R)]

    def low_latency(self, bases, L, M, H):
        return [self.mod.LowLatency(bases, [os.getpid()] * self.R, r, self.timeout_s, L, M, H) for r in range(self.R)]

    def internode(self, nvl, rdma, NL, *geometry):
        """``geometry``: C, nvl_chunk, rdma_chunk, L, nvl_slots, nvl_slot_bytes, rdma_slots, rdma_slot_bytes."""
        Rn = self.R // NL
        return [self.mod.Internode([nvl[r // NL * NL + j] for j in range(NL)],
                                   [rdma[n * NL + r % NL] for n in range(Rn)],
                                   [os.getpid()] * self.R, r, self.timeout_s, *geometry) for r in range(self.R)]

    def prepare(self, args: dict[int, tuple]) -> Any:
        return [args[r] for r in self.served]

    def call_normal(self, objs, method: str, prepared) -> None:
        """Every rank's launch in its own thread (normal-mode ranks wait on each other)."""
        results: list = [None] * self.R
        errors: list = []

        def one(r: int) -> None:
            try:
                results[r] = getattr(objs[r], method)(*prepared[r])
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)
        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.R)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        if results != [None] * self.R:
            raise LaunchError(f"host {method}: {results}")

    def call_ll(self, objs, method: str, prepared) -> None:
        """Ranks one after another: a send never waits, a receive waits only for sends already made."""
        results = [getattr(objs[r], method)(*prepared[r]) for r in range(self.R)]
        if results != [None] * self.R:
            raise LaunchError(f"host {method}: {results}")

    def finish_ll(self, objs) -> None:
        pass

    def close(self) -> None:
        self._keep.clear()


class EmulatedSide:
    """Ranks 0..R-1 of one GPU in each launch of moe_comm._cuda (Normal.emulated, LowLatency.emulated)."""

    name = "emulated"

    def __init__(self, R: int, timeout_s: float = TIMEOUT_S):
        from moe_comm import _cuda
        self.mod, self.R, self.timeout_s = _cuda, R, timeout_s
        self.device = torch.device("cuda")
        self.served = list(range(R))
        self._keep: list = []

    def stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream

    def buffers(self, nbytes: int) -> list[int]:
        bufs = [torch.zeros(nbytes, dtype=torch.uint8, device="cuda") for _ in range(self.R)]
        self._keep += bufs
        return [ptr(b) for b in bufs]

    def rdma_buffers(self, nbytes: int) -> list[int]:
        return self.buffers(nbytes)

    def normal(self, bases, C, chunk, L, slots, slot_bytes):
        return self.mod.Normal.emulated(bases, self.timeout_s, C, chunk, L, slots, slot_bytes)

    def low_latency(self, bases, L, M, H):
        return self.mod.LowLatency.emulated(bases, self.timeout_s, L, M, H)

    def internode(self, nvl, rdma, NL, *geometry):
        return self.mod.Internode.emulated(nvl, rdma, NL, self.timeout_s, *geometry)

    def prepare(self, args: dict[int, tuple]) -> tuple:
        return merge([args[r] for r in self.served])

    def call_normal(self, obj, method: str, prepared) -> None:
        out = getattr(obj, method)(*prepared, self.stream())
        if out != [None] * self.R:
            raise LaunchError(f"emulated {method}: {out}")

    def call_ll(self, obj, method: str, prepared) -> None:
        getattr(obj, method)(*prepared, self.stream())  # enqueued: finish_ll reads the records

    def finish_ll(self, obj) -> None:
        self.mod.synchronize(self.stream())
        out = obj.check()
        if out != [None] * self.R:
            raise LaunchError(f"emulated low latency: {out}")

    def close(self) -> None:
        self._keep.clear()


class ProcessSide:
    """Rank ``rank`` of R processes. ``allgather(tag, obj)`` returns every rank's ``obj`` (a barrier too).
    On ``device="cuda"``: moe_comm._cuda, buffers shared over CUDA IPC; on ``"cpu"``: moe_comm._cuda_host,
    buffers in /dev/shm files (named from ``shm_prefix``), mapped by every rank. With ``link="nvshmem"``
    (on the GPU) the ranks also form an NVSHMEM world (unique id from rank 0) and the RDMA and low-latency
    buffers are its symmetric memory, launched through moe_comm._cuda_nvshmem."""

    def __init__(self, rank: int, R: int, allgather: Callable[[str, Any], list], device: str = "cuda",
                 timeout_s: float = TIMEOUT_S, shm_prefix: str = "", link: str = "ipc"):
        self.rank, self.R, self.allgather, self.timeout_s = rank, R, allgather, timeout_s
        self.served = [rank]
        self.on_gpu = device == "cuda"
        self.name = f"process{rank}"
        self.nv = None
        self._symmetric: list[int] = []
        if self.on_gpu:
            from moe_comm import _cuda
            self.mod, self.device = _cuda, torch.device("cuda")
            if link == "nvshmem":
                from moe_comm.backends.cuda.nvshmem_lib import load
                self.nv = load()
                uid = allgather("nvshmem uid", self.nv.unique_id() if rank == 0 else None)[0]
                self.nv.init(uid, rank, R)
        else:
            from moe_comm import _cuda_host
            self.mod, self.device = _cuda_host, torch.device("cpu")
        self.shm_prefix = shm_prefix or f"/dev/shm/moe_comm_gpu_check_{os.getppid()}"
        self.pids = allgather("pids", os.getpid())
        self._buffers: list = []
        self._count = 0

    def stream(self) -> int:
        return torch.cuda.current_stream().cuda_stream if self.on_gpu else 0

    def buffers(self, nbytes: int) -> list[int]:
        self._count += 1
        tag = f"buffer{self._count}"
        if self.on_gpu:
            sb = self.mod.SharedBuffer(nbytes)
            self._buffers.append(sb)
            handles = self.allgather(tag, sb.handle())
            bases = sb.open(handles, self.rank)
            self.allgather(tag + " opened", None)
            return bases
        path = f"{self.shm_prefix}_{self._count}_{self.rank}"
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, nbytes)
        finally:
            os.close(fd)
        try:
            paths = self.allgather(tag, path)
            maps = [torch.from_file(p, shared=True, size=nbytes, dtype=torch.uint8) for p in paths]
            self.allgather(tag + " opened", None)
        finally:
            os.unlink(path)  # every rank has mapped it: nothing is left in /dev/shm, whatever happens next
        self._buffers.append(maps)
        return [ptr(m) for m in maps]

    def rdma_buffers(self, nbytes: int) -> Any:
        """The RDMA (and low-latency) buffers: as ``buffers``, or NVSHMEM's symmetric memory as
        (this rank's base, every rank's base mapped here or 0, every rank's PE)."""
        if self.nv is None:
            return self.buffers(nbytes)
        base = self.nv.alloc(nbytes)
        self._symmetric.append(base)
        return base, [self.nv.peer_ptr(base, pe) for pe in range(self.R)], list(range(self.R))

    def normal(self, bases, C, chunk, L, slots, slot_bytes):
        return self.mod.Normal(bases, self.pids, self.rank, self.timeout_s, C, chunk, L, slots, slot_bytes)

    def internode(self, nvl, rdma, NL, *geometry):
        node, local = divmod(self.rank, NL)
        rail = [n * NL + local for n in range(self.R // NL)]
        mine = [nvl[node * NL + j] for j in range(NL)]
        if self.nv is None:
            return self.mod.Internode(mine, [rdma[r] for r in rail], self.pids, self.rank, self.timeout_s, *geometry)
        base, mapped, _ = rdma
        return self.nv.Internode(mine, (base, [mapped[r] for r in rail], rail), self.pids, self.rank, self.timeout_s,
                                 *geometry)

    def low_latency(self, bases, L, M, H):
        if self.nv is not None:
            return self.nv.LowLatency(bases, self.pids, self.rank, self.timeout_s, L, M, H, 0)
        return self.mod.LowLatency(bases, self.pids, self.rank, self.timeout_s, L, M, H)

    def prepare(self, args: dict[int, tuple]) -> tuple:
        return args[self.rank]

    def _extra(self) -> tuple:
        return (self.stream(),) if self.on_gpu else ()

    def call_normal(self, obj, method: str, prepared) -> None:
        out = getattr(obj, method)(*prepared, *self._extra())
        if out is not None:
            raise LaunchError(f"rank {self.rank} {method}: {out}")

    def call_ll(self, obj, method: str, prepared) -> None:
        out = getattr(obj, method)(*prepared, *self._extra())
        if out is not None:  # the host build returns its record at once
            raise LaunchError(f"rank {self.rank} {method}: {out}")

    def finish_ll(self, obj) -> None:
        if self.on_gpu:
            self.mod.synchronize(self.stream())
            out = obj.check()
            if out is not None:
                raise LaunchError(f"rank {self.rank} low latency: {out}")

    def close(self) -> None:
        """Collective teardown: unmap the peers everywhere, a barrier, then free one's own."""
        if self.on_gpu:
            torch.cuda.synchronize()
            for sb in self._buffers:
                sb.close_peers()
            self.allgather("closed peers", None)
            for sb in self._buffers:
                sb.close()
            for base in self._symmetric:  # NVSHMEM's free is collective: every rank frees the same ones
                self.nv.free(base)
            if self.nv is not None:
                self.nv.finalize()
        else:
            self.allgather("closed peers", None)
        self._buffers.clear()


# ---------------------------------------------------------------------- normal mode
class NormalCase:
    """notify -> dispatch -> prologue -> combine of the served ranks, on one side's buffers."""

    def __init__(self, side, s: NormalShape, inputs: Optional[list] = None):
        self.side, self.s = side, s
        mod, dev = side.mod, side.device
        inputs = inputs if inputs is not None else normal_inputs(s)
        self.ins = {r: {k: v.to(dev) for k, v in inputs[r].items()} for r in side.served}
        self.slot_d = mod.dispatch_slot_bytes(s.x_bytes, s.scale_bytes, s.K)
        self.slot_c = 2 * s.H + (4 * s.K if s.weights else 0)
        self.nbytes = max(mod.normal_bytes(s.R, s.C, s.L, s.slots, self.slot_d),
                          mod.normal_bytes(s.R, s.C, s.L, s.slots, self.slot_c))
        self.bases = side.buffers(self.nbytes)
        self.nd = side.normal(self.bases, s.C, s.chunk, s.L, s.slots, self.slot_d)
        self.nc = side.normal(self.bases, s.C, s.combine_chunk, s.L, s.slots, self.slot_c)
        self.epoch = 0  # barriers passed (notify and prologue number theirs)
        z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        R, C = s.R, s.C
        self.notes = {r: dict(rank_prefix=z(R, R, dtype=torch.int32), recv_offset=z(R), chan_starts=z(R, C),
                              chan_counts=z(R, C), per_expert=z(s.L), num_recv=z(1)) for r in side.served}
        self.outs: dict[int, dict] = {}

    def notify(self) -> None:
        self.epoch += 1
        args = {r: (self.epoch, ptr(i["rows"]), ptr(i["per_expert"]), ptr(i["chan"]), 1, ptr(n["rank_prefix"]),
                    ptr(n["recv_offset"]), ptr(n["chan_starts"]), ptr(n["chan_counts"]), ptr(n["per_expert"]),
                    ptr(n["num_recv"]))
                for r, i, n in self._each(self.notes)}
        self.side.call_normal(self.nd, "notify", self.side.prepare(args))
        self._allocate()

    def _each(self, per_rank: dict):
        return [(r, self.ins[r], per_rank[r]) for r in self.side.served]

    def _allocate(self) -> None:
        s, dev = self.s, self.side.device
        z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        for r in self.side.served:
            N = int(self.notes[r]["num_recv"].item())
            o = dict(recv_x=z(N, s.H, dtype=torch.uint8 if s.fp8 else torch.bfloat16), recv_idx=z(N, s.K),
                     recv_w=z(N, s.K, dtype=torch.float32), recv_src=z(N, dtype=torch.int32),
                     out=z(s.T, s.H, dtype=torch.bfloat16))
            if s.fp8:
                o["recv_scales"] = z(N, s.H // 128, dtype=torch.float32)
            if s.weights:
                o["out_w"] = z(s.T, s.K, dtype=torch.float32)
            self.outs[r] = o
        i64 = s.x_bytes
        self.dispatch_args = self.side.prepare({
            r: (s.T, i64, s.scale_bytes, s.K, ptr(i["x"]), ptr(i.get("scales")), ptr(i["topk"]), ptr(i["w"]),
                ptr(i["in_rank"]), ptr(i["chan"]), ptr(self.notes[r]["recv_offset"]), ptr(self.notes[r]["chan_starts"]),
                ptr(self.notes[r]["chan_counts"]), ptr(o["recv_x"]), ptr(o.get("recv_scales")), ptr(o["recv_idx"]),
                ptr(o["recv_w"]), ptr(o["recv_src"]))
            for r, i, o in self._each(self.outs)})
        row_type = self.side.mod.DType.BFLOAT16
        self.combine_args = self.side.prepare({
            r: (s.T, s.H, 2 * s.H, s.K if s.weights else 0, row_type, ptr(i["y"] if s.fp8 else o["recv_x"]),
                ptr(o["recv_w"]) if s.weights else 0, ptr(self.notes[r]["recv_offset"]),
                ptr(self.notes[r]["chan_starts"]), ptr(self.notes[r]["chan_counts"]), ptr(i["in_rank"]), ptr(i["chan"]),
                ptr(i["send_pos"]), 0, 0, ptr(o["out"]), ptr(o.get("out_w")))
            for r, i, o in self._each(self.outs)})

    def dispatch(self) -> None:
        self.side.call_normal(self.nd, "dispatch", self.dispatch_args)

    def prologue(self, obj=None) -> None:
        self.epoch += 1
        args = self.side.prepare({r: (self.epoch,) for r in self.side.served})
        self.side.call_normal(obj or self.nc, "prologue", args)

    def combine(self) -> None:
        self.side.call_normal(self.nc, "combine", self.combine_args)

    def run(self) -> dict[int, dict[str, torch.Tensor]]:
        self.notify()
        self.dispatch()
        self.prologue()
        self.combine()
        return self.outputs()

    def outputs(self) -> dict[int, dict[str, torch.Tensor]]:
        return {r: {k: v.cpu() for k, v in {**self.notes[r], **self.outs[r]}.items()} for r in self.side.served}


# ---------------------------------------------------------------------- normal mode across nodes
class InternodeCase(NormalCase):
    """notify -> dispatch -> prologue -> combine across nodes (kernels/internode.h) of the served ranks:
    every rank an NVL and an RDMA buffer, the forwarders' routing from ``internode_inputs``."""

    def __init__(self, side, s: InternodeShape, inputs: Optional[list] = None):
        self.side, self.s = side, s
        mod, dev = side.mod, side.device
        inputs = inputs if inputs is not None else internode_inputs(s)
        self.ins = {r: {k: v.to(dev) for k, v in inputs[r].items()} for r in side.served}
        slot_d = mod.dispatch_slot_bytes(s.x_bytes, s.scale_bytes, s.K)
        slot_c = 2 * s.H + (4 * s.K if s.weights else 0)
        geometry = (s.nodes, s.node_ranks, s.C)
        need = [mod.internode_bytes(*geometry, s.L, s.slots, slot_d, s.rdma_slots, slot_d + 4),
                mod.internode_bytes(*geometry, 0, s.slots, slot_c, s.rdma_slots, slot_c)]
        nvl, rdma = side.buffers(max(n for n, _ in need)), side.rdma_buffers(max(n for _, n in need))
        self.nd = side.internode(nvl, rdma, s.node_ranks, s.C, s.chunk, s.rdma_chunk, s.L, s.slots, slot_d,
                                 s.rdma_slots, slot_d + 4)
        self.nc = side.internode(nvl, rdma, s.node_ranks, s.C, s.combine_chunk, s.rdma_chunk, 0, s.slots, slot_c,
                                 s.rdma_slots, slot_c)
        self.epoch = 0
        z = lambda *shape, dtype=torch.int64: torch.zeros(*shape, dtype=dtype, device=dev)  # noqa: E731
        R, C = s.R, s.C
        self.notes = {r: dict(gbl_prefix=z(R, dtype=torch.int32), recv_offset=z(R), chan_starts=z(R, C),
                              chan_counts=z(R, C), recv_rdma=z(s.nodes, C), per_expert=z(s.L), num_recv=z(1))
                      for r in side.served}
        self.outs = {}

    def notify(self) -> None:
        self.epoch += 1
        args = {r: (self.epoch, ptr(i["rows"]), ptr(i["per_expert"]), ptr(i["chan"]), ptr(i["rdma_chan"]), 1,
                    ptr(n["gbl_prefix"]), ptr(n["recv_offset"]), ptr(n["chan_starts"]), ptr(n["chan_counts"]),
                    ptr(n["recv_rdma"]), ptr(n["per_expert"]), ptr(n["num_recv"]))
                for r, i, n in self._each(self.notes)}
        self.side.call_normal(self.nd, "notify", self.side.prepare(args))
        self._allocate()
        s = self.s
        self.dispatch_args = self.side.prepare({
            r: (s.T, s.x_bytes, s.scale_bytes, s.K, ptr(i["x"]), ptr(i.get("scales")), ptr(i["topk"]), ptr(i["w"]),
                ptr(i["in_rank"]), ptr(i["rdma_chan"]), ptr(i["fwd_chan"]), ptr(self.notes[r]["recv_offset"]),
                ptr(self.notes[r]["chan_starts"]), ptr(self.notes[r]["chan_counts"]), ptr(o["recv_x"]),
                ptr(o.get("recv_scales")), ptr(o["recv_idx"]), ptr(o["recv_w"]), ptr(o["recv_src"]))
            for r, i, o in self._each(self.outs)})
        self.combine_args = self.side.prepare({
            r: (s.T, s.H, 2 * s.H, s.K if s.weights else 0, self.side.mod.DType.BFLOAT16,
                ptr(i["y"] if s.fp8 else o["recv_x"]), ptr(o["recv_w"]) if s.weights else 0,
                ptr(self.notes[r]["recv_offset"]), ptr(self.notes[r]["chan_starts"]), ptr(self.notes[r]["chan_counts"]),
                ptr(i["fwd_chan"]), ptr(i["fwd_bits"]), ptr(i["rdma_head"]), 0, 0, ptr(o["out"]), ptr(o.get("out_w")))
            for r, i, o in self._each(self.outs)})


# ---------------------------------------------------------------------- low latency
class LowLatencyCase:
    """dispatch (send, receive; call 1, half 0) -> combine (send, receive; call 2, half 1) of the served ranks."""

    def __init__(self, side, s: LowLatencyShape, inputs: Optional[list] = None):
        self.side, self.s = side, s
        mod, dev = side.mod, side.device
        fp8, round_scale, ue8m0 = LL_FORMATS[s.fmt]
        inputs = inputs if inputs is not None else low_latency_inputs(s)
        self.ins = {r: {k: v.to(dev) for k, v in inputs[r].items()} for r in side.served}
        self.bases = side.rdma_buffers(mod.low_latency_bytes(s.R, s.L, s.M, s.H))
        self.obj = side.low_latency(self.bases, s.L, s.M, s.H)
        R, L, M, H, S = s.R, s.L, s.M, s.H, s.num_scales
        u8 = lambda n: torch.zeros(n, dtype=torch.uint8, device=dev)  # noqa: E731
        self.skip = {r: u8(R) for r in side.served}
        self.outs = {r: dict(recv_x=u8(L * R * M * (H if fp8 else 2 * H)), recv_scales=u8(L * S * R * M * 4),
                             src_info=torch.zeros(L, R * M, dtype=torch.int32, device=dev),
                             layout_range=torch.zeros(L, R, dtype=torch.int64, device=dev),
                             recv_count=torch.zeros(L, dtype=torch.int32, device=dev),
                             out=torch.zeros(s.T, H, dtype=torch.bfloat16, device=dev)) for r in side.served}
        self.dispatch_args = {receive: side.prepare({
            r: (receive, 1, ptr(self.skip[r]), s.T, 4 * S, s.K, fp8, round_scale, ue8m0, ptr(i["x"]), ptr(i["topk"]),
                ptr(o["recv_x"]), ptr(o["recv_scales"]) if fp8 else 0, ptr(o["src_info"]), ptr(o["layout_range"]),
                ptr(o["recv_count"]))
            for r, i, o in self._each()}) for receive in (False, True)}
        self.combine_args = {receive: side.prepare({
            r: (receive, 2, ptr(self.skip[r]), s.T, s.K, ptr(i["y"]), ptr(o["src_info"]), ptr(o["layout_range"]),
                ptr(i["topk"]), ptr(i["w"]), ptr(o["out"]), s.logfmt)
            for r, i, o in self._each()}) for receive in (False, True)}

    def _each(self):
        return [(r, self.ins[r], self.outs[r]) for r in self.side.served]

    def dispatch(self) -> None:
        for receive in (False, True):
            self.side.call_ll(self.obj, "dispatch", self.dispatch_args[receive])

    def combine(self) -> None:
        for receive in (False, True):
            self.side.call_ll(self.obj, "combine", self.combine_args[receive])

    def finish(self) -> None:
        self.side.finish_ll(self.obj)

    def run(self) -> dict[int, dict[str, torch.Tensor]]:
        self.dispatch()
        self.combine()
        self.finish()
        return self.outputs()

    def load(self, inputs: list) -> None:
        """New inputs into the same tensors (a captured graph reads them at replay)."""
        for r in self.side.served:
            for k, v in inputs[r].items():
                self.ins[r][k].copy_(v)

    def clear_outputs(self) -> None:
        for o in self.outs.values():
            for v in o.values():
                v.zero_()

    def outputs(self) -> dict[int, dict[str, torch.Tensor]]:
        return {r: {k: v.cpu() for k, v in self.outs[r].items()} for r in self.side.served}


# ---------------------------------------------------------------------- comparing
def compare(ref: dict[int, dict], got: dict[int, dict]) -> list[str]:
    """Every output of every rank in ``got`` against ``ref``, byte for byte: one line per difference."""
    bad = []
    for r in sorted(got):
        for k in sorted(ref[r]):
            a, b = ref[r][k], got[r].get(k)
            if b is None:
                bad.append(f"rank {r}: {k} missing")
                continue
            if a.shape != b.shape or a.dtype != b.dtype:
                bad.append(f"rank {r}: {k} is {tuple(b.shape)} {b.dtype}, expected {tuple(a.shape)} {a.dtype}")
                continue
            ab, bb = a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
            diff = (ab != bb).nonzero()
            if diff.numel():
                first = int(diff[0, 0]) // a.element_size()
                bad.append(f"rank {r}: {k} differs in {diff.numel()} of {ab.numel()} bytes (first at element {first}: "
                           f"{a.view(-1)[first].item()} expected, {b.view(-1)[first].item()} got)")
    return bad


def sanity(ins: list[dict], outs: dict[int, dict], s: NormalShape) -> list[str]:
    """What a normal-mode reference must satisfy whatever the kernels: counts that add up, real rows
    (across nodes: the received-row prefix and the forwarded tokens per channel)."""
    bad = []
    sent = torch.stack([i["rows"].cpu() for i in ins])  # [source][dest]
    for r, o in outs.items():
        if "rank_prefix" in o and not torch.equal(o["rank_prefix"], sent.cumsum(0).to(torch.int32)):
            bad.append(f"rank {r}: rank_prefix is not the column prefix of the sent rows")
        if "gbl_prefix" in o and not torch.equal(o["gbl_prefix"], sent[:, r].cumsum(0).to(torch.int32)):
            bad.append(f"rank {r}: recv_gbl_rank_prefix_sum is not the prefix of the rows sent to it")
        if "recv_rdma" in o and not torch.equal(o["recv_rdma"], ins[r]["fwd_chan"].cpu()):
            bad.append(f"rank {r}: notify's forwarded tokens per channel differ from the routing's")
        if int(o["num_recv"]) != int(sent[:, r].sum()):
            bad.append(f"rank {r}: num_recv {int(o['num_recv'])} != {int(sent[:, r].sum())}")
        if s.T and not (o["out"].view(torch.int16) != 0).any():
            bad.append(f"rank {r}: combine wrote nothing")
    return bad + semantics(ins, outs, s)


def semantics(ins: list[dict], outs: dict[int, dict], s: NormalShape) -> list[str]:
    """The meaning of a normal dispatch + combine, on any device: rank r's rows from source q sit at
    recv_offset[q] in q's token order and are q's rows x[recv_src]; with bf16 rows combined back
    unchanged (combine of recv_x), out[t] = bf16(n_t * x[t]) for the n_t ranks token t went to (a sum
    of n_t equal bf16 values is exact in fp32); across nodes the sum of each node's bf16(k_n * x[t]).
    Vectorised: cheap at 4096 x 7168 on a GPU."""
    bad = []
    for r, o in outs.items():
        for q in range(s.R):
            a, n = int(o["recv_offset"][q]), int(ins[q]["rows"][r])
            src = o["recv_src"][a:a + n].to(torch.int64)
            if n and (src.min() < 0 or src.max() >= s.T or (src[1:] <= src[:-1]).any()):
                bad.append(f"rank {r}: rows from rank {q} are not in its token order")
                continue
            want = ins[q]["x"].to(o["recv_x"].device)[src]
            if not torch.equal(o["recv_x"][a:a + n].view(torch.uint8), want.view(torch.uint8)):
                bad.append(f"rank {r}: rows from rank {q} are not its x[recv_src]")
        if not s.fp8:
            x = ins[r]["x"].to(o["out"].device)
            in_rank = ins[r]["in_rank"].to(x.device)
            nodes = s.nodes if isinstance(s, InternodeShape) else 1
            # per node, the ranks token t went to (the node's partial: bf16(k * x), exact sum, one rounding);
            # across nodes the partials' fp32 sum, rounded once (DeepEP's two-level order)
            k = in_rank.view(in_rank.shape[0], nodes, -1).sum(2, dtype=torch.int32).float()
            partials = (x.float().unsqueeze(1) * k.unsqueeze(2)).to(torch.bfloat16).float()
            want = torch.where(k.sum(1, keepdim=True) > 0, partials.sum(1).to(torch.bfloat16),
                               torch.zeros((), dtype=torch.bfloat16, device=x.device))
            if not torch.equal(o["out"].view(torch.int16), want.view(torch.int16)):
                bad.append(f"rank {r}: combine's out is not bf16(n_t * x[t])")
    return bad


def ll_semantics(ins: list[dict], outs: dict[int, dict], s: LowLatencyShape) -> list[str]:
    """The meaning of a low-latency dispatch, on any device: local expert e of rank r holds, per source q
    (layout_range: begin << 32 | count), the tokens of q that chose the expert, ascending; in bf16 the
    rows are q's x rows, bit for bit."""
    bad = []
    fp8 = LL_FORMATS[s.fmt][0]
    for r, o in outs.items():
        dev = o["src_info"].device
        total = 0
        for e in range(s.L):
            expert = r * s.L + e
            for q in range(s.R):
                rng = int(o["layout_range"][e, q])
                begin, n = rng >> 32, rng & 0xFFFFFFFF
                want = (ins[q]["topk"].to(dev) == expert).any(1).nonzero()[:, 0].to(torch.int32)
                got = o["src_info"][e, begin:begin + n]
                if not torch.equal(got, want):
                    bad.append(f"rank {r}: expert {expert}: tokens from rank {q} are not those that chose it")
                    continue
                total += n
                if not fp8:
                    rows = o["recv_x"].view(torch.bfloat16).view(s.L, s.R * s.M, s.H)[e, begin:begin + n]
                    if not torch.equal(rows.view(torch.int16), ins[q]["x"].to(dev)[got.long()].view(torch.int16)):
                        bad.append(f"rank {r}: expert {expert}: rows from rank {q} are not its x rows")
        if int(o["recv_count"].sum()) != total:
            bad.append(f"rank {r}: recv_count adds up to {int(o['recv_count'].sum())}, the ranges to {total}")
    return bad


# ---------------------------------------------------------------------- shipping tensors between processes
def pack(outs: dict[int, dict[str, torch.Tensor]]) -> dict:
    """CPU tensors as (dtype name, shape, bytes): picklable without torch's shared-memory reductions."""
    return {r: {k: (str(v.dtype).removeprefix("torch."), tuple(v.shape), v.contiguous().view(-1).view(torch.uint8)
                    .numpy().tobytes()) for k, v in o.items()} for r, o in outs.items()}


def unpack(packed: dict) -> dict[int, dict[str, torch.Tensor]]:
    out = {}
    for r, o in packed.items():
        out[r] = {}
        for k, (dtype, shape, data) in o.items():
            raw = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
            out[r][k] = raw.view(getattr(torch, dtype)).reshape(shape)
    return out

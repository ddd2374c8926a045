"""The ``cuda`` backend (moe_comm.backends.cuda.device_backend: the device build moe_comm._cuda on CUDA
tensors, one node, CUDA IPC buffers).

Everywhere: the registry says exactly why "cuda" cannot run (or lists it where it can), build_info and
the fat binary's architectures, and the pure logic of the backend's parts with fakes of moe_comm._cuda
and of the CUDA streams: the IPC buffers' collective growth and teardown, the stream adapter's order
and error records, the kernels adapter's streams and object reuse, notify's mapped outputs. Then
CudaBackend itself end to end on CPU ranks, with the host build's kernels behind moe_comm._cuda's
interface (what it cannot show: the tensors' device, CUDA streams, CUDA IPC), and the GPU test's
calls on cuda_host, bitwise against the portable backend.

On a GPU only (skipped elsewhere, "needs a CUDA device"): two ranks sharing GPU 0 (CUDA IPC between
processes of one GPU; spin-waits progress by time slicing) run every call on the cuda backend and on
the portable backend on CPU copies, compared bitwise; tensors off the GPU are refused alike on every
rank; a kernel's wait ends at its deadline naming the peer.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import struct
import threading
from typing import Any, Optional

import pytest
import torch

import moe_comm
from moe_comm import backends
from moe_comm.core import native as _native
from moe_comm.core.errors import BackendUnavailableError

from helpers.cuda_host_cases import calls

CUDA_BUILT = importlib.util.find_spec("moe_comm._cuda") is not None
REASON = backends.unavailable_reason("cuda")
needs_gpu = pytest.mark.skipif(REASON is not None, reason=f"needs a CUDA device ({REASON})")


# ---------------------------------------------------------------------------------------- the registry
def _expected_reason() -> str | None:
    if not CUDA_BUILT:
        return ("moe_comm._cuda (the device build of csrc/cuda) is not built: build with nvcc on PATH "
                "(MOE_COMM_CUDA=AUTO|ON)")
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False" + (
            "" if torch.version.cuda else f" (torch {torch.__version__} is built without CUDA)")
    from moe_comm import _cuda
    if _cuda.device_count() == 0:
        return "moe_comm._cuda.device_count() is 0 (moe_comm._cuda sees no CUDA device)"
    return None


def test_the_registry_says_exactly_why_cuda_cannot_run_here():
    assert "cuda" in backends.KNOWN
    assert REASON == _expected_reason(), REASON
    assert ("cuda" in backends.available()) == (REASON is None)


@pytest.mark.skipif(REASON is None, reason="the cuda backend can run here")
def test_asking_for_cuda_raises_the_reason_and_the_available_backends(monkeypatch):
    expected = f"is not available: {REASON}; available here: {backends.available()}"
    with pytest.raises(BackendUnavailableError) as raised:
        backends.choose("cuda", None)
    assert str(raised.value) == f"Buffer: backend='cuda' {expected}"
    monkeypatch.setenv("MOE_COMM_BACKEND", "cuda")
    with pytest.raises(BackendUnavailableError) as raised:
        backends.choose("auto", None)
    assert str(raised.value) == f"Buffer: MOE_COMM_BACKEND='cuda' {expected}"


def test_build_info_reports_the_device_build():
    info = moe_comm.build_info()
    assert info["cuda"] is CUDA_BUILT
    assert info["cuda_host"] is (importlib.util.find_spec("moe_comm._cuda_host") is not None)
    assert info["cuda_archs"] == _native.cuda_archs()
    assert all(re.fullmatch(r"(sm|compute)_\d+", a) for a in info["cuda_archs"]), info["cuda_archs"]
    if CUDA_BUILT:  # CMakeLists.txt's default architectures: 90-real;100-real;100-virtual
        assert info["cuda_archs"], "moe_comm._cuda holds no GPU code"


def test_import_moe_comm_leaves_the_cuda_backends_out():
    from helpers.fresh_python import run_python
    done = run_python("""
        import sys
        import moe_comm
        moe_comm.build_info()
        print(sorted(m for m in sys.modules if m.startswith("moe_comm.backends.cuda")))
        """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def _elf_with(sections: dict[bytes, bytes]) -> bytes:
    """A minimal little-endian ELF64 file holding ``sections`` (name -> contents) and .shstrtab."""
    names = b"\0" + b"".join(n + b"\0" for n in sections) + b".shstrtab\0"
    body, headers, name_at, offset = b"", [bytes(64)], 1, 64
    for name, data in list(sections.items()) + [(b".shstrtab", names)]:
        headers.append(struct.pack("<IIQQQQIIQQ", name_at, 1, 0, 0, offset + len(body), len(data), 0, 0, 8, 0))
        name_at += len(name) + 1
        body += data + bytes(-len(data) % 8)
    shoff = 64 + len(body)
    header = bytearray(64)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HHH", header, 0x3A, 64, len(headers), len(headers) - 1)
    return bytes(header) + body + b"".join(headers)


def _fatbin(entries: list[tuple[int, int]]) -> bytes:
    """A fat binary of (kind, arch) entries (kind 1: PTX, 2: cubin), each with a few payload bytes."""
    body = b""
    for kind, arch in entries:
        head = bytearray(64)
        struct.pack_into("<HHIQ", head, 0, kind, 0x101, 64, 16)
        struct.pack_into("<I", head, 28, arch)
        body += bytes(head) + bytes(16)
    return struct.pack("<IHHQ", 0xBA55ED50, 1, 16, len(body)) + body


def test_fatbin_archs_reads_every_container_of_the_section():
    blob = _fatbin([(2, 90), (1, 100)]) + _fatbin([(2, 100), (2, 90)])
    assert _native.fatbin_archs(_elf_with({b".text": b"\x90" * 5, b".nv_fatbin": blob})) == \
        ["sm_90", "sm_100", "compute_100"]
    with pytest.raises(ValueError, match="no .nv_fatbin section"):
        _native.fatbin_archs(_elf_with({b".text": b"\x90"}))
    with pytest.raises(ValueError, match="not a little-endian ELF64 file"):
        _native.fatbin_archs(b"MZ" + bytes(100))


# ---------------------------------------------------------------------------------------- IPC buffers
class _Ranks:
    """R ranks as threads of this process, with an all-gather and a barrier (a fake transport's world)."""

    def __init__(self, num_ranks: int) -> None:
        self.num_ranks = num_ranks
        self._meet = threading.Barrier(num_ranks, timeout=30)
        self._rows: list[Any] = [None] * num_ranks
        self.log: list[tuple] = []
        self._lock = threading.Lock()

    def note(self, *event: Any) -> None:
        with self._lock:
            self.log.append(event)

    def run(self, fn) -> list[Any]:
        out: list[Any] = [None] * self.num_ranks
        errors: list[BaseException] = []

        def rank(r: int) -> None:
            try:
                out[r] = fn(_FakeTransport(self, r))
            except BaseException as exc:  # reported by the test
                errors.append(exc)
                self._meet.abort()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.num_ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out


class _FakeTransport:
    device = torch.device("cpu")

    def __init__(self, ranks: _Ranks, rank: int) -> None:
        self.ranks, self.rank, self.num_ranks = ranks, rank, ranks.num_ranks

    def all_gather_rows(self, row: torch.Tensor, *, op: str) -> torch.Tensor:
        self.ranks.note(self.rank, "gather", op)
        self.ranks._rows[self.rank] = row.clone()
        self.ranks._meet.wait()
        got = torch.stack(self.ranks._rows)
        self.ranks._meet.wait()
        return got

    def barrier(self, *, op: str) -> None:
        self.ranks.note(self.rank, "barrier", op)
        self.ranks._meet.wait()


class _FakeCuda:
    """What IpcBuffers uses of moe_comm._cuda: SharedBuffer (handles name the allocation), memset, synchronize."""

    def __init__(self, ranks: _Ranks) -> None:
        self.ranks = ranks
        self._next = iter(range(1, 1 << 30))
        self._lock = threading.Lock()
        fake = self

        class SharedBuffer:
            def __init__(self, nbytes: int) -> None:
                with fake._lock:
                    self.id = next(fake._next)
                self.ptr, self.bytes, self.opened = self.id << 20, nbytes, []
                fake.ranks.note(self.id, "malloc", nbytes)

            def handle(self) -> bytes:
                return struct.pack("<Q", self.id) + bytes(56)  # IPC_HANDLE_BYTES

            def open(self, handles: list[bytes], rank: int) -> list[int]:
                assert len(handles[rank]) == 64 and handles[rank] == self.handle()
                ids = [struct.unpack_from("<Q", h)[0] for h in handles]
                self.opened = [i for r, i in enumerate(ids) if r != rank]
                fake.ranks.note(self.id, "open", tuple(self.opened))
                return [i << 20 for i in ids]

            def close_peers(self) -> None:
                fake.ranks.note(self.id, "close_peers", tuple(self.opened))
                self.opened = []

            def close(self) -> None:
                self.close_peers()
                fake.ranks.note(self.id, "free")

        self.SharedBuffer = SharedBuffer
        self.calls: list[tuple] = []

    def memset(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        self.calls.append(("memset", ptr, value, nbytes, stream))

    def synchronize(self, stream: int) -> None:
        self.calls.append(("synchronize", stream))


def test_ipc_buffers_grow_collectively_and_never_free_what_a_peer_maps():
    from moe_comm.backends.cuda.ipc_buffers import IpcBuffers
    ranks = _Ranks(3)
    cuda = _FakeCuda(ranks)

    def rank(transport):
        bufs = IpcBuffers(transport, "normal-mode", cuda)
        seen = [bufs.pids, bufs.ensure(100), bufs.nbytes, bufs.ensure(64), list(bufs.bases), bufs.ensure(300),
                bufs.nbytes, list(bufs.bases)]
        bufs.close()
        return seen + [bufs.bases, bufs.nbytes]

    got = ranks.run(rank)
    first, second = [g[4] for g in got], [g[7] for g in got]
    for r, (pids, grew, n, again, _, regrew, n2, _, after, n_after) in enumerate(got):
        assert pids == [os.getpid()] * 3 and (grew, n, again, regrew, n2) == (True, 100, False, True, 300)
        assert (after, n_after) == ([], 0)
    assert first[0] == first[1] == first[2] and second[0] == second[1] == second[2]  # every rank's, in rank order
    assert len(set(first[0]) | set(second[0])) == 6  # three allocations per generation
    log = ranks.log
    # every buffer a rank allocated is opened by exactly its peers, and freed only after each of them unmapped it
    for gen in (first[0], second[0]):
        for base in gen:
            buf_id = base >> 20
            freed = log.index((buf_id, "free"))
            unmapped = [i for i, e in enumerate(log) if e[1] == "close_peers" and buf_id in e[2]]
            assert len(unmapped) == 2 and max(unmapped) < freed, (buf_id, log)
    assert sum(1 for e in log if e[1] == "barrier") == 3 * 3  # after each mapping, and at close


def test_ipc_buffers_zero_and_close_alone():
    from moe_comm.backends.cuda.ipc_buffers import IpcBuffers
    ranks = _Ranks(1)
    cuda = _FakeCuda(ranks)

    def rank(transport):
        bufs = IpcBuffers(transport, "low-latency", cuda)
        bufs.zero_own()  # nothing mapped yet: nothing to zero
        bufs.ensure(4096)
        bufs.zero_own(stream=7)
        bufs.close(collective=False)
        bufs.close()  # idempotent
        return bufs.nbytes

    assert ranks.run(rank) == [0]
    assert cuda.calls == [("memset", 1 << 20, 0, 4096, 7), ("synchronize", 7)]
    assert [e[1] for e in ranks.log] == ["gather", "malloc", "gather", "open", "barrier", "close_peers",
                                         "close_peers", "free"]  # close(collective=False): no barrier


# ---------------------------------------------------------------------------------------- streams
class _FakeComm:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.capture = False

    def capturing(self) -> bool:
        return self.capture

    def enter(self) -> int:
        self.events.append("enter")
        return 1234

    def leave(self) -> None:
        self.events.append("leave")

    def synchronize(self) -> None:
        self.events.append("synchronize")


def test_device_stream_runs_launches_at_once_and_raises_each_record_once():
    from moe_comm.backends.cuda.device_stream import DeviceStream
    raised: list[tuple[str, Any]] = []

    def check(op, record):
        if record is not None:
            raised.append((op, record))
            raise RuntimeError(f"{op}: {record}")

    comm = _FakeComm()
    stream = DeviceStream(check, comm)
    ran: list[str] = []
    job = stream.submit("dispatch", lambda: ran.append("a"))
    assert ran == ["a"]  # inline
    job.wait()
    stream.run("dispatch", lambda: None)
    failed = stream.submit("combine", lambda: "record")
    with pytest.raises(RuntimeError, match="combine: record"):
        stream.submit("dispatch", lambda: ran.append("b"))  # the unseen record first, in stream order
    assert ran == ["a"]
    failed.wait()  # seen: not again
    stream.submit("dispatch", lambda: "late")
    with pytest.raises(RuntimeError, match="dispatch: late"):
        stream.synchronize()
    assert comm.events == ["synchronize"]
    stream.synchronize()
    with pytest.raises(ValueError, match="no launch"):
        stream.submit("dispatch", lambda: (_ for _ in ()).throw(ValueError("no launch")))
    assert raised == [("combine", "record"), ("dispatch", "late")]


class _FakeKernel:
    def __init__(self, name: str, args: tuple, log: list) -> None:
        self.name, self.args, self.log = name, args, log
        self.record = None

    def __getattr__(self, method: str):
        def launch(*args, stream):
            self.log.append((self.name, method, args, stream))
            return ("result", method) if self.name == "Normal" else None
        return launch

    def check(self):
        self.log.append((self.name, "check"))
        return self.record

    def clear(self):
        self.log.append((self.name, "clear"))
        self.record = None


class _FakeModule:
    DType = WaitKind = object()

    class WaitOutcome:
        MISMATCH = 4
    normal_bytes = dispatch_slot_bytes = low_latency_bytes = internode_bytes = staticmethod(lambda *a: 0)
    low_latency_header_bytes = low_latency_control_bytes = staticmethod(lambda *a: 0)
    MAX_NODES = 64

    def __init__(self) -> None:
        self.log: list = []
        self.built: list = []

    def Normal(self, *args):  # noqa: N802
        self.built.append(("Normal", args))
        return _FakeKernel("Normal", args, self.log)

    def LowLatency(self, *args):  # noqa: N802
        self.built.append(("LowLatency", args))
        return _FakeKernel("LowLatency", args, self.log)

    def Internode(self, *args):  # noqa: N802
        self.built.append(("Internode", args))
        return _FakeKernel("Normal", args, self.log)


def test_device_kernels_launch_on_the_comm_stream_with_the_host_builds_contract():
    from moe_comm.backends.cuda.device_kernels import DeviceKernels
    module, comm = _FakeModule(), _FakeComm()
    guarded: list[str] = []

    class Guard:
        def __enter__(self):
            guarded.append("in")

        def __exit__(self, *exc):
            guarded.append("out")

    kernels = DeviceKernels(module, comm, Guard, keep=2)
    normal = kernels.Normal([10, 20], [1, 2], 0, 5.0, 4, 6, 2, 8, 64)
    assert normal.notify(1, 2, 3) == ("result", "notify") and normal.prologue(7) == ("result", "prologue")
    assert module.log == [("Normal", "notify", (1, 2, 3), 1234), ("Normal", "prologue", (7,), 1234)]
    assert comm.events == ["enter", "enter"] and guarded == ["in", "out"]
    assert kernels.Normal([10, 20], [1, 2], 0, 5.0, 4, 6, 2, 8, 64) is normal  # the same geometry and buffers
    assert kernels.Normal([10, 30], [1, 2], 0, 5.0, 4, 6, 2, 8, 64) is not normal  # new buffers: a new object
    module.log.clear()
    comm.events.clear()
    ll = kernels.LowLatency([10, 20], [1, 2], 1, 5.0, 2, 32, 512)
    assert ll.dispatch(False, 0, 99) is None  # a send: enqueued, the caller's stream after it
    assert comm.events == ["enter", "leave"] and module.log == [("LowLatency", "dispatch", (False, 0, 99), 1234)]
    module.log.clear()
    comm.events.clear()
    ll.kernel.record = (1, 2, 0, 1, 0, 0, 1)
    assert ll.combine(True, 1, 99) == (1, 2, 0, 1, 0, 0, 1)  # a receive: waited for, then its record
    assert comm.events == ["enter", "synchronize"]
    assert module.log == [("LowLatency", "combine", (True, 1, 99), 1234), ("LowLatency", "check")]
    module.log.clear()
    ll.kernel.record = mismatch = (4, 9, 0, 1, 3, 128, 256)  # the kernels' verdict against one call
    assert ll.dispatch(True, 1, 99) == mismatch and ll.kernel.record is None  # raised by the caller, then cleared
    assert module.log[1:] == [("LowLatency", "check"), ("LowLatency", "clear")]
    module.log.clear()
    comm.events.clear()
    comm.capture = True  # under CUDA graph capture a receive only enqueues: no host wait, no record read
    assert ll.combine(True, 1, 99) is None
    assert comm.events == ["enter", "leave"] and module.log == [("LowLatency", "combine", (True, 1, 99), 1234)]
    comm.capture = False
    module.log.clear()
    comm.events.clear()
    assert ll.reject(3, 99, (5, 6)) is None  # a host rejection's header: enqueued like a send
    assert comm.events == ["enter", "leave"] and module.log == [("LowLatency", "reject", (3, 99, (5, 6)), 1234)]
    # at most `keep` objects are kept: the oldest goes
    assert kernels.Normal([10, 20], [1, 2], 0, 5.0, 4, 6, 2, 8, 64) is not normal
    assert [b[0] for b in module.built] == ["Normal", "Normal", "LowLatency", "Normal"]
    # NVSHMEM's peers are (base, mappings, PEs): a key of lists inside a tuple, passed through as given
    rail = (7, [7, 0], [0, 2])
    internode = kernels.Internode([10, 11], rail, [1, 2, 3, 4], 0, 5.0, 2, 3, 4, 1, 8, 64, 4, 68)
    assert kernels.Internode([10, 11], (7, [7, 0], [0, 2]), [1, 2, 3, 4], 0, 5.0, 2, 3, 4, 1, 8, 64, 4, 68) is internode
    assert module.built[-1] == ("Internode", ([10, 11], rail, [1, 2, 3, 4], 0, 5.0, 2, 3, 4, 1, 8, 64, 4, 68))
    kernels.LowLatency(rail, [1, 2], 0, 5.0, 2, 32, 512, 2)
    assert module.built[-1] == ("LowLatency", (rail, [1, 2], 0, 5.0, 2, 32, 512, 2))


class _FakeMapped:
    """moe_comm._cuda.MappedBuffer on ordinary host memory (the device address equal to the host's)."""
    made: list["_FakeMapped"] = []

    def __init__(self, nbytes: int, shift: int = 0) -> None:
        self.memory = ctypes.create_string_buffer(nbytes)
        self.bytes, self.host_ptr = nbytes, ctypes.addressof(self.memory)
        self.ptr = self.host_ptr + shift
        self.closed = False
        _FakeMapped.made.append(self)

    def close(self) -> None:
        self.closed = True


def test_mapped_outputs_view_one_mapped_buffer_at_aligned_offsets():
    from moe_comm.backends.cuda.device_kernels import MappedOutputs

    class Module:
        MappedBuffer = _FakeMapped

    _FakeMapped.made.clear()
    outputs = MappedOutputs(Module)
    specs = [((3, 3), torch.int32), ((3,), torch.int64), ((2, 5), torch.int64)]
    a = outputs(specs)
    assert [(t.shape, t.dtype, t.device.type) for t in a] == [(torch.Size(s), d, "cpu") for s, d in specs]
    base = _FakeMapped.made[0].host_ptr
    assert [t.data_ptr() - base for t in a] == [0, 64, 128]  # the kernel's addresses: into the mapped bytes
    ctypes.memmove(a[1].data_ptr(), struct.pack("<3q", 7, -1, 1 << 40), 24)  # "the kernel writes"
    assert a[1].tolist() == [7, -1, 1 << 40]
    assert outputs(specs)[1].data_ptr() == a[1].data_ptr() and len(_FakeMapped.made) == 1  # reused
    big = outputs([((4096,), torch.int64)])[0]
    assert len(_FakeMapped.made) == 2 and big.data_ptr() == _FakeMapped.made[1].host_ptr
    assert a[1].tolist() == [7, -1, 1 << 40]  # the old memory lives on while a view of it does

    class Shifted:
        @staticmethod
        def MappedBuffer(nbytes):  # noqa: N802
            return _FakeMapped(nbytes, shift=4096)

    with pytest.raises(RuntimeError, match="no unified addressing"):
        MappedOutputs(Shifted)([((1,), torch.int64)])
    assert _FakeMapped.made[-1].closed


# ---------------------------------------------------------------------------------------- on a GPU
CONFIGS = {"default": dict(num_sms=20), "tiny_rings": dict(num_sms=4, num_max_nvl_chunked_send_tokens=3,
                                                           num_max_nvl_chunked_recv_tokens=4)}


def _cuda_equals_portable(group, seed: int, config: dict[str, int]) -> list[bool]:
    """Per output of ``_calls``: equal (bitwise) on the cuda backend (GPU 0) and the portable one (CPU)."""
    torch.cuda.set_device(0)
    a = calls(group, "portable", "cpu", seed, config)
    b = calls(group, "cuda", "cuda", seed, config, comm_stream=torch.cuda.Stream)
    assert len(a) == len(b) > 50
    return [torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(a, b)]


# ---------------------------------------------------------------------------------------- the backend, emulated
class _HostBuffer:
    """moe_comm._cuda.SharedBuffer on a shared-memory segment of this host (the handle: its name)."""

    def __init__(self, nbytes: int) -> None:
        from moe_comm.transport.shm_segment import Segment, segment_name
        self._segment = Segment.create(segment_name(), _Size(nbytes))
        self.ptr, self.bytes, self._peers = self._segment.base, nbytes, []

    def handle(self) -> bytes:
        name = self._segment.name.encode()
        assert len(name) <= 64
        return name + bytes(64 - len(name))

    def open(self, handles: list[bytes], rank: int) -> list[int]:
        from moe_comm.transport.shm_segment import Segment
        bases = []
        for r, h in enumerate(handles):
            if r == rank:
                bases.append(self.ptr)
            elif not h:  # a rank of another node: not mapped (as moe_comm._cuda's SharedBuffer.open)
                bases.append(0)
            else:
                self._peers.append(Segment.open(h.rstrip(b"\0").decode(), _Size(self.bytes)))
                bases.append(self._peers[-1].base)
        return bases

    def close_peers(self) -> None:
        self._peers = []

    def close(self) -> None:
        self.close_peers()
        if self._segment is not None:
            self._segment.unlink()
            self._segment = None


class _Size:
    def __init__(self, nbytes: int) -> None:
        self.total_bytes = nbytes


class _HostLaunches:
    """A host-build Normal / LowLatency with the device build's signatures: a trailing ``stream``;
    low-latency launches return None and ``check()`` gives the first record since."""

    def __init__(self, kernel: Any, low_latency: bool) -> None:
        self._kernel, self._low_latency, self._record = kernel, low_latency, None

    @property
    def header_offsets(self) -> list[int]:
        return self._kernel.header_offsets

    def __getattr__(self, method: str):
        launch = getattr(self._kernel, method)

        def on_stream(*args, stream):
            assert isinstance(stream, int)
            record = launch(*args)
            if not self._low_latency:
                return record
            self._record = self._record or record
            return None
        return on_stream

    def check(self):
        return self._record

    def clear(self):
        self._record = None


class _HostAsDevice:
    """moe_comm._cuda's interface over moe_comm._cuda_host, on CPU memory: the cuda backend's Python
    runs end to end here on the host build's kernels."""

    def __init__(self) -> None:
        from moe_comm import _cuda_host
        self.host = _cuda_host
        self.DType, self.WaitOutcome, self.WaitKind = _cuda_host.DType, _cuda_host.WaitOutcome, _cuda_host.WaitKind
        self.normal_bytes, self.low_latency_bytes = _cuda_host.normal_bytes, _cuda_host.low_latency_bytes
        self.low_latency_header_bytes = _cuda_host.low_latency_header_bytes
        self.low_latency_control_bytes = _cuda_host.low_latency_control_bytes
        self.dispatch_slot_bytes, self.internode_bytes = _cuda_host.dispatch_slot_bytes, _cuda_host.internode_bytes
        self.MAX_NODES = _cuda_host.MAX_NODES
        self.SharedBuffer, self.MappedBuffer = _HostBuffer, _FakeMapped
        self.memsets = 0

    def Normal(self, *args):  # noqa: N802
        return _HostLaunches(self.host.Normal(*args), False)

    def Internode(self, *args):  # noqa: N802
        return _HostLaunches(self.host.Internode(*args), False)

    def LowLatency(self, bases, *args):  # noqa: N802
        assert args[-1] == 0, "over CUDA IPC every rank is reached directly (node_ranks 0)"
        return _HostLaunches(self.host.LowLatency(bases, *args), True)

    def PreparedLowLatency(self, kernel, *args, extra):  # noqa: N802
        device, stream, mismatch = extra
        assert device == torch.device("cpu") and stream == 0 and mismatch == int(self.WaitOutcome.MISMATCH), extra
        return self.host.PreparedLowLatency(kernel._kernel, *args)

    def layout(self, *args):
        *args, stream = args
        self.host.layout(*args)

    def memset(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        ctypes.memset(ptr, value, nbytes)
        self.memsets += 1

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def synchronize(self, stream: int) -> None:
        pass


class _HostAsNvshmem(_HostAsDevice):
    """moe_comm._cuda_nvshmem's interface over moe_comm._cuda_host: a world of the ranks of this host,
    "symmetric" buffers as one shared-memory segment per rank and allocation (named from the unique id,
    the PE and an allocation count, so every PE finds its peers'), every peer "NVLink-mapped". The
    backend's NVSHMEM path (join_world, SymmetricBuffers, the rail and peers tuples, the node-only IPC
    buffers) runs end to end on the host build's kernels; the kernels' NVSHMEM link itself cannot."""

    UNIQUE_ID_BYTES = 16

    def __init__(self) -> None:
        super().__init__()
        self.world: tuple = ()
        self._allocs: dict[int, tuple] = {}
        self._count = 0

    def initialized(self) -> bool:
        return bool(self.world)

    def unique_id(self) -> bytes:
        return os.urandom(self.UNIQUE_ID_BYTES)

    def init(self, uid: bytes, rank: int, num_ranks: int) -> None:
        self.world = (uid.hex(), rank, num_ranks)

    def my_pe(self) -> int:
        return self.world[1]

    def n_pes(self) -> int:
        return self.world[2]

    def _name(self, pe: int, n: int) -> str:
        return f"moe_comm_fake_nvshmem_{self.world[0]}_{n}_{pe}"

    def alloc(self, nbytes: int) -> int:
        import time

        from moe_comm.transport.shm_segment import Segment
        self._count += 1
        uid, me, size = self.world
        mine = Segment.create(self._name(me, self._count), _Size(nbytes))
        segments, deadline = {}, time.monotonic() + 60
        for pe in range(size):  # nvshmem_malloc is collective: every PE's buffer exists once it returns
            while pe != me and not os.path.exists(f"/dev/shm/{self._name(pe, self._count)}"):
                assert time.monotonic() < deadline, f"PE {pe} never allocated"
                time.sleep(0.01)
            segments[pe] = mine if pe == me else Segment.open(self._name(pe, self._count), _Size(nbytes))
        self._allocs[mine.base] = (mine, segments)
        return mine.base

    def peer_ptr(self, base: int, pe: int) -> int:
        return self._allocs[base][1][pe].base

    def free(self, base: int) -> None:
        mine, _ = self._allocs.pop(base)
        mine.unlink()

    def Internode(self, nvl, rail, *args):  # noqa: N802
        base, mapped, pes = rail
        assert mapped[pes.index(self.world[1])] == base, "the rail holds this rank's own buffer"
        return _HostLaunches(self.host.Internode(nvl, mapped, *args), False)

    def LowLatency(self, peers, *args):  # noqa: N802
        base, mapped, pes = peers
        assert pes == list(range(len(pes))) and mapped[self.world[1]] == base
        return _HostLaunches(self.host.LowLatency(mapped, *args), True)


class _NoStream:
    """CommStream's interface with no stream (get_comm_stream returns the object itself)."""
    handle = 0
    device = torch.device("cpu")

    @property
    def stream(self) -> "_NoStream":
        return self

    def enter(self) -> int:
        return 0

    def leave(self) -> None:
        pass

    def capturing(self) -> bool:
        return False

    def synchronize(self) -> None:
        pass


def _emulated_backend() -> type:
    from moe_comm.backends.cuda.device_backend import CudaBackend

    class EmulatedCudaBackend(CudaBackend):
        kernels_module = _HostAsDevice()

        @staticmethod
        def _device() -> torch.device:
            return torch.device("cpu")

        def _guard(self):
            import contextlib
            return contextlib.nullcontext()

        def _current_stream(self) -> int:
            return 0

        def _comm_stream(self):
            return _NoStream()

    return EmulatedCudaBackend


def _across_hosts_backend() -> type:
    """The emulated backend as if every node were another host: NVSHMEM (``_HostAsNvshmem``) carries what
    crosses between nodes, IPC buffers map only a node's ranks."""
    base = _emulated_backend()
    nvshmem = _HostAsNvshmem()

    class AcrossHosts(base):
        def _across_hosts(self) -> bool:
            assert self.topology.internode, "run with MOE_COMM_RANKS_PER_NODE splitting the ranks into nodes"
            return True

        @staticmethod
        def _nvshmem():
            return nvshmem

    return AcrossHosts


@contextlib.contextmanager
def _registered_as_cuda(emulated: type, ranks_per_node: Optional[int] = None):
    """``emulated`` registered as the "cuda" backend in this rank (and the default one), ``ranks_per_node``
    splitting the group into nodes (MOE_COMM_RANKS_PER_NODE), for the duration."""
    import moe_comm.backends as registry
    if ranks_per_node is not None:
        os.environ["MOE_COMM_RANKS_PER_NODE"] = str(ranks_per_node)
    built, reason, default = registry._built, registry._cuda_reason, os.environ.get("MOE_COMM_BACKEND")
    registry._built = lambda: {**built(), "cuda": emulated}
    registry._cuda_reason = lambda: None
    os.environ["MOE_COMM_BACKEND"] = "cuda"
    try:
        yield
    finally:
        registry._built, registry._cuda_reason = built, reason
        os.environ.pop("MOE_COMM_RANKS_PER_NODE", None)
        if default is None:
            os.environ.pop("MOE_COMM_BACKEND")
        else:
            os.environ["MOE_COMM_BACKEND"] = default


def _emulated_equals_portable(group, seed: int, config: dict[str, int], ranks_per_node: Optional[int] = None,
                              across_hosts: bool = False) -> tuple[list[bool], int]:
    """``_calls`` on the cuda backend's class over ``_HostAsDevice`` (registered as "cuda" in this rank)
    and on the portable backend, both on the CPU; ``ranks_per_node`` splits the group into nodes
    (MOE_COMM_RANKS_PER_NODE), ``across_hosts`` takes the NVSHMEM path between them."""
    emulated = _across_hosts_backend() if across_hosts else _emulated_backend()
    with _registered_as_cuda(emulated, ranks_per_node):
        a = calls(group, "portable", "cpu", seed, config)
        b = calls(group, "cuda", "cpu", seed, config, comm_stream=_NoStream)
    assert len(a) == len(b) > 50
    return [torch.equal(u, v) if isinstance(u, torch.Tensor) else u == v for u, v in zip(a, b)], \
        emulated.kernels_module.memsets


def _emulated_late_rank(group, late_s: float, use_fp8: bool) -> dict:
    """``ll_late_cases.late_rank`` on the cuda backend's class over ``_HostAsDevice``."""
    from helpers.ll_late_cases import late_rank
    with _registered_as_cuda(_emulated_backend()):
        return late_rank(group, late_s, use_fp8)


@pytest.mark.skipif(not CUDA_BUILT, reason="moe_comm._cuda is not built (device_backend.py imports it)")
@pytest.mark.parametrize("world_size", [1, 3])
def test_the_backend_runs_end_to_end_on_the_host_builds_kernels(world_size):
    """CudaBackend, IpcBuffers, DeviceKernels, DeviceStream and MappedOutputs driving the host build behind
    moe_comm._cuda's interface: the same bits as the portable backend (what differs on a GPU: the
    tensors' device, the streams, CUDA IPC)."""
    from helpers.transports import local_world
    with local_world(world_size, "shm", timeout_s=600, threads_per_rank=1) as world:
        for rank, (equal, memsets) in enumerate(world.run(_emulated_equals_portable, 5, CONFIGS["tiny_rings"])):
            assert all(equal), (rank, [i for i, e in enumerate(equal) if not e])
            # the calls agreed in the data path: clean_low_latency_buffer zeroes nothing (every signal
            # carries its call), where a handshake-first buffer zeroes its own
            assert memsets == 0, memsets


def _emulated_prepared(group) -> dict:
    """``prepared_cases`` on the cuda backend's class over ``_HostAsDevice``: its prepared low-latency calls
    (``DeviceKernels.PreparedLowLatency``) against its checked path, and their Python calls."""
    from helpers.prepared_cases import prepared_equals_checked, python_calls
    with _registered_as_cuda(_emulated_backend()):
        return {"equal": prepared_equals_checked(group, 24, False), "calls": python_calls(group)}


@pytest.mark.skipif(not CUDA_BUILT, reason="moe_comm._cuda is not built (device_backend.py imports it)")
def test_the_backends_prepared_calls_are_the_host_builds_python():
    """The cuda backend's prepared low-latency calls run the Python of cuda_host's (backends/cuda/prepared.py)
    through DeviceKernels: bitwise equal to its checked path, a prepared call for every signature, and as few
    Python calls per op half (what a GPU decode step pays on the host without a CUDA graph)."""
    from helpers.prepared_cases import MAX_PYTHON_CALLS
    from helpers.transports import local_world
    with local_world(2, "shm", timeout_s=600, threads_per_rank=1) as world:
        for result in world.run(_emulated_prepared):
            equal = result["equal"]
            assert equal["differ"] == 0 and equal["prepared"] == equal["signatures"], equal
            assert max(result["calls"].values()) <= MAX_PYTHON_CALLS, result["calls"]


INTERNODE_CONFIG = dict(num_sms=4, num_max_nvl_chunked_send_tokens=2, num_max_nvl_chunked_recv_tokens=4,
                        num_max_rdma_chunked_send_tokens=1, num_max_rdma_chunked_recv_tokens=2)


@pytest.mark.skipif(not CUDA_BUILT, reason="moe_comm._cuda is not built (device_backend.py imports it)")
@pytest.mark.parametrize("across_hosts", [False, True])
def test_the_backend_runs_across_nodes_on_the_host_builds_kernels(across_hosts):
    """The same end to end across 2 nodes of 2 ranks: on one host (MOE_COMM_RANKS_PER_NODE; every buffer over
    IPC), and as if each node were a host (NVSHMEM's world joined by unique id, symmetric RDMA and
    low-latency buffers, IPC buffers of the node's ranks only): the same bits as the portable backend."""
    from helpers.transports import local_world
    with local_world(4, "shm", timeout_s=600, threads_per_rank=1) as world:
        results = world.run(_emulated_equals_portable, 7, INTERNODE_CONFIG, 2, across_hosts)
    for rank, (equal, memsets) in enumerate(results):
        assert all(equal), (rank, [i for i, e in enumerate(equal) if not e])
        assert memsets == 0, memsets  # agreed in the data path, as above


@pytest.mark.skipif(not CUDA_BUILT, reason="moe_comm._cuda is not built (device_backend.py imports it)")
def test_the_device_path_agrees_in_the_data_path():
    """The cuda backend's Python over the host build's kernels, 3 ranks, the last one late: the send
    halves return at once (headers posted by the launches, no handshake), the hooks give the blocking
    form's outputs, another hidden size on the late rank fails every rank alike (the verdict read back
    from the device buffer), and the next call works."""
    from helpers.ll_late_cases import send_halves_that_waited
    from helpers.transports import local_world
    late_s = 1.0
    with local_world(3, "shm", timeout_s=120, threads_per_rank=1) as world:
        results = world.run(_emulated_late_rank, late_s, True)
    for r in results:
        assert r["equal"] and r["next_call_equal"], r
    assert not send_halves_that_waited(results), results
    messages = {r["mismatch"] for r in results}
    assert len(messages) == 1 and messages.pop().startswith(
        "CrossRankMismatchError: low_latency_dispatch: ranks disagree on hidden: rank 0: 256, rank 1: 256, "
        "rank 2: 128"), results


def _refuses_tensors_off_the_gpu(group) -> tuple[str, str, bool]:
    """A CPU x on one rank: that rank's ValueError, the others' CrossRankMismatchError; the buffer goes on."""
    torch.cuda.set_device(0)
    buf = moe_comm.Buffer(group, backend="cuda", explicitly_destroy=True, timeout_s=240)
    T, H, E = 8, 128, 2 * group.size()
    topk = torch.zeros(T, 1, dtype=torch.int64, device="cuda")
    x = torch.zeros(T, H, dtype=torch.bfloat16, device="cpu" if group.rank() == 0 else "cuda")
    try:
        buf.dispatch(x, topk_idx=topk.to(x.device), topk_weights=torch.ones(T, 1, device=x.device), num_experts=E)
        kind, message = "none", ""
    except Exception as exc:  # the test asserts on the type and the words
        kind, message = type(exc).__name__, str(exc)
    x = x.cuda()
    recv, *_ = buf.dispatch(x, topk_idx=topk, topk_weights=torch.ones(T, 1, device="cuda"), num_experts=E)
    buf.destroy()
    return kind, message, recv.device.type == "cuda"


@needs_gpu
@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("world_size", [1, 2])
def test_same_bits_as_portable_on_cpu(world_size, config):
    from moe_comm.launch import LocalWorld
    with LocalWorld(world_size, backend="gloo", timeout_s=900, threads_per_rank=1) as world:
        for rank, equal in enumerate(world.run(_cuda_equals_portable, 3, CONFIGS[config])):
            assert all(equal), (rank, [i for i, e in enumerate(equal) if not e])


@needs_gpu
def test_tensors_off_the_gpu_are_refused_on_every_rank():
    from moe_comm.launch import LocalWorld
    with LocalWorld(2, backend="gloo", timeout_s=600, threads_per_rank=1) as world:
        (kind0, message0, ok0), (kind1, message1, ok1) = world.run(_refuses_tensors_off_the_gpu)
    assert kind0 == "ValueError" and "dispatch: x must be on cuda:0" in message0, message0
    assert kind1 == "CrossRankMismatchError" and "rank 0 rejected its arguments" in message1, message1
    assert ok0 and ok1


@needs_gpu
def test_a_kernel_wait_ends_at_its_deadline_naming_the_peer():
    """Rank 0's launch alone on the GPU: its barrier wait for rank 1 ends at the deadline."""
    import time

    from moe_comm import _cuda
    from moe_comm.backends.cuda.kernel_errors import raise_for
    from moe_comm.core.errors import CommTimeoutError
    torch.cuda.set_device(0)
    nbytes = _cuda.normal_bytes(2, 1, 1, 4, 64)
    bufs = [_cuda.SharedBuffer(nbytes), _cuda.SharedBuffer(nbytes)]
    kernel = _cuda.Normal([b.ptr for b in bufs], [os.getpid()] * 2, 0, 0.5, 1, 1, 1, 4, 64)
    begin = time.monotonic()
    record = kernel.prologue(1)
    assert 0.4 <= time.monotonic() - begin < 30, time.monotonic() - begin
    code, kind, rank, peer, _, observed, expected = record
    assert (_cuda.WaitOutcome(code), _cuda.WaitKind(kind), rank, peer) == \
        (_cuda.WaitOutcome.TIMEOUT, _cuda.WaitKind.BARRIER, 0, 1), record
    with pytest.raises(CommTimeoutError, match=r"ranks not heard from: \[1\]; the kernel waited for rank 1"):
        raise_for(_cuda, "combine", 0.5, [os.getpid()] * 2, record)
    for b in bufs:
        b.close()

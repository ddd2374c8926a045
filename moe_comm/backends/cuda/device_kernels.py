"""The device build of the CUDA kernels (``moe_comm._cuda``) behind the host build's contract, so that
``KernelNormalMode`` and ``KernelLowLatencyMode`` drive both builds with the same code.

``moe_comm._cuda`` mirrors ``moe_comm._cuda_host`` (classes ``Normal`` / ``LowLatency``, the same
methods and argument order) plus a trailing ``stream`` on every launch. Its normal-mode launches
synchronise their stream and return None or the error record, as the host build's do. Its low-latency
launches only enqueue; here a send half returns None at once (the caller's current stream then waits
for the comm stream, so it may reuse the send's inputs), and a receive half enqueues, waits for the
comm stream on the host and returns ``LowLatency.check()``: the record the host build would have
returned. Every launch first makes the comm stream wait for the caller's current stream (the work
that produced its inputs).

Compiled and tested here with fakes and on the host build's kernels only: nothing of this has run on
a GPU.
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import math
from typing import Any, Callable, ContextManager, Optional, Sequence

import torch

__all__ = ["CommStream", "DeviceKernels", "MappedOutputs"]

Guard = Callable[[], ContextManager[Any]]


class CommStream:
    """A buffer's communication stream on its GPU (DeepEP's comm stream), a ``torch.cuda.Stream``."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    @property
    def handle(self) -> int:
        """The ``cudaStream_t`` as an int, for launches."""
        return self.stream.cuda_stream

    def enter(self) -> int:
        """Orders the comm stream after the work queued so far on the caller's current stream; returns
        the handle to launch on."""
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return self.stream.cuda_stream

    def leave(self) -> None:
        """Orders the caller's current stream after the work queued so far on the comm stream."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def capturing(self) -> bool:
        """Whether the caller's current stream is capturing a CUDA graph (no host wait may happen)."""
        return torch.cuda.is_current_stream_capturing()

    def synchronize(self) -> None:
        """Waits on the host for everything queued on the comm stream."""
        self.stream.synchronize()


class _NormalLaunches:
    """One ``moe_comm._cuda.Normal``: each launch on the comm stream, synchronous, returning None or the record."""

    def __init__(self, kernel: Any, comm: Any) -> None:
        self.kernel, self.comm = kernel, comm

    def notify(self, *args: Any) -> Any:
        return self.kernel.notify(*args, stream=self.comm.enter())

    def prologue(self, epoch: int) -> Any:
        return self.kernel.prologue(epoch, stream=self.comm.enter())

    def dispatch(self, *args: Any) -> Any:
        return self.kernel.dispatch(*args, stream=self.comm.enter())

    def combine(self, *args: Any) -> Any:
        return self.kernel.combine(*args, stream=self.comm.enter())


class _LowLatencyLaunches:
    """One ``moe_comm._cuda.LowLatency``: sends enqueue and return None; receives enqueue, wait on the
    host and return ``check()`` (None or the first error record of this object's launches; a MISMATCH
    record, the kernels' verdict against one call, is then cleared)."""

    def __init__(self, kernel: Any, comm: Any, mismatch: int) -> None:
        self.kernel, self.comm, self._mismatch = kernel, comm, mismatch

    def _finish(self, receive: bool) -> Any:
        # While a CUDA graph is captured a receive only enqueues too: no host wait, no record read (a
        # replay's failure stays in the record, for the next receive that runs eagerly to raise).
        if not receive or self.comm.capturing():
            self.comm.leave()
            return None
        self.comm.synchronize()
        record = self.kernel.check()
        if record is not None and record[0] == self._mismatch:
            # a verdict against the call (its headers differ), which the caller raises: unlike a failed
            # wait it leaves the buffer usable, so the record must not stop the launches after it (the
            # host build's records are per launch). Nothing is in flight: the stream was just waited for.
            self.kernel.clear()
        return record

    def dispatch(self, receive: bool, *args: Any) -> Any:
        self.kernel.dispatch(receive, *args, stream=self.comm.enter())
        return self._finish(receive)

    def combine(self, receive: bool, *args: Any) -> Any:
        self.kernel.combine(receive, *args, stream=self.comm.enter())
        return self._finish(receive)

    def reject(self, call: int, skip: Any, post: Any) -> Any:
        """A call rejected on the host: its header to every rank, enqueued as a send (None at once)."""
        self.kernel.reject(call, skip, post, stream=self.comm.enter())
        return self._finish(False)

    @property
    def header_offsets(self) -> list[int]:
        return self.kernel.header_offsets


class DeviceKernels:
    """``moe_comm._cuda`` (``module``) with ``moe_comm._cuda_host``'s interface, launching on ``comm``
    (a ``CommStream``, or anything with its ``enter``/``leave``/``synchronize``).

    ``Normal(...)`` and ``LowLatency(...)`` take the host build's arguments. Their objects (a peer
    table and an error record in device and mapped memory each) are built under ``guard()`` (the
    buffer's device made current) and kept for reuse, keyed by every argument: a call of the same
    geometry on the same buffers launches through the same object, and an object in use is never
    freed under a launch. At most ``keep`` objects are kept.
    """

    def __init__(self, module: Any, comm: Any, guard: Guard = contextlib.nullcontext, keep: int = 16) -> None:
        self.module, self.comm, self._guard, self._keep = module, comm, guard, keep
        self.DType, self.WaitOutcome, self.WaitKind = module.DType, module.WaitOutcome, module.WaitKind
        self.normal_bytes = module.normal_bytes
        self.dispatch_slot_bytes = module.dispatch_slot_bytes
        self.low_latency_bytes = module.low_latency_bytes
        self.low_latency_header_bytes = module.low_latency_header_bytes
        self.low_latency_control_bytes = module.low_latency_control_bytes
        self.internode_bytes = module.internode_bytes
        self.MAX_NODES = module.MAX_NODES
        self._objects: collections.OrderedDict[tuple, Any] = collections.OrderedDict()

    def _object(self, key: tuple, make: Callable[[], Any]) -> Any:
        found = self._objects.get(key)
        if found is None:
            with self._guard():
                found = make()
            self._objects[key] = found
            while len(self._objects) > self._keep:
                self._objects.popitem(last=False)
        else:
            self._objects.move_to_end(key)
        return found

    def Normal(self, bases: Sequence[int], pids: Sequence[int], rank: int, timeout_s: float, C: int, chunk: int,
               L: int, slots: int, slot_bytes: int) -> _NormalLaunches:  # noqa: N802 (the host build's name)
        key = ("normal", tuple(bases), tuple(pids), rank, timeout_s, C, chunk, L, slots, slot_bytes)
        return self._object(key, lambda: _NormalLaunches(
            self.module.Normal(list(bases), list(pids), rank, timeout_s, C, chunk, L, slots, slot_bytes), self.comm))

    def Internode(self, nvl: Sequence[int], rail: Any, pids: Sequence[int], rank: int, timeout_s: float,
                  *geometry: int) -> _NormalLaunches:  # noqa: N802 (the host build's name)
        """``rail``: the RDMA buffers' ``peers(...)`` (addresses over IPC; (base, mappings, PEs) over NVSHMEM);
        ``geometry``: C, nvl_chunk, rdma_chunk, L, nvl_slots, nvl_slot_bytes, rdma_slots, rdma_slot_bytes."""
        key = ("internode", tuple(nvl), _frozen(rail), tuple(pids), rank, timeout_s, geometry)
        return self._object(key, lambda: _NormalLaunches(
            self.module.Internode(list(nvl), rail, list(pids), rank, timeout_s, *geometry), self.comm))

    def LowLatency(self, peers: Any, pids: Sequence[int], rank: int, timeout_s: float, L: int, M: int,
                   H: int, node_ranks: int = 0) -> _LowLatencyLaunches:  # noqa: N802 (the host build's name)
        """``peers``: the low-latency buffers' ``peers(...)`` (as ``Internode``'s rail)."""
        key = ("low_latency", _frozen(peers), tuple(pids), rank, timeout_s, L, M, H, node_ranks)
        return self._object(key, lambda: _LowLatencyLaunches(
            self.module.LowLatency(peers, list(pids), rank, timeout_s, L, M, H, node_ranks), self.comm,
            int(self.WaitOutcome.MISMATCH)))

    def PreparedLowLatency(self, kernel: _LowLatencyLaunches, *args: Any) -> Any:  # noqa: N802 (the host build's name)
        """The build's prepared low-latency call (``csrc/cuda/python/prepared_low_latency.h``) on ``kernel``'s launch
        object, with the host build's arguments: its launches go on the comm stream in the order
        ``_LowLatencyLaunches`` gives them, natively (one crossing per op half, as DeepEP's)."""
        with self._guard():
            return self.module.PreparedLowLatency(kernel.kernel, *args, extra=(
                self.comm.device, self.comm.handle, int(self.WaitOutcome.MISMATCH)))

    def forget(self) -> None:
        """Drops the kept objects (at destroy, after the last launch)."""
        self._objects.clear()


def _frozen(value: Any) -> Any:
    """``value`` with its lists and tuples made tuples, all the way down (a cache key)."""
    return tuple(_frozen(v) for v in value) if isinstance(value, (list, tuple)) else value


_ALIGN = 64  # bytes between the tensors of MappedOutputs (any dtype's alignment)


class MappedOutputs:
    """``KernelNormalMode``'s ``notify_outputs`` on the device: CPU tensors viewing pinned host memory
    mapped into the GPU (``module.MappedBuffer``), which the notify kernel writes through the device
    and the host reads the moment the (synchronous) launch has returned.

    The tensors of one call are valid until the next call (the memory is reused; it grows when a
    call needs more, and the old memory lives on while a view of it does). Needs unified
    addressing (the GPU sees the memory at the host's address), which every 64-bit CUDA platform has.
    """

    def __init__(self, module: Any) -> None:
        self.module = module
        self._bytes: Optional[torch.Tensor] = None

    def __call__(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        offsets, total = [], 0
        for shape, dtype in specs:
            total = -(-total // _ALIGN) * _ALIGN
            offsets.append(total)
            total += math.prod(shape) * dtype.itemsize
        if self._bytes is None or self._bytes.numel() < total:
            self._bytes = self._map(max(4096, -(-total // 4096) * 4096))
        return [self._bytes[at:at + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
                for at, (shape, dtype) in zip(offsets, specs)]

    def _map(self, nbytes: int) -> torch.Tensor:
        buffer = self.module.MappedBuffer(nbytes)
        if buffer.ptr != buffer.host_ptr:
            buffer.close()
            raise RuntimeError("moe_comm._cuda.MappedBuffer: the GPU maps pinned host memory at another address than "
                               "the host's (no unified addressing); the cuda backend needs a 64-bit CUDA platform")
        raw = (ctypes.c_uint8 * nbytes).from_address(buffer.host_ptr)
        raw.owner = buffer  # type: ignore[attr-defined]  # the memory lives as long as a view of it
        return torch.frombuffer(raw, dtype=torch.uint8)

    def close(self) -> None:
        """Lets the memory go (freed once no view of it remains)."""
        self._bytes = None

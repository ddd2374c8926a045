"""The part of a tile program that differs between TileLang's CPU and CUDA builds, and nothing else.

A program is written once against a ``Dialect`` and asks it for: the launch (``kernel``: CUDA binds
``threads`` threads per tile program, the CPU has none), tile storage (``tile``: shared memory on CUDA, a
plain buffer on the CPU; ``accumulator``: a register fragment on CUDA, a local buffer on the CPU), the loop
over a tile's elements (``parallel``: ``T.Parallel`` spreads it over the threads on CUDA; the CPU's
semantic check refuses ``T.Parallel`` over local buffers, and runs loops serially anyway), and how
narrow floats are held (``storage``/``load``/``store``: CUDA has the types; the C target has none, so the
CPU build keeps their bits in integers and converts in ``codec``).
"""
from __future__ import annotations

from dataclasses import dataclass

import tilelang.cpu.language as TC
import tilelang.language as TL

from . import codec

__all__ = ["Dialect", "CPU", "CUDA"]


@dataclass(frozen=True)
class Dialect:
    """``name`` is ``cpu`` (target ``c``) or ``cuda``; ``threads`` per tile program on CUDA."""

    name: str
    threads: int = 128

    @property
    def cpu(self) -> bool:
        return self.name == "cpu"

    @property
    def T(self):  # noqa: N802 - TileLang's own name for its language module
        return TC if self.cpu else TL

    def kernel(self, *grid):
        """The launch frame of a grid of tile programs."""
        return TC.Kernel(*grid) if self.cpu else TL.Kernel(*grid, threads=self.threads)

    def tile(self, shape, dtype: str):
        """A tile staged for ``T.gemm``: shared memory on CUDA."""
        return TC.alloc_buffer(shape, dtype, scope="shared") if self.cpu else TL.alloc_shared(shape, dtype)

    def accumulator(self, shape, dtype: str = "float32"):
        """A tile of accumulators: registers on CUDA."""
        return TC.alloc_buffer(shape, dtype, scope="local") if self.cpu else TL.alloc_fragment(shape, dtype)

    def parallel(self, *extents):
        """A loop over every element of a tile."""
        return TC.grid(*extents) if self.cpu else TL.Parallel(*extents)

    def absmax(self, tile, out) -> None:
        """``out[0] = max |tile|`` over a 1-D accumulator tile (a cross-thread reduction on CUDA)."""
        if self.cpu:
            _serial_absmax(tile, out, tile.shape[0])
        else:
            TL.reduce_absmax(tile, out, dim=0)

    def storage(self, dtype: str) -> str:
        """The dtype a tensor of ``dtype`` is declared with: its integer bits on the CPU for narrow floats."""
        return codec.FORMATS[dtype].storage if self.cpu and dtype in codec.FORMATS else dtype

    def load(self, value, dtype: str):
        """fp32 of an element read from a tensor declared ``storage(dtype)``."""
        if self.cpu and dtype in codec.FORMATS:
            return codec.decode(value, dtype)
        return TL.cast(value, "float32")

    def store(self, value, dtype: str):
        """fp32 ``value`` converted for a tensor declared ``storage(dtype)``, rounded to nearest even."""
        if self.cpu and dtype in codec.FORMATS:
            return codec.encode(value, dtype)
        return TL.cast(value, dtype)


@TL.macro
def _serial_absmax(tile, out, n):
    out[0] = TL.float32(0)
    for i in TL.serial(n):
        out[0] = TL.max(out[0], codec.magnitude(tile[i]))


CPU = Dialect("cpu")
CUDA = Dialect("cuda")

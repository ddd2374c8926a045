"""Zero-filled output tensors that cost only the pages written.

Low-latency outputs are large fixed-shape tensors ([E_loc, R * M, H]) of which a call writes a
small part. ``torch.zeros`` touches every page (measured 35 ms for 58 MB on this project's CPU
machine, against 3.4 ms for a calloc'ed buffer written a quarter full). On CPU the bytes come from
``numpy.zeros``, whose calloc gets large blocks as fresh, already-zero pages from the kernel.
"""
from __future__ import annotations

import math

import numpy as np
import torch

__all__ = ["zeros"]


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A new contiguous zero tensor; on CPU its untouched pages are never written."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)

"""Rows between the vendors' block-grouped layout and a packed one (``csrc/cpu/expert_rows.h``): MC2's
expert-grouped ``expand_x`` and DeepEP's ``[E_loc, R * M, H]`` (ascend), tmo's per-source padded
``dispatch_recv`` and the compact by-source records (cambricon)."""
from __future__ import annotations

import torch

from ...core.native import native

__all__ = ["copy_expert_rows"]


def copy_expert_rows(grouped_to_packed: bool, packed: torch.Tensor, grouped: torch.Tensor, counts: list[int]) -> None:
    """Copies rows between ``grouped`` [A, row] (``counts[e]`` rows per block e, blocks ascending) and
    ``packed`` [E_loc, C, row] (block e's rows at ``[e, :counts[e]]``), both contiguous: into ``packed``
    when ``grouped_to_packed``, else back. ``moe_comm._C``'s bounds-checked copy on the CPU; through torch
    elsewhere, after the same check. ValueError when the counts do not fit."""
    capacity = packed.shape[1]
    if packed.device.type == "cpu":
        fn = native().grouped_to_packed if grouped_to_packed else native().packed_to_grouped
        fn(packed.data_ptr(), grouped.data_ptr(), counts, capacity, grouped.shape[0],
           grouped[0].numel() * grouped.element_size() if grouped.shape[0] else 0)
        return
    wrong = native().check_expert_counts(counts, capacity, grouped.shape[0])
    if wrong:
        raise ValueError(f"copy_expert_rows: {wrong}")
    offset = 0
    for e, n in enumerate(counts):
        if grouped_to_packed:
            packed[e, :n].copy_(grouped[offset:offset + n])
        else:
            grouped[offset:offset + n].copy_(packed[e, :n])
        offset += n

"""The DeepEP facade: ``Buffer`` (normal mode in ``buffer``, low-latency mode in ``low_latency``), the
argument checks of both modes (``normal_args``, ``low_latency_args``, ``variant_knobs``) and events
(``event``). Users import these names from ``moe_comm``."""
from .buffer import Buffer, topk_idx_t
from .event import EventHandle, EventOverlap

__all__ = ["Buffer", "topk_idx_t", "EventHandle", "EventOverlap"]

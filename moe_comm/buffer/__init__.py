"""The DeepEP facade: ``Buffer`` (normal mode in ``buffer``, low-latency mode in ``low_latency``), the
argument checks of both modes (``normal_args``, ``low_latency_args``, ``variant_knobs``) and events
(``event``), and DeepEP V2's ``ElasticBuffer`` on top of ``Buffer`` (``elastic``, its layouts in
``elastic_layout`` and its sum order in ``elastic_combine``). Users import these names from ``moe_comm``."""
from .buffer import Buffer, topk_idx_t
from .elastic import ElasticBuffer, EPHandle
from .event import EventHandle, EventOverlap

__all__ = ["Buffer", "ElasticBuffer", "EPHandle", "topk_idx_t", "EventHandle", "EventOverlap"]

"""DeepEP v1's module surface (``import deep_ep``), backed by moe-comm.

The names are moe-comm's own objects, not copies: ``deep_ep.Buffer is moe_comm.Buffer``. Like
DeepEP before its V2 rewrite, there is no ``ElasticBuffer``, so engines that probe for it (vLLM's
``has_deep_ep_v2``, SGLang's ``deepep_v2`` backend) keep to the v1 API.
``moe_comm.integrations.install_deep_ep_alias()`` registers this module as ``deep_ep``.
"""
from moe_comm.buffer import Buffer, topk_idx_t
from moe_comm.buffer.event import EventHandle, EventOverlap
from moe_comm.core.config import Config

from . import utils

#: Set on this module only, so code can tell moe-comm's ``deep_ep`` from DeepEP's.
MOE_COMM = True

__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "topk_idx_t", "utils"]

"""DeepEP's module surface (``import deep_ep``), backed by moe-comm: V1's ``Buffer`` and V2's
``ElasticBuffer``.

The names are moe-comm's own objects, not copies: ``deep_ep.Buffer is moe_comm.Buffer``,
``deep_ep.ElasticBuffer is moe_comm.ElasticBuffer``. ``moe_comm.integrations.install_deep_ep_alias()``
registers this module as ``deep_ep``.
"""
from moe_comm.buffer import Buffer, topk_idx_t
from moe_comm.buffer.elastic import EPHandle, ElasticBuffer, get_logical_domain_size, get_physical_domain_size
from moe_comm.buffer.event import EventHandle, EventOverlap
from moe_comm.core.config import Config

from . import utils

#: Set on this module only, so code can tell moe-comm's ``deep_ep`` from DeepEP's.
MOE_COMM = True

__all__ = ["Buffer", "Config", "ElasticBuffer", "EPHandle", "EventHandle", "EventOverlap", "get_logical_domain_size",
           "get_physical_domain_size", "topk_idx_t", "utils"]

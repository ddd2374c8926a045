"""``deep_ep.utils``: the completion objects (Megatron-Core imports them from here)."""
from moe_comm.buffer.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]

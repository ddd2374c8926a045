"""``deep_ep.utils``: the completion objects (Megatron-Core imports them from here).

A package, as DeepEP's is, so that the harness that runs DeepEP V2's own tests
(``tools/deepep_tests``) can add DeepEP's test utilities (``deep_ep.utils.math``, ``refs``, ...) from a
DeepEP checkout to its ``__path__``; moe-comm ships none of DeepEP's files."""
from moe_comm.buffer.event import EventHandle, EventOverlap

__all__ = ["EventHandle", "EventOverlap"]

"""The accuracy standard every op of ``moe_comm.ops`` is held to (``standard``: ``check`` and its limits)
and the suite that holds them to it (``suite``; ``python -m moe_comm.accuracy`` prints its table)."""
from .standard import EXACT, STANDARD, AccuracyError, Report, Tolerance, calc_diff, check, metrics

__all__ = ["Tolerance", "STANDARD", "EXACT", "Report", "AccuracyError", "calc_diff", "metrics", "check"]

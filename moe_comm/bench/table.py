"""The fixed-width tables the benchmarks print."""
from __future__ import annotations

from typing import Any, Sequence

__all__ = ["format_table"]


def format_table(columns: Sequence[tuple[str, str]], rows: Sequence[dict[str, Any]]) -> str:
    """Fixed-width table; ``columns`` are (key, header); first column left-aligned, the rest right;
    floats get 3 decimals below 10, else 1; a missing or None value prints as "-"."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)
    cells = [[cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h) in enumerate(columns)]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, ((_, h), w) in enumerate(zip(columns, widths)))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
              for row in cells]
    return "\n".join(lines)

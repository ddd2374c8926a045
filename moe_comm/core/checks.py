"""Argument checks shared by the public API. Each raises before any byte moves, naming the argument,
what was expected and what was given."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import torch

from .errors import bad_argument

__all__ = ["check_tensor", "check_int", "check_bools", "describe"]

DTypes = Union[torch.dtype, Sequence[torch.dtype]]


def describe(t: Any) -> str:
    """Short description of a value for error messages: shape, dtype and device of a tensor."""
    if isinstance(t, torch.Tensor):
        return f"{list(t.shape)} {str(t.dtype).replace('torch.', '')} on {t.device}"
    return f"{type(t).__name__} {t!r}"[:120]


def check_tensor(op: str, name: str, t: Any, *, shape: Sequence[Optional[int]],
                 dtype: Optional[DTypes] = None, device: Optional[torch.device] = None) -> torch.Tensor:
    """Checks that ``t`` is a tensor of ``shape`` (None = any size), ``dtype`` (one or several) on
    ``device``; returns it."""
    if not isinstance(t, torch.Tensor):
        bad_argument(op, name, f"a tensor {_dims(shape)}", describe(t), kind=TypeError)
    if t.dim() != len(shape) or any(s is not None and s != got for s, got in zip(shape, t.shape)):
        bad_argument(op, name, f"shaped {_dims(shape)}", describe(t))
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            names = " or ".join(str(d).replace("torch.", "") for d in allowed)
            bad_argument(op, name, f"of dtype {names}", describe(t), kind=TypeError)
    if device is not None and t.device != device:
        bad_argument(op, name, f"on {device} (the device of x)", describe(t))
    return t


def _dims(shape: Sequence[Optional[int]]) -> str:
    # Worded only on failure: a compiled graph's symbolic sizes cannot be turned into text.
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def check_int(op: str, name: str, value: Any, *, minimum: int) -> int:
    """Checks that ``value`` is an int >= ``minimum``; returns it."""
    if isinstance(value, bool) or not isinstance(value, int):
        bad_argument(op, name, "an int", describe(value), kind=TypeError)
    if value < minimum:
        bad_argument(op, name, f">= {minimum}", value)
    return value


def check_bools(op: str, **flags: Any) -> None:
    """Checks that every keyword's value is a bool (not merely truthy)."""
    for name, value in flags.items():
        if not isinstance(value, bool):
            bad_argument(op, name, "a bool", describe(value), kind=TypeError)


def check_flags(op: str, **flags: Any) -> dict[str, bool]:
    """Like ``check_bools``, but also takes the ints 0 and 1 (DeepEP V2's own callers pass them); returns
    the values as bools."""
    for name, value in flags.items():
        if not isinstance(value, bool) and not (isinstance(value, int) and value in (0, 1)):
            bad_argument(op, name, "a bool (or 0 or 1)", describe(value), kind=TypeError)
    return {name: bool(value) for name, value in flags.items()}

"""A ``Buffer`` that records how it is called: which methods, how many positional arguments and
which keywords. Engines call DeepEP through fixed call sites; comparing the recording with the
expected call forms catches an engine release that passes a new keyword, drops one, or moves one
from keyword to position, before it turns into a wrong result."""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from ..buffer.buffer import Buffer

__all__ = ["Call", "Recorder", "recording_buffer"]


@dataclass(frozen=True)
class Call:
    """One call: the method, its positional arguments after ``self`` and its keyword names."""

    method: str
    positional: int
    keywords: frozenset[str]


@dataclass
class Recorder:
    """The calls, in order."""

    calls: list[Call] = field(default_factory=list)

    def forms(self) -> dict[str, set[tuple[int, frozenset[str]]]]:
        """Per method, the distinct ``(positional count, keyword set)`` it was called with."""
        out: dict[str, set[tuple[int, frozenset[str]]]] = {}
        for call in self.calls:
            out.setdefault(call.method, set()).add((call.positional, call.keywords))
        return out

    def clear(self) -> None:
        self.calls.clear()


def _recorded(recorder: Recorder, name: str, fn: Callable[..., Any], bound: bool) -> Callable[..., Any]:
    @functools.wraps(fn)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        recorder.calls.append(Call(name, len(args) - bound, frozenset(kwargs)))
        return fn(*args, **kwargs)
    return recorded


def recording_buffer(recorder: Recorder, base: type = Buffer) -> type:
    """A subclass of ``base`` whose constructor (recorded as ``"Buffer"``), public methods and static
    methods append a ``Call`` to ``recorder`` and then run unchanged. Class attributes such as
    ``num_sms`` stay on ``base``, so ``set_num_sms`` still changes what ``base`` reads."""
    namespace: dict[str, Any] = {"__init__": _recorded(recorder, "Buffer", base.__init__, True)}
    for name in dir(base):
        if name.startswith("_"):
            continue
        attr = inspect.getattr_static(base, name)
        if isinstance(attr, staticmethod):
            namespace[name] = staticmethod(_recorded(recorder, name, attr.__func__, False))
        elif inspect.isfunction(attr):
            namespace[name] = _recorded(recorder, name, attr, True)
    return type(f"Recording{base.__name__}", (base,), namespace)

"""moe-comm's PyTorch operator library: ``torch.ops.moe_comm.*``, the form in which ``torch.compile`` sees
moe-comm's ops and communication calls.

Every op is defined here once, by ``define``: a schema (what it reads, mutates and returns), the
implementation (the same Python code eager calls run, so a compiled call gives the same bits and
raises the same errors), and a fake that gives the outputs' shapes without reading any data. Fakes
never check arguments: the implementation does, when the call runs, so bad input to a compiled call
raises what it raises eagerly, at the same point, on every rank that must know. Communication calls
chain through their buffer's state tensor (``moe_comm.buffer.library``), which keeps them in program
order and never dropped. (Not torch's ordered-effect registry: with it, torch 2.13's inductor fixes a
data-dependent output size to one value, and an effectful op cannot have an autograd formula.)
"""
from __future__ import annotations

import sys
from typing import Callable, Optional, TypeVar

import torch

__all__ = ["NAMESPACE", "define", "op", "no_tensor"]

#: the namespace of every op: ``torch.ops.moe_comm.<name>``
NAMESPACE = "moe_comm"

_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
_F = TypeVar("_F", bound=Callable)


def define(schema: str, fake: Callable) -> Callable[[_F], _F]:
    """Decorator: defines ``torch.ops.moe_comm.<name>`` from ``schema`` (``"name(args) -> returns"``), with the
    decorated function as its implementation on every device and ``fake`` as its fake (meta)
    implementation. Returns the function."""
    name = schema.split("(", 1)[0]

    def register(fn: _F) -> _F:
        _LIBRARY.define(schema)
        _LIBRARY.impl(name, _untraced(fn), "CompositeExplicitAutograd")
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=_LIBRARY)
        return fn

    return register


def _untraced(fn: Callable) -> Callable:
    """``fn``, never traced by TorchDynamo: an op is opaque to the compiler. A compiled graph already runs its
    ops untraced, but tools that run the graph eagerly under Dynamo (``torch._dynamo.explain``) would trace
    the implementation and count its host reads as graph breaks. Dynamo is imported only once something
    compiles (it costs a second), so until then the plain function runs."""
    disabled = None

    def run(*args: object) -> object:
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return fn(*args)
        if disabled is None:
            disabled = torch.compiler.disable(fn, recursive=True)
        return disabled(*args)

    return run


def op(name: str) -> torch._ops.OpOverload:
    """The registered op ``torch.ops.moe_comm.<name>.default``."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default


def no_tensor(like: torch.Tensor, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """The empty tensor an op returns where its Python API returns None (a schema cannot return None)."""
    return like.new_empty(0, dtype=dtype)

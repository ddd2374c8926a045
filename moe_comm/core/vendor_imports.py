"""Guarded imports of the vendors' torch modules (``torch_npu``, ``torch_mlu``, ``torch_mlu_ops``).

``importlib.util.find_spec`` finding a module says only that it is installed: ``torch_npu`` installs
from PyPI on any x86 machine and then fails at import, because its extension links CANN's shared
libraries (``libhccl.so``, ``libascendcl.so``). So a vendor module counts as present only once it
imports, and the reason it does not names the module and, where the loader said which, the library.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import re
from types import ModuleType
from typing import Optional

__all__ = ["load"]

# what the dynamic loader says about a library it cannot find: "libhccl.so: cannot open shared object file"
_MISSING_LIBRARY = re.compile(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file")


@functools.lru_cache(maxsize=None)
def load(name: str, provider: str) -> tuple[Optional[ModuleType], Optional[str]]:
    """(module, None) when module ``name`` imports, else (None, why): not installed, or which shared library
    its import is missing, or the import's own error. ``provider`` says where the module comes from."""
    try:
        found = importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return None, f"{name} is not installed (it comes from {provider})"
    try:
        return importlib.import_module(name), None
    except Exception as exc:  # an installed module that cannot import: say what it lacks
        missing = _MISSING_LIBRARY.search(str(exc))
        if missing:
            return None, (f"{name} is installed but fails to import: its shared library {missing.group(1)} is "
                          f"missing (it comes from {provider}; {type(exc).__name__}: {exc})")
        return None, f"{name} is installed but fails to import ({type(exc).__name__}: {exc})"

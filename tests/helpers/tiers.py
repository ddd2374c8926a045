"""The two test tiers, and which tests the fast one keeps.

``fast`` (the default; ``make test``, CI) and ``all`` (``make test-all``: the exhaustive matrix). Pick one
with ``pytest --tier all`` or ``MOE_COMM_TEST_TIER=all``. The fast tier keeps:

* every test function, and every row of its case tables, except rows and tests marked ``exhaustive``
  (``@pytest.mark.exhaustive`` on a test, ``exhaustive(...)`` for a row of a parametrize list);
* of the runs of one case on every world kind (the ``transport`` parameter: shm, collective, mpi,
  cuda_host), one run: world kinds rotate over a module's cases, so each case runs once and, within
  every module, every world kind runs at least once (a module with fewer cases than kinds repeats its
  first case on the kinds the rotation left out);
* every run of a test marked ``every_transport`` (tests whose point is one capability on each kind).

Tests that compare transports or backends bitwise take no ``transport`` parameter (they run every kind
inside one test), so the rotation never thins them.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, Sequence

import pytest

TIERS = ("fast", "all")
#: The parameter that names a test's world kind (the ``transport`` fixture of conftest.py).
KIND_PARAM = "transport"


def exhaustive(*values: Any, **kwargs: Any) -> Any:
    """A parametrize row that only the exhaustive tier runs: ``exhaustive(4, 256, id="big")``."""
    marks = list(kwargs.pop("marks", ())) + [pytest.mark.exhaustive]
    return pytest.param(*values, marks=marks, **kwargs)


def tier_of(option: str | None) -> str:
    """The tier asked for: the ``--tier`` option, else MOE_COMM_TEST_TIER, else ``fast``."""
    tier = option or os.environ.get("MOE_COMM_TEST_TIER", "").strip() or "fast"
    if tier not in TIERS:
        raise pytest.UsageError(f"the test tier must be one of {list(TIERS)}, got {tier!r} "
                                f"(--tier or MOE_COMM_TEST_TIER)")
    return tier


def _kind(item: pytest.Item) -> str | None:
    spec = getattr(item, "callspec", None)
    return None if spec is None else spec.params.get(KIND_PARAM)


def _case(item: pytest.Item) -> tuple[str, str]:
    """(function, the item's parameter ids other than the world kind): one case of a case table."""
    spec = item.callspec  # type: ignore[attr-defined]
    kind = spec.params[KIND_PARAM]
    ids = [part for part in spec.id.split("-") if part != kind]
    return item.originalname, "-".join(ids)  # type: ignore[attr-defined]


def fast_selection(items: Sequence[pytest.Item], kinds: Sequence[str]) -> list[pytest.Item]:
    """The items of ``items`` (in their order) that the fast tier runs (see the module docstring);
    ``kinds`` is the world kinds' rotation order."""
    keep: set[int] = set()
    by_module: OrderedDict[Any, OrderedDict[tuple[str, str], dict[str, pytest.Item]]] = OrderedDict()
    for item in items:
        if item.get_closest_marker("exhaustive"):
            continue
        kind = _kind(item)
        if kind is None or item.get_closest_marker("every_transport"):
            keep.add(id(item))
            continue
        by_module.setdefault(item.module, OrderedDict()).setdefault(_case(item), {})[kind] = item
    for cases in by_module.values():
        covered, turn = set(), 0
        for runs in cases.values():
            order = [kinds[(turn + i) % len(kinds)] for i in range(len(kinds))] + sorted(set(runs) - set(kinds))
            kind = next(k for k in order if k in runs)
            keep.add(id(runs[kind]))
            covered.add(kind)
            turn = (kinds.index(kind) + 1) % len(kinds) if kind in kinds else turn
        for kind in kinds:
            if kind not in covered:
                runs = next((r for r in cases.values() if kind in r), None)
                if runs is not None:
                    keep.add(id(runs[kind]))
    return [item for item in items if id(item) in keep]

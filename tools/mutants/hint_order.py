"""A pytest plugin for tools/mutants/run.py: runs the items of the mutant's hint files first.

Passing the hint files before ``tests`` on the command line does not do it: pytest 8+ folds paths that
lie inside another argument into that argument's collection, in its usual (alphabetical) order. So
run.py passes ``tests`` alone, as ``make test`` does, names the hint files in MOE_COMM_MUTANT_HINTS
(os.pathsep-separated, relative to the rootdir) and loads this plugin (copied into the scratch venv as
``moe_comm_mutants_hint_order``: ``-p moe_comm_mutants_hint_order``), which moves
their items to the front after the fast tier has chosen them (trylast: after conftest.py's selection),
in hint order; each file's items keep their order and stay together, so module fixtures are unchanged.
"""
from __future__ import annotations

import os

import pytest

ENV = "MOE_COMM_MUTANT_HINTS"


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    hints = [h.replace(os.sep, "/") for h in os.environ.get(ENV, "").split(os.pathsep) if h]
    if not hints:
        return
    first = {path: i for i, path in enumerate(hints)}
    items.sort(key=lambda item: first.get(item.nodeid.split("::", 1)[0], len(hints)))  # stable


def pytest_report_header(config):
    hints = [h for h in os.environ.get(ENV, "").split(os.pathsep) if h]
    return f"mutant hint files run first: {', '.join(hints)}" if hints else None

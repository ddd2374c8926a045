"""The planted bugs of ``make test-mutants`` still apply: each one's snippet occurs exactly once in its file
(code that moved on makes ``tools/mutants/run.py`` stop; this catches it in the fast tier instead)."""
from __future__ import annotations

import sys

import pytest

from helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "tools" / "mutants"))
import mutants  # noqa: E402


@pytest.mark.parametrize("mutant", mutants.MUTANTS, ids=[m.id for m in mutants.MUTANTS])
def test_mutant_snippet_occurs_once(mutant):
    found = (ROOT / mutant.file).read_text().count(mutant.old)
    assert found == 1, f"{mutant.id}: its snippet occurs {found} times in {mutant.file}"
    assert mutant.new != mutant.old
    for hint in mutant.hints:
        assert (ROOT / hint).is_file(), f"{mutant.id}: hint {hint} is not a file"


def test_mutant_ids_are_unique():
    ids = [m.id for m in mutants.MUTANTS]
    assert len(ids) == len(set(ids))

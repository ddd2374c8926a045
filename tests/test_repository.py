"""The repository as a newcomer meets it: README.md is a landing page of at most 15 KB that opens with the
two commands, every relative link of the documentation names a file that exists, and no file refers to a
path outside the repository. Static: reads the files git tracks (or would track)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from helpers.paths import ROOT

README_LIMIT = 15 * 1024
#: Spellings of a path that leaves the repository (the workplace's shared notes live beside it).
OUTSIDE = re.compile(r"\.\./shared\b|/work/shared\b")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _files() -> list[Path]:
    """The files git tracks or would track here (untracked but not ignored), without deleted ones."""
    try:
        out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"not a git checkout ({exc}): the repository's file list is git's")
    return [ROOT / name for name in out.splitlines() if (ROOT / name).is_file()]


def outside_references(files: list[Path], root: Path = ROOT) -> list[str]:
    """``path:line: text`` (path relative to ``root``) for every line of ``files`` that names a path outside
    the repository."""
    found = []
    for path in files:
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # binary files name no paths we could follow
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                found.append(f"{path.relative_to(root)}:{number}: {line.strip()[:120]}")
    return found


def broken_links(doc: Path) -> list[str]:
    """The relative links of markdown file ``doc`` whose target file does not exist."""
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor of the same page
        if not (doc.parent / target.split("#")[0]).exists():
            broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    return broken


def test_no_file_refers_to_a_path_outside_the_repository():
    this = Path(__file__).resolve()
    found = outside_references([f for f in _files() if f.resolve() != this])
    assert not found, "references outside the repository (copy the facts into docs/, naming their public " \
                      "source):\n" + "\n".join(found)


def test_planted_outside_references_are_found(tmp_path):
    (tmp_path / "notes.py").write_text('"""Facts."""\n# as ../shared/research/deepep.md says\n')
    (tmp_path / "run.sh").write_text("cat /work/shared/docs/DESIGN.md\n")
    found = outside_references([tmp_path / "notes.py", tmp_path / "run.sh"], tmp_path)
    assert found == ["notes.py:2: # as ../shared/research/deepep.md says", "run.sh:1: cat /work/shared/docs/DESIGN.md"]


def test_readme_is_a_landing_page():
    readme = ROOT / "README.md"
    size = readme.stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes; at most {README_LIMIT} (move detail to docs/)"
    head = readme.read_text()[:3000]
    assert "make demo" in head and "make test" in head, "README.md must open with the two commands"


@pytest.mark.parametrize("doc", ["README.md", "CONTRIBUTING.md"] + [f"docs/{p.name}" for p in
                                                                     sorted((ROOT / "docs").glob("*.md"))])
def test_documentation_links_name_files_that_exist(doc):
    assert not broken_links(ROOT / doc), broken_links(ROOT / doc)

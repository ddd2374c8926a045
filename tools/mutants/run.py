#!/usr/bin/env python3
"""Mutation check of the fast test tier (``make test-mutants``): does it still catch planted bugs?

For each mutant of ``tools/mutants/mutants.py`` (all, or the ids named on the command line), one at a
time, in a scratch copy of the repository at ``build/mutants/work`` (the real working tree is only read):

1. reset the scratch copy to the current working tree: the files of ``git ls-files -co --exclude-standard``
   are copied where their content differs (with a new mtime, so the incremental build sees them), and files
   copied by an earlier reset that are gone from the working tree are removed; ignored paths of the scratch
   copy (its ``.venv``, its ``build/``) stay;
2. apply the mutant: its ``old`` snippet must occur exactly once in its file, or the run stops here;
3. rebuild the native extensions (``pip install --no-build-isolation -e .``, incremental through
   pyproject's ``build-dir``) when the mutant or the reset touched what the build reads (``csrc/``,
   ``CMakeLists.txt``, ``pyproject.toml``). The scratch copy has its own venv, ``build/mutants/work/.venv``,
   made once by the scratch copy's ``make setup`` plus the torch-npu overlay that ``make test`` adds
   (tests/backends/test_vendor_imports.py looks for it beside the package). A mutant that does not build,
   or whose module does not import, is INVALID (not a mutant), never "killed";
4. run the fast tier with ``-x`` in the scratch copy, with ``MOE_COMM_REQUIRE_TOOLS=1`` as ``make test`` does:
   ``python -m pytest -x -q -p no:cacheprovider -p moe_comm_mutants_hint_order tests``, under a timeout.
   The mutant's hint files run first, then the rest of the tier: the plugin (``hint_order.py``, copied
   into the scratch venv) moves their items to the front (pytest 8+ folds file arguments that lie inside
   ``tests`` into its collection, in its own order, so naming them first on the command line does not).

Each mutant ends as killed (by the first ``FAILED``/``ERROR`` test of pytest's summary), survived (the fast
tier passed), timeout, or invalid. A kill is checked at once: the mutant is undone in the same copy of the
tree (rebuilt if native) and the killing test runs alone; a test that fails without the mutant too (a
broken test, another engineer's edit in progress in the working tree) did not kill it: ``unverified``.
Results go to ``build/mutants/results.json`` (rewritten after each mutant, so a stopped run keeps what it
found), the table (markdown) to ``build/mutants/results.md`` and stdout; each mutant's logs to
``build/mutants/logs/ID.log`` and ``ID.verify.log``.

Exit status: 0 when every mutant run was killed (or timed out, which a user would see too); 1 when one
survived, was invalid, or its kill did not verify; 2 for a usage error or a broken setup.

    python tools/mutants/run.py              # every mutant
    python tools/mutants/run.py --list       # the mutants, nothing run
    python tools/mutants/run.py flags-exact-ignored ring-tail-before-data   # some, in this order
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
from hint_order import ENV as HINTS_ENV  # noqa: E402
from mutants import MUTANTS, Mutant  # noqa: E402

OUT = ROOT / "build" / "mutants"
SCRATCH = OUT / "work"
VENV = SCRATCH / ".venv"  # the Makefile's default VENV, relative to the scratch copy
PY = VENV / "bin" / "python"
MANIFEST = OUT / "manifest.json"
#: the name hint_order.py gets in the scratch venv (a pytest plugin: -p PLUGIN)
PLUGIN = "moe_comm_mutants_hint_order"
LOGS = OUT / "logs"
#: What the native build reads: a change there (by a mutant, or by the reset undoing one) means a rebuild.
BUILD_INPUTS = ("csrc/", "CMakeLists.txt", "pyproject.toml")
#: The extras `make setup` installs.
EXTRAS = ".[test,mpi,plot,tilelang]"
#: A survivor costs a whole fast-tier run (10-15 min on the 2-core VM); a hang ends here.
DEFAULT_TIMEOUT_S = 2400
#: The first failing test in pytest's short summary (-q prints it: FAILED/ERROR nodeid - message).
SUMMARY_RE = re.compile(r"^(FAILED|ERROR) (\S+)")


def log(msg: str) -> None:
    print(f"[mutants {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------------------------- scratch copy
def tree_files() -> list[str]:
    """The working tree's files (tracked and untracked, not ignored) that exist now."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                         capture_output=True).stdout.decode()
    files = sorted({f for f in out.split("\0") if f})
    return [f for f in files if os.path.lexists(ROOT / f) and not (ROOT / f).is_dir()]


def _drop_bytecode(path: Path) -> None:
    """Removes the cached bytecode of a .py file whose content changed: a mutant and its undoing can have
    the same size and mtime second, which Python's pyc check would not tell apart."""
    if path.suffix == ".py":
        cache = path.parent / "__pycache__"
        if cache.is_dir():
            for pyc in cache.glob(path.stem + ".*.pyc"):
                pyc.unlink(missing_ok=True)


def reset_scratch() -> list[str]:
    """Makes the scratch copy's tree files those of the working tree; returns the paths it changed."""
    files = tree_files()
    changed = []
    SCRATCH.mkdir(parents=True, exist_ok=True)
    for rel in files:
        src, dst = ROOT / rel, SCRATCH / rel
        if src.is_symlink():
            target = os.readlink(src)
            if dst.is_symlink() and os.readlink(dst) == target:
                continue
            if dst.exists() or dst.is_symlink():
                dst.unlink()
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(target, dst)
            changed.append(rel)
            continue
        data = src.read_bytes()
        if dst.is_file() and not dst.is_symlink() and dst.read_bytes() == data:
            if (dst.stat().st_mode & 0o777) != (src.stat().st_mode & 0o777):
                shutil.copymode(src, dst)
            continue
        if dst.is_symlink() or dst.is_dir():
            shutil.rmtree(dst) if dst.is_dir() and not dst.is_symlink() else dst.unlink()
        dst.parent.mkdir(parents=True, exist_ok=True)
        tmp = dst.with_name(dst.name + ".mutants-tmp")
        tmp.write_bytes(data)  # a new mtime: the build and Python's bytecode cache see the change
        shutil.copymode(src, tmp)
        os.replace(tmp, dst)
        _drop_bytecode(dst)
        changed.append(rel)
    previous = set(json.loads(MANIFEST.read_text())) if MANIFEST.exists() else set()
    for rel in sorted(previous - set(files)):
        path = SCRATCH / rel
        if path.is_file() or path.is_symlink():
            path.unlink()
            _drop_bytecode(path)
            changed.append(rel)
    MANIFEST.write_text(json.dumps(files))
    return changed


def apply_mutant(m: Mutant) -> None:
    path = SCRATCH / m.file
    text = path.read_text()
    count = text.count(m.old)
    if count != 1:
        raise SystemExit(f"mutant {m.id}: its `old` snippet occurs {count} times in {m.file} (must be exactly "
                         f"once); the code changed under it: update tools/mutants/mutants.py")
    path.write_text(text.replace(m.old, m.new))
    _drop_bytecode(path)


def touches_build(paths) -> bool:
    return any(p.startswith(BUILD_INPUTS) or p in BUILD_INPUTS for p in paths)


# -------------------------------------------------------------------------------------------------- venv
def run_logged(cmd, logfile: Path, cwd: Path = SCRATCH, env=None, timeout=None) -> int:
    with open(logfile, "a") as f:
        f.write(f"$ {' '.join(shlex.quote(str(c)) for c in cmd)}\n")
        f.flush()
        return subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                              timeout=timeout).returncode


def setup_venv(logfile: Path) -> None:
    """The scratch copy's venv, as `make setup` makes .venv, and the torch-npu overlay `make test` adds."""
    stamp = VENV / ".moe-comm-installed"
    overlay = VENV / "torch-npu" / ".installed"
    extras = VENV / ".mutants-extras"  # the EXTRAS the venv was last installed with
    if stamp.exists() and overlay.exists():
        if not extras.exists() or extras.read_text() != EXTRAS:  # an extra added since: install it
            if not rebuild(logfile):
                raise SystemExit(f"installing {EXTRAS} into the scratch venv failed; see {logfile}")
            extras.write_text(EXTRAS)
        return
    log(f"making the scratch venv {VENV.relative_to(ROOT)} (make setup in the scratch copy; minutes) ...")
    rc = run_logged(["make", "setup", ".venv/torch-npu/.installed", "VENV=.venv", f"PYTHON={getattr(sys, '_base_executable', sys.executable)}"],
                    logfile)
    if rc != 0 or not stamp.exists():
        raise SystemExit(f"the scratch copy's `make setup` failed (exit {rc}); see {logfile}")
    extras.write_text(EXTRAS)


def install_plugin() -> None:
    """hint_order.py into the scratch venv's site-packages, as PLUGIN, so `-p PLUGIN` finds it without a
    PYTHONPATH (which the tests' subprocesses would inherit)."""
    site = subprocess.run([str(PY), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    target = Path(site) / f"{PLUGIN}.py"
    source = (HERE / "hint_order.py").read_bytes()
    if not target.exists() or target.read_bytes() != source:
        target.write_bytes(source)


def rebuild(logfile: Path) -> bool:
    """The incremental editable install, as `make setup` does it; False when the build fails."""
    rc = run_logged([str(PY), "-m", "pip", "install", "-q", "--no-build-isolation", "-e", EXTRAS], logfile)
    return rc == 0


def module_of(rel: str) -> str | None:
    """The module a mutated .py file is, or for csrc the native modules (each imported to check)."""
    if rel.endswith(".py") and rel.startswith("moe_comm/"):
        mod = rel[:-3].replace("/", ".")
        return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod
    return None


def imports_ok(m: Mutant, logfile: Path) -> bool:
    """The mutated module (a .py file) or the native modules (csrc) import in the scratch venv."""
    mod = module_of(m.file)
    if mod is not None:
        code = f"import importlib; importlib.import_module({mod!r})"
    else:
        code = ("import moe_comm, importlib\n"
                "for name in ('moe_comm._C', 'moe_comm._cuda_host'):\n"
                "    importlib.import_module(name)\n")
    env = dict(os.environ, TRITON_INTERPRET="1")
    return run_logged([str(PY), "-c", code], logfile, env=env, timeout=600) == 0


# ------------------------------------------------------------------------------------------------ pytest
def pytest_cmd() -> list[str]:
    """The fast tier as `make test` runs it, with -x; hint_order.py puts the hint files' items first. Without the
    check that every mutant's snippet is in its file: a planted mutant fails it by construction, which proves
    nothing of the tests."""
    return [str(PY), "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", PLUGIN,
            "--deselect", "tests/tools/test_mutants_list.py::test_mutant_snippet_occurs_once", "tests"]


def test_env(hints=()) -> dict:
    env = dict(os.environ, MOE_COMM_REQUIRE_TOOLS="1")
    for var in ("MOE_COMM_TEST_TIER", "PYTHONPATH", "VIRTUAL_ENV", "PYTEST_ADDOPTS"):
        env.pop(var, None)
    env[HINTS_ENV] = os.pathsep.join(hints)
    env["PATH"] = f"{VENV / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return env


def run_pytest(cmd, logfile: Path, timeout_s: float, hints=()) -> tuple[int | None, float]:
    """(exit status, or None on a timeout; seconds). The run has its own process group, all of which a
    timeout ends (ranks, mpiexec jobs)."""
    with open(logfile, "a") as f:
        f.write(f"$ {' '.join(shlex.quote(str(c)) for c in cmd)}\n")
        f.flush()
        start = time.monotonic()
        if hints:
            f.write(f"[mutants] {HINTS_ENV}={os.pathsep.join(hints)}\n")
            f.flush()
        proc = subprocess.Popen(cmd, cwd=SCRATCH, env=test_env(hints), stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = None
        seconds = time.monotonic() - start
        # what the run left behind (a rank a failure orphaned) goes with it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        f.write(f"\n[mutants] pytest exit {rc} after {seconds:.1f} s\n")
    return rc, seconds


def first_failure(logfile: Path) -> str | None:
    for line in logfile.read_text(errors="replace").splitlines():
        match = SUMMARY_RE.match(line)
        if match:
            return match.group(2)
    return None


# -------------------------------------------------------------------------------------------------- runs
def run_mutant(m: Mutant, timeout_s: float, state: dict, verify: bool) -> dict:
    logfile = LOGS / f"{m.id}.log"
    logfile.write_text(f"mutant {m.id}: {m.file}\n{m.description}\n--- old\n{m.old}\n+++ new\n{m.new}\n\n")
    changed = reset_scratch()
    original = (SCRATCH / m.file).read_text()
    apply_mutant(m)
    result = {"id": m.id, "file": m.file, "description": m.description, "caught_by": None, "seconds": None}
    if touches_build(changed) or touches_build([m.file]) or state.get("build_dirty"):
        log(f"{m.id}: rebuilding the native extensions")
        state["build_dirty"] = True  # until a build of the unmutated tree
        if not rebuild(logfile):
            return dict(result, status="invalid", reason="the build fails")
        state["build_dirty"] = touches_build([m.file])
    if not imports_ok(m, logfile):
        return dict(result, status="invalid", reason="the mutated module does not import")
    hints = [h for h in m.hints if (SCRATCH / h).exists()]
    rc, seconds = run_pytest(pytest_cmd(), logfile, timeout_s, hints)
    result["seconds"] = round(seconds, 1)
    if rc is None:
        return dict(result, status="timeout", caught_by=f"timeout after {timeout_s:g} s")
    failed = first_failure(logfile)
    if rc == 0:
        return dict(result, status="survived")
    if failed is None:
        return dict(result, status="error", reason=f"pytest exit {rc} without a FAILED/ERROR line: see {logfile}")
    result = dict(result, status="killed", caught_by=failed, pytest_exit=rc)
    if verify:
        verify_kill(m, result, original, state, timeout_s)
    return result


def verify_kill(m: Mutant, result: dict, original: str, state: dict, timeout_s: float) -> None:
    """The killing test, on the same copy of the tree with the mutant undone, must pass: else the kill
    is the tree's (a test that fails anyway, another engineer's edit in progress), not the mutant's,
    and the result becomes ``unverified``."""
    node = result["caught_by"]
    logfile = LOGS / f"{m.id}.verify.log"
    logfile.write_text(f"mutant {m.id} undone: does {node} pass?\n")
    path = SCRATCH / m.file
    path.write_text(original)
    _drop_bytecode(path)
    if touches_build([m.file]):
        log(f"{m.id}: rebuilding without the mutant, to verify the kill")
        if not rebuild(logfile):
            result.update(status="unverified", reason=f"the tree without the mutant does not build (see {logfile})")
            return
        state["build_dirty"] = False
    cmd = [str(PY), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", node]
    rc, seconds = run_pytest(cmd, logfile, timeout_s)
    result["verify_seconds"] = round(seconds, 1)
    text = logfile.read_text(errors="replace")
    passed = "::" not in node or re.search(r"^PASSED " + re.escape(node) + r"$", text, re.M)
    if rc != 0 or not passed:
        result.update(status="unverified",
                      reason=f"`{node}` fails without the mutant too (pytest exit {rc}; see {logfile})")


def table(results: list[dict]) -> str:
    rows = ["| mutant | bug | caught by | seconds |", "| --- | --- | --- | --- |"]
    for r in results:
        if r["status"] == "killed":
            caught = f"`{r['caught_by']}`"
        elif r["status"] == "timeout":
            caught = f"timeout ({r['caught_by']})"
        else:
            caught = f"**{r['status'].upper()}**" + (f": {r['reason']}" if r.get("reason") else "")
        seconds = "" if r["seconds"] is None else f"{r['seconds']:.0f}"
        rows.append(f"| `{r['id']}` ({r['file']}) | {r['description']} | {caught} | {seconds} |")
    return "\n".join(rows)


def write_results(args, results: list[dict], total: float) -> tuple[str, dict, str]:
    """results.json and results.md; returns (the table, the counts by status, the counts line)."""
    summary = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "command": " ".join(["python tools/mutants/run.py", *args.ids]),
        "total_seconds": round(total, 1),
        "results": results,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = table(results)
    counts = {s: sum(r["status"] == s for r in results) for s in
              ("killed", "timeout", "survived", "invalid", "error", "unverified")}
    tail = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
    (OUT / "results.md").write_text(md + f"\n\n{tail}; total {total:.0f} s\n")
    return md, counts, tail


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("ids", nargs="*", help="mutant ids (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help=f"seconds for one mutant's pytest run (default {DEFAULT_TIMEOUT_S})")
    parser.add_argument("--no-verify", action="store_true",
                        help="do not re-run each killing test with its mutant undone")
    args = parser.parse_args(argv)

    by_id = {m.id: m for m in MUTANTS}
    if args.list:
        width = max(len(m.id) for m in MUTANTS)
        for m in MUTANTS:
            hints = f"\n{'':{width}}  hints: {', '.join(m.hints)}" if m.hints else ""
            print(f"{m.id:{width}}  {m.file}\n{'':{width}}  {m.description}{hints}")
        print(f"{len(MUTANTS)} mutants")
        return 0
    unknown = [i for i in args.ids if i not in by_id]
    if unknown:
        parser.error(f"unknown mutant ids: {', '.join(unknown)} (--list shows them)")
    chosen = [by_id[i] for i in args.ids] if args.ids else list(MUTANTS)
    # every snippet is checked against the working tree before anything runs
    for m in chosen:
        count = (ROOT / m.file).read_text().count(m.old)
        if count != 1:
            print(f"mutant {m.id}: its `old` snippet occurs {count} times in {m.file} (must be exactly once)",
                  file=sys.stderr)
            return 2

    LOGS.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    setup_log = LOGS / "_setup.log"
    setup_log.write_text("")
    changed = reset_scratch()
    setup_venv(setup_log)
    install_plugin()
    state = {"build_dirty": touches_build(changed)}
    results = []
    for i, m in enumerate(chosen, 1):
        log(f"[{i}/{len(chosen)}] {m.id}: {m.description}")
        r = run_mutant(m, args.timeout, state, verify=not args.no_verify)
        results.append(r)
        write_results(args, results, time.monotonic() - started)
        verified = " (verified: it passes without the mutant)" if r["status"] == "killed" and not args.no_verify else ""
        log(f"[{i}/{len(chosen)}] {m.id}: {r['status'].upper()}"
            + (f" by {r['caught_by']}{verified}" if r["caught_by"] else "")
            + (f" ({r['reason']})" if r.get("reason") else "")
            + (f" in {r['seconds']:.0f} s" if r["seconds"] is not None else ""))
    reset_scratch()  # leave the scratch copy unmutated (its build is redone by the next run if needed)
    total = time.monotonic() - started
    md, counts, tail = write_results(args, results, total)
    print()
    print(md)
    print(f"\n{tail}; total {total:.0f} s ({total / 60:.1f} min); results in {OUT.relative_to(ROOT)}/results.json")
    bad = counts["survived"] + counts["invalid"] + counts["error"] + counts["unverified"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

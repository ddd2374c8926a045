#!/usr/bin/env python3
"""SASS lint of the flag operations: do the protocol's publishes and waits compile to the machine code
the memory model needs?

Compiles tools/sass_lint/probe.cu (one extern "C" kernel per protocol operation, calling the real
protocol functions with the real DevicePlatform) to a cubin per architecture, disassembles it
(cuobjdump -sass, which runs nvdisasm, or nvdisasm itself) and checks each probe's SASS:

  publish  every strong store in the probe is a system-scope strong store (ST[G].E[.64].STRONG.SYS),
           reached on every path only after a system-scope fence (MEMBAR.SC.SYS / MEMBAR.ALL.SYS)
           with no other store in between; predicated fences count for stores under the same
           predicate. At least one 64-bit such store (a flag: all flags are int64; the 32-bit one is
           the error record's code) must be there.
  wait     every spin loop (a loop that reads the clock: each wait polls its deadline) loads a 64-bit
           flag with a system-scope strong load (LD[G].E.64.STRONG.SYS) followed by an acquire
           invalidation (CCTL.IVALL) or a system fence, and no load in it is a non-coherent /
           constant-cache one (.CONSTANT, .NC).

Prints a table; exits 1 on any violation, printing the offending instructions. Usage:

    python tools/sass_lint/lint.py [--arch sm_90 --arch sm_100] [-D MACRO ...] [--sass FILE]

Importable: lint(), check_sass(), format_report(), find_nvcc(), find_disassembler().
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
PROBE_SOURCE = HERE / "probe.cu"
DEFAULT_ARCHS = ("sm_90", "sm_100")
NVCC_FLAGS = ("-std=c++17", "-cubin", "-O3")


# ---- what each probe must show ---------------------------------------------------------------------

@dataclass(frozen=True)
class Spec:
    publish: bool  # the probe publishes flags: check every strong store
    wait: bool     # the probe spins on a flag: check every spin loop
    what: str


PROBES: dict[str, Spec] = {
    "probe_ring_publish_tail": Spec(True, False, "ring tail publish (sender)"),
    "probe_ring_publish_head": Spec(True, False, "ring head publish (receiver)"),
    "probe_ring_wait_data": Spec(False, True, "ring wait for data (tail)"),
    "probe_ring_wait_space": Spec(False, True, "ring wait for space (head)"),
    "probe_barrier": Spec(True, True, "barrier arrivals + waits"),
    "probe_wait_at_least": Spec(False, True, "wait_at_least"),
    "probe_ll_dispatch_send": Spec(True, False, "LL dispatch count signal publish"),
    "probe_ll_dispatch_recv": Spec(False, True, "LL dispatch count signal wait"),
    "probe_ll_combine_send": Spec(True, False, "LL combine flag publish"),
    "probe_ll_combine_wait": Spec(False, True, "LL combine flag wait"),
    "probe_ll_post_header": Spec(True, True, "LL call header: flow-control wait, sequence word publish"),
    "probe_ll_judge": Spec(False, True, "LL call headers: the receive's wait for every sequence word"),
    "probe_ll_consumed": Spec(True, False, "LL consumed signals (flow control)"),
    "probe_rdma_put": Spec(True, False, "RDMA ring tail publish after the put (sender, IPC link)"),
    "probe_rdma_release": Spec(True, False, "RDMA ring head signal (receiver, IPC link)"),
    "probe_rdma_wait_data": Spec(False, True, "RDMA ring wait for data (tail)"),
    "probe_rdma_wait_space": Spec(False, True, "RDMA ring wait for space (head; also the drain)"),
    "probe_rail_barrier": Spec(True, True, "rail barrier arrivals + waits (IPC link)"),
    "probe_node_barrier": Spec(True, True, "node barrier arrivals + waits"),
}


# ---- finding the tools -----------------------------------------------------------------------------

def _cuda_bin_dirs() -> list[str]:
    dirs = []
    for var in ("CUDA_HOME", "CUDA_PATH", "CUDA_ROOT"):
        if os.environ.get(var):
            dirs.append(os.path.join(os.environ[var], "bin"))
    dirs += sorted(glob.glob("/usr/local/cuda*/bin"), reverse=True)
    return dirs


def _wheel_bin_dirs() -> list[str]:
    """bin folders of the NVIDIA PyPI wheels: nvidia/cu13/bin (CUDA 13 wheels),
    nvidia/cuda_cuobjdump/bin, nvidia/cuda_nvdisasm/bin (CUDA 12 wheels)."""
    roots = [p for p in sys.path if p]
    for key in ("purelib", "platlib"):
        try:
            roots.append(sysconfig.get_paths()[key])
        except KeyError:
            pass
    dirs: list[str] = []
    for root in roots:
        for d in sorted(glob.glob(os.path.join(root, "nvidia", "*", "bin"))):
            if d not in dirs:
                dirs.append(d)
    return dirs


def _find(name: str, env: str, extra_dirs: list[str]) -> str | None:
    if os.environ.get(env):  # an explicit choice: that file or nothing
        p = shutil.which(os.environ[env])
        return p if p else None
    found = shutil.which(name)
    if found:
        return found
    for d in extra_dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def find_nvcc() -> str | None:
    return _find("nvcc", "NVCC", _cuda_bin_dirs())


def find_disassembler() -> tuple[str, str] | None:
    """(kind, path): cuobjdump when nvdisasm is found too (cuobjdump -sass runs nvdisasm), else nvdisasm
    alone; None if there is no nvdisasm."""
    dirs = _cuda_bin_dirs() + _wheel_bin_dirs()
    nvdisasm = _find("nvdisasm", "NVDISASM", dirs)
    if not nvdisasm:
        return None
    cuobjdump = _find("cuobjdump", "CUOBJDUMP", dirs)
    return ("cuobjdump", cuobjdump) if cuobjdump else ("nvdisasm", nvdisasm)


# ---- compiling and disassembling -------------------------------------------------------------------

def compile_probe(arch: str, out_dir: str | os.PathLike, defines=(), nvcc: str | None = None,
                  source: Path = PROBE_SOURCE, include: str | os.PathLike = REPO / "csrc") -> Path:
    """probe.cu -> a cubin for arch; include: the csrc folder (a mutated copy, in the lint's own tests)."""
    nvcc = nvcc or find_nvcc()
    if not nvcc:
        raise FileNotFoundError("nvcc not found (PATH, $CUDA_HOME/bin, /usr/local/cuda*/bin)")
    tag = "_".join([arch] + [d.replace("=", "_") for d in defines])
    cubin = Path(out_dir) / f"probe_{tag}.cubin"
    cmd = [nvcc, *NVCC_FLAGS, f"-arch={arch}", "-I", str(include),
           *[f"-D{d}" for d in defines], str(source), "-o", str(cubin)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return cubin


def disassemble(cubin: str | os.PathLike, tool: tuple[str, str] | None = None) -> str:
    tool = tool or find_disassembler()
    if not tool:
        raise FileNotFoundError("nvdisasm not found (PATH, /usr/local/cuda*/bin, site-packages nvidia/*/bin: "
                                "pip install nvidia-cuda-nvdisasm)")
    kind, path = tool
    env = dict(os.environ)
    if kind == "cuobjdump":
        cmd = [path, "-sass", str(cubin)]
        nvdisasm = _find("nvdisasm", "NVDISASM", _cuda_bin_dirs() + _wheel_bin_dirs())
        if nvdisasm:  # where cuobjdump looks for it
            env["NVDISASM_PATH"] = os.path.dirname(nvdisasm)
    else:
        cmd = [path, str(cubin)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{r.stdout}{r.stderr}")
    return r.stdout


# ---- parsing SASS ----------------------------------------------------------------------------------

@dataclass
class Insn:
    addr: int
    guard: str      # "" when unpredicated (or @PT)
    opcode: str     # with modifiers: STG.E.64.STRONG.SYS
    operands: str
    text: str       # the line as printed, encoding comments dropped
    target: int | None = None  # branch target address, resolved

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]

    def __str__(self) -> str:
        return self.text


_FUNC_CUOBJDUMP = re.compile(r"^\s*Function\s*:\s*(\S+)")
_FUNC_NVDISASM = re.compile(r"^\.text\.(\S+):\s*$")
_LABEL = re.compile(r"^\s*(\.L\w+):\s*$")
_INSN = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(?:(@!?U?P(?:T|\d+))\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)"
                   r"\s*([^;]*?)\s*;")
_HEX_TARGET = re.compile(r"(0x[0-9a-fA-F]+)\s*$")
_LABEL_TARGET = re.compile(r"`\((\.L\w+)\)\s*$")


def parse_sass(text: str) -> dict[str, list[Insn]]:
    """Functions of a cuobjdump -sass or nvdisasm listing, by name, instructions in address order."""
    funcs: dict[str, list[Insn]] = {}
    labels: dict[str, dict[str, int]] = {}
    pending: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        m = _FUNC_CUOBJDUMP.match(line) or _FUNC_NVDISASM.match(line)
        if m:
            name = m.group(1)
            funcs[name] = []
            labels[name] = {}
            pending[name] = []
            continue
        if name is None:
            continue
        m = _LABEL.match(line)
        if m:
            pending[name].append(m.group(1))
            continue
        if line.lstrip().startswith("//") or (line.lstrip().startswith(".") and "/*" not in line):
            if line.lstrip().startswith(".section") and funcs[name]:
                name = None  # nvdisasm: the next section is not this function's code
            continue
        m = _INSN.match(line)
        if not m:
            continue
        addr = int(m.group(1), 16)
        guard = m.group(2) or ""
        if guard == "@PT":
            guard = ""
        text_part = line.split(";")[0].strip() + " ;"
        insn = Insn(addr, guard, m.group(3), m.group(4).strip(), text_part)
        for lab in pending[name]:
            labels[name][lab] = addr
        pending[name] = []
        funcs[name].append(insn)
    for fname, insns in funcs.items():
        for insn in insns:
            if insn.base in ("BRA", "JMP", "CALL"):
                m = _HEX_TARGET.search(insn.operands)
                if m:
                    insn.target = int(m.group(1), 16)
                else:
                    m = _LABEL_TARGET.search(insn.operands)
                    if m and m.group(1) in labels[fname]:
                        insn.target = labels[fname][m.group(1)]
    return funcs


# ---- instruction classes ---------------------------------------------------------------------------

def is_store(i: Insn) -> bool:  # to global or generic memory (flags live there)
    return i.base in ("ST", "STG")


def is_rmw(i: Insn) -> bool:
    return i.base in ("ATOM", "ATOMG", "RED", "REDG")


def is_load(i: Insn) -> bool:  # from global or generic memory
    return i.base in ("LD", "LDG")


def is_strong(i: Insn) -> bool:
    return ".STRONG." in i.opcode + "." or i.opcode.endswith((".SYS", ".GPU"))


def is_sys_strong(i: Insn) -> bool:
    return ".STRONG.SYS" in i.opcode


def is_64(i: Insn) -> bool:
    return ".64" in i.opcode + "."


# What fence.acq_rel.sys / st.release.sys (MEMBAR.ALL.SYS) and fence.sc.sys (MEMBAR.SC.SYS) compile to
# on sm_90 and sm_100 (README.md); MEMBAR.*.GPU / .CTA and FENCE.VIEW.ASYNC.* are not system fences.
_SYS_FENCE = re.compile(r"^MEMBAR\.(SC|ALL)\.SYS$")


def is_sys_fence(i: Insn) -> bool:
    return bool(_SYS_FENCE.match(i.opcode))


def is_nc(i: Insn) -> bool:
    mods = i.opcode.split(".")[1:]
    return is_load(i) and ("CONSTANT" in mods or "NC" in mods)


def reads_clock(i: Insn) -> bool:
    return "SR_CLOCK" in i.operands or "SR_GLOBALTIMER" in i.operands


# ---- control flow ----------------------------------------------------------------------------------

class FlowError(Exception):
    pass


def successors(insns: list[Insn]) -> list[list[int]]:
    index = {i.addr: k for k, i in enumerate(insns)}
    succ: list[list[int]] = []
    for k, i in enumerate(insns):
        nxt = [k + 1] if k + 1 < len(insns) else []
        b = i.base
        if b in ("BRX", "JMX", "BRXU", "JMXU") or i.opcode.startswith("CALL.ABS"):
            raise FlowError(f"indirect branch, not analysed: {i}")
        if b in ("EXIT", "RET", "KILL"):
            succ.append(nxt if i.guard else [])
        elif b in ("BRA", "JMP"):
            if i.target is None or i.target not in index:
                raise FlowError(f"branch target not resolved: {i}")
            t = index[i.target]
            conditional = bool(i.guard) or "," in i.operands  # BRA.U UP0, target / BRA.DIV UR4, target
            succ.append([t] + nxt if conditional else [t])
        elif b == "CALL":
            # a subroutine of this function (e.g. 64-bit division): assumed to return; its body is
            # analysed from its own entry
            succ.append(nxt + ([index[i.target]] if i.target in index else []))
        else:
            succ.append(nxt)
    return succ


def _predecessors(succ: list[list[int]]) -> list[list[int]]:
    pred: list[list[int]] = [[] for _ in succ]
    for k, ss in enumerate(succ):
        for s in ss:
            pred[s].append(k)
    return pred


def natural_loops(insns: list[Insn], succ: list[list[int]]) -> list[tuple[int, int, set[int]]]:
    """(head, latch, body) per retreating edge latch -> head (head's address <= latch's)."""
    pred = _predecessors(succ)
    loops = []
    for latch, ss in enumerate(succ):
        for head in ss:
            if insns[head].addr > insns[latch].addr:
                continue
            body = {head}
            stack = [latch]
            while stack:
                n = stack.pop()
                if n in body:
                    continue
                body.add(n)
                stack.extend(pred[n])
            loops.append((head, latch, body))
    return loops


# ---- the checks ------------------------------------------------------------------------------------

@dataclass
class Violation:
    message: str
    lines: list[str] = field(default_factory=list)


@dataclass
class ProbeResult:
    arch: str
    probe: str
    kind: str
    observed: list[str] = field(default_factory=list)
    violations: list[Violation] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations


def _fence_states(insns: list[Insn], succ: list[list[int]]) -> list[frozenset | None]:
    """Per instruction, before it executes: the guards under which a system fence has run since the
    last store on every path ("" = unconditionally). None: unreachable."""
    pred = _predecessors(succ)
    n = len(insns)
    entries = {0} | {index for index in (
        next((j for j, x in enumerate(insns) if x.addr == i.target), None)
        for i in insns if i.base == "CALL") if index is not None}

    def transfer(k: int, s: frozenset) -> frozenset:
        i = insns[k]
        if is_sys_fence(i):
            return frozenset({""}) if not i.guard else s | {i.guard}
        if is_store(i) or is_rmw(i) or i.base == "CALL":
            return frozenset()
        # an instruction naming a guard's predicate register may redefine it
        regs = set(re.findall(r"\bU?P\d+\b", i.operands))
        return frozenset(g for g in s if g == "" or g.lstrip("@!") not in regs)

    # a must-analysis: optimistic start (None: no path seen yet), meet = intersection, to a fixpoint
    state_in: list[frozenset | None] = [None] * n
    out: list[frozenset | None] = [None] * n
    changed = True
    while changed:
        changed = False
        for k in range(n):
            if k in entries:
                s = frozenset()
            else:
                known = [out[p] for p in pred[k] if out[p] is not None]
                if not known:
                    continue
                s = frozenset.intersection(*known)
            if state_in[k] != s:
                state_in[k] = s
                changed = True
            o = transfer(k, s)
            if out[k] != o:
                out[k] = o
                changed = True
    return state_in


def _fence_before(insns: list[Insn], k: int) -> int | None:
    for j in range(k - 1, -1, -1):
        if is_sys_fence(insns[j]):
            return j
        if is_store(insns[j]) or is_rmw(insns[j]):
            return None
    return None


def _show(i: Insn) -> str:
    return f"{i.guard} {i.opcode}" if i.guard else i.opcode


def check_publishes(insns: list[Insn], succ, res: ProbeResult) -> None:
    states = _fence_states(insns, succ)
    sequences: dict[str, int] = {}
    flags = unfenced = 0
    for k, i in enumerate(insns):
        if not is_store(i) or states[k] is None:
            continue
        if not is_strong(i):
            continue  # payload and error-record fields: weak stores, ordered by the release after them
        if not is_sys_strong(i):
            res.violations.append(Violation("publish store is not system-scope strong", [str(i)]))
            continue
        s = states[k]
        if "" not in s and (not i.guard or i.guard not in s):
            f = _fence_before(insns, k)
            lines = ([str(insns[f])] if f is not None else []) + [str(i)]
            unfenced += 1
            res.violations.append(Violation(
                "store without a system-scope fence (MEMBAR.SC/ALL.SYS) before it on every path "
                "since the last store", lines))
            continue
        if is_64(i):
            flags += 1
        f = _fence_before(insns, k)
        seq = " ; ".join(_show(x) for x in insns[f:k + 1]) if f is not None else _show(i)
        sequences[seq] = sequences.get(seq, 0) + 1
    if flags == 0 and not unfenced:
        res.violations.append(Violation("no 64-bit fenced system-scope store: the flag publish is missing "
                                        "or weak", [str(i) for i in insns if is_store(i)][:12]))
    for seq, count in sequences.items():
        res.observed.append(f"publish: {seq}  (x{count})")


def check_waits(insns: list[Insn], succ, res: ProbeResult) -> None:
    loops = [(h, l, body) for h, l, body in natural_loops(insns, succ)
             if any(reads_clock(insns[k]) for k in body)]
    if not loops:
        res.violations.append(Violation("no spin loop found (no loop reads the clock)"))
        return
    seen: dict[str, set[int]] = {}
    for head, latch, body in loops:
        where = f"loop {insns[head].addr:#06x}-{insns[latch].addr:#06x}"
        loads = [k for k in sorted(body) if is_load(insns[k])]
        flag_loads = [k for k in loads if is_64(insns[k]) and is_sys_strong(insns[k])]
        if not flag_loads:
            res.violations.append(Violation(f"{where}: no 64-bit system-scope strong load of the flag",
                                            [str(insns[k]) for k in loads] or ["(no global loads in the loop)"]))
        for k in flag_loads:
            acq = _acquire_after(insns, k)
            if acq is None:
                res.violations.append(Violation(f"{where}: flag load not followed by CCTL.IVALL or a "
                                                "system fence (not an acquire)", [str(insns[k])]))
            else:
                seen.setdefault(f"{_show(insns[k])} ; {_show(insns[acq])}", set()).add(k)
        nc = [k for k in loads if is_nc(insns[k])]
        if nc:
            res.violations.append(Violation(f"{where}: non-coherent / constant-cache load in a spin loop",
                                            [str(insns[k]) for k in nc]))
    for seq, ks in seen.items():
        res.observed.append(f"wait: {seq}  (x{len(ks)} in {len(loops)} spin loop(s))")


def _acquire_after(insns: list[Insn], k: int) -> int | None:
    for j in range(k + 1, min(k + 9, len(insns))):
        i = insns[j]
        if i.opcode == "CCTL.IVALL" or is_sys_fence(i):
            return j
        if is_load(i) or is_store(i) or is_rmw(i) or i.base in ("BRA", "JMP", "EXIT", "RET", "CALL"):
            return None
    return None


def check_function(arch: str, name: str, insns: list[Insn], spec: Spec) -> ProbeResult:
    kind = "+".join(x for x, on in (("publish", spec.publish), ("wait", spec.wait)) if on)
    res = ProbeResult(arch, name, kind)
    try:
        succ = successors(insns)
    except FlowError as e:
        res.violations.append(Violation(str(e)))
        return res
    if spec.publish:
        check_publishes(insns, succ, res)
    if spec.wait:
        check_waits(insns, succ, res)
    return res


def check_sass(text: str, arch: str, probes: dict[str, Spec] = PROBES) -> list[ProbeResult]:
    funcs = parse_sass(text)
    results = []
    for name, spec in probes.items():
        if name not in funcs or not funcs[name]:
            r = ProbeResult(arch, name, "?")
            r.violations.append(Violation("probe not found in the SASS"))
            results.append(r)
        else:
            results.append(check_function(arch, name, funcs[name], spec))
    for name in funcs:
        if name.startswith("probe_") and name not in probes:
            r = ProbeResult(arch, name, "?")
            r.violations.append(Violation("probe without a spec: add it to PROBES in lint.py"))
            results.append(r)
    return results


def lint(archs=DEFAULT_ARCHS, defines=(), nvcc: str | None = None, tool: tuple[str, str] | None = None,
         keep_dir: str | None = None, include: str | os.PathLike = REPO / "csrc") -> list[ProbeResult]:
    results: list[ProbeResult] = []
    with tempfile.TemporaryDirectory(prefix="sass_lint_") as tmp:
        out = keep_dir or tmp
        os.makedirs(out, exist_ok=True)
        for arch in archs:
            cubin = compile_probe(arch, out, defines, nvcc, include=include)
            sass = disassemble(cubin, tool)
            if keep_dir:
                Path(cubin).with_suffix(".sass").write_text(sass)
            results += check_sass(sass, arch)
    return results


# ---- output ----------------------------------------------------------------------------------------

def format_report(results: list[ProbeResult]) -> str:
    rows = []
    for r in results:
        obs = r.observed + [f"VIOLATION: {v.message}" for v in r.violations] or ["-"]
        for n, o in enumerate(obs):
            first = n == 0
            rows.append((r.arch if first else "", r.probe if first else "", r.kind if first else "",
                         ("ok" if r.ok else "FAIL") if first else "", o))
    head = ("arch", "probe", "checks", "result", "SASS observed")
    widths = [max(len(x[c]) for x in rows + [head]) for c in range(4)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head[:4], widths)) + "  " + head[4]]
    lines.append("  ".join("-" * w for w in widths) + "  " + "-" * len(head[4]))
    for row in rows:
        lines.append("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
    bad = [r for r in results if not r.ok]
    for r in bad:
        for v in r.violations:
            lines.append(f"VIOLATION {r.arch} {r.probe}: {v.message}")
            lines += [f"    {' '.join(x.split())}" for x in v.lines]
    lines.append(f"{len(results) - len(bad)}/{len(results)} probes pass"
                 + ("" if not bad else f"; FAILED: {', '.join(sorted({f'{r.arch}:{r.probe}' for r in bad}))}"))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", action="append", help="sm_XX (repeatable; default sm_90 and sm_100)")
    ap.add_argument("-D", dest="defines", action="append", default=[], help="macro for probe.cu (repeatable)")
    ap.add_argument("--sass", help="lint this disassembly instead of compiling (needs exactly one --arch label)")
    ap.add_argument("--keep", help="keep the cubins and disassemblies in this folder")
    args = ap.parse_args(argv)
    archs = args.arch or list(DEFAULT_ARCHS)
    if args.sass:
        results = check_sass(Path(args.sass).read_text(), archs[0])
    else:
        nvcc, tool = find_nvcc(), find_disassembler()
        if not nvcc or not tool:
            print("sass_lint: needs nvcc and nvdisasm (pip install nvidia-cuda-nvdisasm; cuobjdump optional); "
                  f"nvcc={nvcc} disassembler={tool}", file=sys.stderr)
            return 2
        print(f"sass_lint: {nvcc}, {tool[1]}, archs {' '.join(archs)}"
              + (f", -D {' -D '.join(args.defines)}" if args.defines else ""))
        results = lint(archs, args.defines, nvcc, tool, args.keep)
    print(format_report(results))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""The summary of one ``tools/gpu_check.sh`` run: every step's exit status, time and time box (from
``$OUT/steps.tsv``), its verdict from its own record (``$OUT/<step>.json``, a pytest junit file, a
compute-sanitizer log) and the benchmark's numbers beside the issue's targets, into
``$OUT/summary.json``; printed too.

    python tools/gpu_check/summary.py --out "$OUT"
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SANITIZER_REFUSALS = ("not supported", "unsupported", "unable to", "cannot be", "permission", "no devices",
                      "device not", "could not", "failed to initialize", "insufficient")


def junit(path: Path) -> dict:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in root.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(f"{case.get('classname')}::{case.get('name')}")
    skipped = [f"{c.get('name')}: {(c.find('skipped').get('message') or '')[:120]}" for c in root.iter("testcase")
               if c.find("skipped") is not None]
    return {**n, "failed": failed[:30], "skipped_reasons": skipped[:10]}


def sanitizer(log: str, rc: int) -> dict:
    """clean | errors | refused (the tool's own lines say it would not instrument this device) | timed out |
    no tool | failed (anything else, e.g. the run's own comparison failed under the tool)."""
    m = re.search(r"ERROR SUMMARY: (\d+) error", log)
    errors = int(m.group(1)) if m else None
    tool_lines = [ln for ln in log.splitlines() if ln.startswith("=========")]
    refusal = [ln for ln in tool_lines if any(p in ln.lower() for p in SANITIZER_REFUSALS)]
    if rc in (124, 137):
        status = "timed out"
    elif "compute-sanitizer not found" in log:
        status = "no tool"
    elif errors:
        status = "errors"
    elif refusal:
        status = "refused"
    elif errors == 0 and rc == 0:
        status = "clean"
    else:
        status = "failed"
    return {"status": status, "errors": errors, "refusal": refusal[:5], "lines": tool_lines[:25]}


def step_verdict(name: str, rc: int, out: Path) -> dict:
    v: dict = {}
    js = out / f"{name}.json"
    if js.is_file():
        try:
            data = json.loads(js.read_text())
            v["record_ok"] = data.get("ok")
            v["failed_checks"] = [k for k, c in data.get("checks", {}).items() if not c.get("ok")]
        except (OSError, ValueError) as exc:
            v["record_error"] = str(exc)
    xml = out / f"{name}.xml"
    if xml.is_file():
        try:
            v["pytest"] = junit(xml)
        except (OSError, ET.ParseError) as exc:
            v["pytest_error"] = str(exc)
    log = out / f"{name}.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    if name.startswith("sanitizer"):
        v["sanitizer"] = sanitizer(text, rc)
        v["pass"] = v["sanitizer"]["status"] == "clean" and v.get("record_ok", True) is not False
        return v
    ok = rc == 0
    if "record_ok" in v:
        ok = ok and bool(v["record_ok"])
    if "pytest" in v:
        p = v["pytest"]
        ok = ok and p["tests"] > 0 and p["failures"] == 0 and p["errors"] == 0
        if name == "pytest_emulated":  # a skipped GPU case means the GPU path did not run
            ok = ok and p["skipped"] == 0
    v["pass"] = ok
    if not ok and text:
        v["log_tail"] = text.splitlines()[-12:]
    return v


def numbers(out: Path) -> dict:
    path = out / "bench.json"
    if not path.is_file():
        return {}
    try:
        b = json.loads(path.read_text())
    except ValueError:
        return {}
    c = b.get("checks", {})
    n: dict = {"targets": b.get("targets"), "copy_GBps": c.get("copy", {}).get("copy_GBps"),
               "copy_read_plus_write_GBps": c.get("copy", {}).get("read_plus_write_GBps")}
    for k, v in c.items():
        if k.startswith("normal_R") and "dispatch" in v:
            n[k] = {"channels_ran": v.get("channels_ran"), "attempts": [(a["C"], a.get("kernel")) for a in
                                                                         v.get("attempts", [])]}
            for op in ("dispatch", "combine"):
                for what in ("kernel", "call"):
                    r = v[op][what]
                    n[k][f"{op}_{what}"] = {x: r.get(x) for x in ("median_us", "per_rank_GBps", "aggregate_GBps",
                                                                  "of_copy")}
        if k.startswith("ll_R") and "eager" in v:
            n[k] = {f"{op}_{mode}_us": v.get(mode, {}).get(op, {}).get("median_us")
                    for op in ("dispatch", "combine") for mode in ("eager", "graph")}
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    out = Path(a.out)
    steps = {}
    tsv = out / "steps.tsv"
    for line in tsv.read_text().splitlines() if tsv.is_file() else []:
        name, rc, secs, box = line.split("\t")[:4]
        rc_i = int(rc)
        steps[name] = {"rc": rc_i, "seconds": float(secs), "time_box_s": int(box), "timed_out": rc_i in (124, 137)}
        steps[name].update({"pass": False, "skipped": True} if rc_i == -1 else step_verdict(name, rc_i, out))
    summary = {"pass": {k: v["pass"] for k, v in steps.items()}, "all_pass": bool(steps) and
               all(v["pass"] for v in steps.values()), "steps": steps, "numbers": numbers(out)}
    machine = out / "machine.json"
    if machine.is_file():
        try:
            f = json.loads(machine.read_text())["checks"]["facts"]
            summary["machine"] = {k: f.get(k) for k in ("nvidia_smi", "device", "torch", "torch_cuda", "nvcc",
                                                        "compute-sanitizer", "cpu_count", "python")}
        except (ValueError, KeyError):
            pass
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    def line(v: dict) -> str:
        verdict = "skipped" if v.get("skipped") else "pass" if v["pass"] else "FAIL"
        text = f"{verdict} rc={v['rc']} {v['seconds']:.0f}/{v['time_box_s']} s"
        text += " (timed out)" if v["timed_out"] else ""
        return text + (f" sanitizer: {v['sanitizer']['status']}" if "sanitizer" in v else "")
    brief = {"all_pass": summary["all_pass"], "steps": {k: line(v) for k, v in steps.items()},
             "numbers": summary["numbers"]}
    print(json.dumps(brief, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

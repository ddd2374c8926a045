"""Elastic EP (issue 47): a decode loop of ``EPMoE`` low-latency steps on 4 real rank processes loses a rank to
SIGKILL, keeps serving with it masked, and admits a relaunched process (``MOE_COMM_REJOIN=1``); a second rank
is lost and replaced in the same job, and a replacement that dies during its own join leaves the survivors
serving. Every step of every live rank must equal the layer computed with all live experts in one process,
bitwise (``examples/elastic_decode.py`` checks and records it; here the records are judged)."""
import json
import subprocess
import sys

import pytest

from helpers.paths import ROOT
from helpers.rejoin_cases import refusals
from helpers.transports import local_world

EXAMPLE = ROOT / "examples" / "elastic_decode.py"
TIMEOUT_S = 5.0  # the Buffer's deadline in the job
STEPS, STEP_S = 36, 0.3
KILL = {2: 8, 1: 20}
#: (rank, survivors' step it starts at, dies during its join)
REPLACE = [(2, 12, False), (1, 22, True), (1, 23, False)]


def _run(tmp_path, transport: str, ranks_per_node: int = 0) -> dict:
    out = tmp_path / "job.json"
    cmd = [sys.executable, str(EXAMPLE), "--hidden", "256", "--steps", str(STEPS), "--step-s", str(STEP_S),
           "--timeout", str(TIMEOUT_S), "--transport", transport, "--json", str(out),
           "--kill", ",".join(f"{r}:{s}" for r, s in KILL.items()),
           "--replace", ",".join(f"{r}:{s}" + (":die" if die else "") for r, s, die in REPLACE)]
    if ranks_per_node:
        cmd += ["--ranks-per-node", str(ranks_per_node)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.exists(), run.stdout + run.stderr[-4000:]
    job = json.loads(out.read_text())
    job["output"] = run.stdout + run.stderr[-4000:]
    job["returncode"] = run.returncode
    return job


@pytest.mark.parametrize("transport,ranks_per_node", [("shm", 0), ("collective", 0), ("shm", 2)],
                         ids=["shm", "collective", "two_nodes"])
def test_loss_and_rejoin(tmp_path, transport, ranks_per_node):
    job = _run(tmp_path, transport, ranks_per_node)
    out = job["output"]
    assert job["passed"] and job["returncode"] == 0, out  # every step: the live ranks, bitwise equal
    steps: dict[int, list[dict]] = {}
    for rec in job["records"]:
        steps.setdefault(rec["step"], []).append(rec)
    last = max(steps)  # the job runs on past STEPS until every rank has been in for two steps
    assert sorted(steps) == list(range(last + 1)) and last + 1 >= STEPS, out
    # the step a rank is killed in (its --kill step, or the first after it with every rank in) ends within one
    # deadline, without it, on every survivor
    for rank, at in KILL.items():
        step = min(s for s in steps if s >= at and any(rank in rec["masked"] for rec in steps[s]))
        assert all(not r["masked"] for r in steps[step - 1]), steps[step - 1]  # it was in the step before
        recs = steps[step]
        assert all(rank in rec["masked"] and rec["seconds"] < TIMEOUT_S for rec in recs), (step, recs)
    # each replacement that lived is admitted within 2 steps of being ready, and every rank is back in
    firsts = sorted((rec for rec in job["records"] if "admitted" in rec), key=lambda rec: rec["step"])
    assert [rec["rank"] for rec in firsts] == [2, 1], out
    for rec in firsts:
        ready_in = max(s for s in steps if min(r["began"] for r in steps[s]) <= rec["ready"])
        assert rec["step"] <= ready_in + 2, (rec, ready_in)
        assert all(not r["masked"] for r in steps[rec["step"]]), steps[rec["step"]]
    assert not any(r["masked"] for r in steps[last]) and len(steps[last]) == 4
    # the replacement that died in its join: the survivors went on serving (checked above), with it masked
    died = [e for e in job["events"] if e.get("dies_in_join")]
    assert len(died) == 1 and any(e.get("pid") == died[0]["pid"] and e.get("exit") == -9 for e in job["events"])
    # a new epoch per admission tried: two committed, one aborted
    assert max(rec["epoch"] for rec in steps[last]) == 3, out


def test_rejoin_refusals_name_what_would_work():
    with local_world(1, "shm", timeout_s=60) as world:
        out = world.run(refusals, 0.5)[0]
    assert out["no_shrink"].startswith("ValueError: Buffer: rejoin must be True only with low_latency_mode=True and "
                                       "enable_shrink=True"), out
    assert "enable_shrink=False" in out["no_shrink"] and "low_latency_mode=False" in out["no_low_latency"], out
    assert out["mpi"].startswith("ValueError: Buffer: rejoin must be a transport that can admit a process: shm or "
                                 "collective (MPI cannot without ULFM), got transport 'mpi'"), out
    assert out["not_bool"].startswith("TypeError: Buffer: rejoin must be a bool"), out
    assert out["bad_env"] == "ValueError: environment variable MOE_COMM_REJOIN must be 1 or 0, got 'maybe'", out
    # nobody invites it: it gives up after twice the deadline and one store wait, naming why
    assert out["uninvited"].startswith("CommTimeoutError: Buffer(rejoin=True): rank 0 timed out after 2 s"), out
    assert "no survivor invited this rank" in out["uninvited"] and 2.0 <= out["uninvited_s"] < 10, out

"""A real two-host run on one machine: 2 hosts x 2 ranks, each host a network namespace (one veth
into a bridge), a UTS namespace with its own hostname and its own /dev/shm (``netns_hosts``).

The shm transport groups ranks by hostname, so inside a host rows move through shared memory and
between hosts through gloo over the veths. The fixed program of ``output_digest_cases`` (both modes,
BF16 and FP8, top-k, cached dispatch) must give, on every rank, bitwise the outputs of the same
program on 4 ranks of this machine split into the same two nodes by ``MOE_COMM_RANKS_PER_NODE=2``: the
node split is what changes the outputs' forms (DeepEP's internode handle and two-level combine sum),
so that is the one-host run that must agree.
"""
import subprocess
import sys
import time

import pytest

from helpers.deadlines import EXIT_S
from helpers.netns_hosts import IFNAME, THIS_MACHINE, NamespacesUnavailable, netns_hosts, run_ranks, unavailable
from helpers.paths import HELPERS

HOSTS, RANKS_PER_HOST = 2, 2
WORKER = [sys.executable, str(HELPERS / "multihost_worker.py")]
NODES = [list(range(h * RANKS_PER_HOST, (h + 1) * RANKS_PER_HOST)) for h in range(HOSTS)]  # [[0, 1], [2, 3]]
# Starting 4 ranks (Python, torch, moe_comm) on 2 loaded cores, the program, and the exit barrier: 10 s
# idle, past 120 s once beside two busy loops and the rest of the fast tier.
RUN_S = 300.0
# What a host's veth must send while the program runs: its ranks send the other host's share of
# output_digest_cases' rows (37 tokens x 256 hidden BF16 per normal call, 43 x 4 low-latency
# copies), 0.6 MB measured; a host whose gloo traffic went another way would send a few frames.
MIN_CROSS_HOST_BYTES = 20_000


@pytest.fixture
def hosts():
    """Two fresh hosts, deleted with every process in them afterwards (also when the test fails)."""
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    try:
        with netns_hosts(HOSTS) as made:
            yield made
    except NamespacesUnavailable as exc:
        pytest.skip(f"cannot make network namespaces here: {exc}")


def test_two_hosts_give_the_bits_of_one_host_split_in_two(hosts, tmp_path):
    spread = run_ranks(hosts, RANKS_PER_HOST, WORKER, env={}, workdir=tmp_path / "hosts", timeout_s=RUN_S)
    together = run_ranks([THIS_MACHINE], HOSTS * RANKS_PER_HOST, WORKER,
                         env={"MOE_COMM_RANKS_PER_NODE": str(RANKS_PER_HOST)}, workdir=tmp_path / "one_host",
                         timeout_s=RUN_S)

    for rank, report in enumerate(spread):
        host = hosts[rank // RANKS_PER_HOST]
        others = {h.ip for h in hosts if h is not host}
        assert report["hostname"] == host.hostname, f"rank {rank}"
        assert report["interfaces"] == sorted(["lo", IFNAME]), f"rank {rank}: its host has another way out"
        # Split by hostname alone (no MOE_COMM_RANKS_PER_NODE here): shared memory inside a host, gloo across.
        assert (report["transport"], report["nodes"], report["internode"]) == ("shm", NODES, True), f"rank {rank}"
        assert others <= set(report["tcp_peers"]), f"rank {rank}: no TCP connection to the other host"
        assert report["if_tx_bytes"] >= MIN_CROSS_HOST_BYTES, f"rank {rank}: its host's {IFNAME} sent too little"
    shm_of_host = [{r["shm_device"] for r in spread[h * RANKS_PER_HOST:(h + 1) * RANKS_PER_HOST]} for h in range(HOSTS)]
    assert all(len(devices) == 1 for devices in shm_of_host), "the ranks of a host see different /dev/shm"
    assert len(set.union(*shm_of_host)) == HOSTS, "two hosts share a /dev/shm"
    for rank, report in enumerate(together):
        assert (report["hostname"], report["transport"], report["nodes"]) == (THIS_MACHINE.hostname, "shm", NODES), \
            f"one-host rank {rank}"
    assert [r["digest"] for r in spread] == [r["digest"] for r in together]
    assert len({r["digest"] for r in spread}) == len(spread)  # the ranks' outputs differ: a digest is per rank


def test_a_hung_rank_is_killed_at_the_deadline_with_everything_in_its_host(hosts, tmp_path):
    hang = [sys.executable, "-c", "import time; time.sleep(600)"]
    deadline_s = 3.0
    began = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[0, 1, 2, 3\] did not finish within 3 s"):
        run_ranks(hosts, RANKS_PER_HOST, hang, env={}, workdir=tmp_path, timeout_s=deadline_s)
    assert time.monotonic() - began < deadline_s + EXIT_S
    # killed at the deadline, gone within EXIT_S (beside two busy loops, still listed right after the kill)
    gone_by = began + deadline_s + EXIT_S
    for host in hosts:
        while True:
            left = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True,
                                  timeout=10).stdout.split()
            if not left or time.monotonic() >= gone_by:
                break
            time.sleep(0.1)
        assert left == [], f"{host.hostname}: processes left after the deadline"

"""Several hosts on one machine, and ranks started on them under a deadline.

A host is a network namespace whose one non-loopback interface (``IFNAME``, a veth) plugs into a
bridge in a namespace of its own, so traffic between hosts crosses real interfaces, plus a UTS
namespace with the host's own hostname and a mount namespace with the host's own /dev/shm (both
shared by the host's ranks). ``THIS_MACHINE`` is the
machine itself, without namespaces, for comparison runs. Namespaces take root (CAP_SYS_ADMIN,
CAP_NET_ADMIN), iproute2's ``ip`` and util-linux's ``unshare``.

    with netns_hosts(2) as hosts:
        reports = run_ranks(hosts, 2, [sys.executable, "worker.py"], env={}, workdir=tmp, timeout_s=90)
"""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

from helpers.ports import free_port
from helpers.processes import describe_sessions

__all__ = ["Host", "IFNAME", "NamespacesUnavailable", "THIS_MACHINE", "netns_hosts", "run_ranks", "unavailable"]

#: The veth inside every host's namespace (GLOO_SOCKET_IFNAME there).
IFNAME = "mc0"
_SUBNET = "10.77.0"  # host i is .{i + 1}/24; each run's namespaces are its own, so runs never clash
_PREFIX = "moecomm"  # namespaces are named moecomm-<pid of the test process>-<role>
_IP_S = 10.0  # the deadline of one ip command
# Environment variables of an enclosing launcher that would mislead a rank (run_ranks sets its own).
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                  "GLOO_SOCKET_IFNAME", "PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")


@dataclass(frozen=True)
class Host:
    """Where ranks run: a namespace pair with its hostname and address, or this machine (netns None)."""

    hostname: str
    ip: str
    netns: Optional[str] = None

    def shell(self, script: str) -> list[str]:
        """The command that runs the shell ``script`` on this host (in its namespaces, under its hostname)."""
        if self.netns is None:
            return ["sh", "-c", script]
        # ip netns exec gives the command a mount namespace of its own (its mounts do not propagate
        # back), where the host gets its own /dev/shm, shared by its ranks and gone with them.
        setup = f"hostname {shlex.quote(self.hostname)} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm || exit"
        return ["ip", "netns", "exec", self.netns, "unshare", "--uts", "sh", "-c", f"{setup}\n{script}"]


#: This machine as one host: its own hostname, loopback (gloo on ``lo``).
THIS_MACHINE = Host(hostname=socket.gethostname(), ip="127.0.0.1")


class NamespacesUnavailable(RuntimeError):
    """``ip netns add`` failed (no CAP_SYS_ADMIN, or a kernel without network namespaces)."""


def unavailable() -> Optional[str]:
    """Why ``netns_hosts`` cannot run here (not root, a tool missing), or None."""
    if os.geteuid() != 0:
        return f"network namespaces need root, this test runs as uid {os.geteuid()}"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian package {package}: apt-get install {package})"
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=_IP_S)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)} failed with code {done.returncode}: {done.stderr.strip()}")


def _kill_processes(netns: str) -> None:
    """Kills every process in ``netns``."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True, timeout=_IP_S).stdout
    for pid in pids.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


def _kill_netns(netns: str) -> None:
    """Kills every process in ``netns`` (ranks left by a failed run), then deletes it."""
    _kill_processes(netns)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=_IP_S)


def _sweep_stale() -> None:
    """Deletes namespaces left by test processes that no longer run (a run killed before its cleanup)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=_IP_S)
    for line in done.stdout.splitlines():
        name = (line.split() or [""])[0]
        parts = name.split("-")
        if len(parts) == 3 and parts[0] == _PREFIX and parts[1].isdigit() and not Path(f"/proc/{parts[1]}").exists():
            _kill_netns(name)


@contextlib.contextmanager
def netns_hosts(count: int) -> Iterator[list[Host]]:
    """``count`` hosts ``host0``, ``host1``, ... at 10.77.0.1, .2, ... joined by one bridge. On exit
    (also after a failure) every process left in their namespaces is killed and the namespaces are
    deleted. Raises NamespacesUnavailable when the first namespace cannot be made."""
    _sweep_stale()
    tag = f"{_PREFIX}-{os.getpid()}"
    bridge_ns = f"{tag}-br"
    made: list[str] = []
    try:
        done = subprocess.run(["ip", "netns", "add", bridge_ns], capture_output=True, text=True, timeout=_IP_S)
        if done.returncode:
            raise NamespacesUnavailable(f"ip netns add failed (code {done.returncode}): {done.stderr.strip()}")
        made.append(bridge_ns)
        _ip("-n", bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", bridge_ns, "link", "set", "br0", "up")
        hosts = []
        for i in range(count):
            host = Host(hostname=f"host{i}", ip=f"{_SUBNET}.{i + 1}", netns=f"{tag}-h{i}")
            _ip("netns", "add", host.netns)
            made.append(host.netns)
            # Both ends are created inside namespaces: no interface ever appears on this machine's own.
            _ip("-n", bridge_ns, "link", "add", f"port{i}", "type", "veth", "peer", "name", IFNAME,
                "netns", host.netns)
            _ip("-n", bridge_ns, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", IFNAME)
            _ip("-n", host.netns, "link", "set", IFNAME, "up")
            _ip("-n", host.netns, "link", "set", "lo", "up")  # a host reaches its own address through lo
            hosts.append(host)
        yield hosts
    finally:
        for netns in reversed(made):
            _kill_netns(netns)


def _rank_command(rank: int, local_rank: int, env: dict[str, str], argv: Sequence[str], workdir: Path) -> str:
    """A shell line that starts one rank in the background, its output to ``rank<r>.log`` and, once it
    has exited, its exit status to ``rank<r>.rc``."""
    assigned = {**env, "RANK": str(rank), "LOCAL_RANK": str(local_rank)}
    words = ["env", *(f"{k}={v}" for k, v in assigned.items()), *argv, str(workdir / f"rank{rank}.json")]
    log, rc = (shlex.quote(str(workdir / f"rank{rank}.{kind}")) for kind in ("log", "rc"))
    return "{ " + " ".join(shlex.quote(w) for w in words) + f" >{log} 2>&1; echo $? >{rc}; }} &"


def run_ranks(hosts: Sequence[Host], ranks_per_host: int, argv: Sequence[str], *, env: dict[str, str],
              workdir: Path, timeout_s: float) -> list[dict]:
    """Runs ``argv + [report path]`` as ``len(hosts) * ranks_per_host`` ranks, host h holding ranks
    ``h * ranks_per_host ...``, in torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``MASTER_ADDR`` = the first host's address, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME`` = the host's
    interface) plus ``env``; the rest of this process's environment is inherited, without an enclosing
    launcher's variables. Returns each rank's report (the JSON it wrote to its path), by rank.

    Raises TimeoutError naming the ranks that had not exited within ``timeout_s`` (every rank
    process is killed first), RuntimeError with the log of each rank that exited with a non-zero
    status or without a report.
    """
    world = len(hosts) * ranks_per_host
    workdir.mkdir(parents=True, exist_ok=True)
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    port = 29500 if hosts[0].netns is not None else free_port()  # a fresh namespace has every port free
    shells = []
    for h, host in enumerate(hosts):
        shared = {"WORLD_SIZE": str(world), "MASTER_ADDR": hosts[0].ip, "MASTER_PORT": str(port),
                  "GLOO_SOCKET_IFNAME": IFNAME if host.netns is not None else "lo", **env}
        lines = [_rank_command(h * ranks_per_host + i, i, shared, argv, workdir) for i in range(ranks_per_host)]
        script = "\n".join(lines + ["wait"])
        # A session per host: a timeout kills the shell and its ranks as one process group.
        shells.append(subprocess.Popen(host.shell(script), env=base, stdin=subprocess.DEVNULL,
                                       start_new_session=True))
    deadline = time.monotonic() + timeout_s
    try:
        for shell in shells:
            shell.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        missing = [r for r in range(world) if _status(workdir, r) is None]
        raise TimeoutError(f"run_ranks: ranks {missing} did not finish within {timeout_s:g} s; their processes:\n"
                           + describe_sessions([shell.pid for shell in shells]) + "\nlogs:\n"
                           + _logs(workdir, missing)) from None
    finally:
        for shell in shells:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGKILL)
            shell.wait()
        for host in hosts:  # ranks that left the host's process group (none expected)
            if host.netns is not None:
                _kill_processes(host.netns)
    failed = [r for r in range(world) if _status(workdir, r) != "0" or not (workdir / f"rank{r}.json").exists()]
    if failed:
        raise RuntimeError(f"run_ranks: ranks {failed} failed (exit status "
                           f"{[_status(workdir, r) for r in failed]}, or no report); logs:\n" + _logs(workdir, failed))
    return [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]


def _status(workdir: Path, rank: int) -> Optional[str]:
    """Rank ``rank``'s exit status as its shell wrote it, or None while it has not exited."""
    path = workdir / f"rank{rank}.rc"
    return path.read_text().strip() if path.exists() else None


def _logs(workdir: Path, ranks: Sequence[int], tail: int = 3000) -> str:
    parts = []
    for r in ranks:
        path = workdir / f"rank{r}.log"
        text = path.read_text(errors="replace")[-tail:] if path.exists() else "(no log)"
        parts.append(f"--- rank {r} ---\n{text}")
    return "\n".join(parts)

"""The ranks of a ``LocalWorld`` as one ``mpiexec`` job, so that MPI code runs in them.

``mpiexec -n N python -c ...`` starts the ranks; each imports mpi4py (initialising MPI), connects
back to the parent over an authenticated local socket (``multiprocessing.connection``), says which
MPI rank and pid it is, and then serves ``worker.worker_loop`` with MPI rank r as torch rank r.
Like multiprocessing's spawned children, each rank first loads the parent's main script as
``__mp_main__``, so functions defined there can be sent.

MPICH names one segment per host in /dev/shm (``mpich_shm_*``) from ``MPI_Init`` to ``MPI_Finalize``;
a job whose ranks are killed or aborted never unlinks it. Each rank reports the names it maps, and
once the job has ended ``stop`` removes those that no process maps or holds open any more (and the
moe-comm files the ranks held, ``shm_segment.sweep_stale``).
"""
from __future__ import annotations

import os
import pickle
import runpy
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from multiprocessing.connection import Client, Connection, Listener, wait
from pathlib import Path
from typing import Any, Optional

from ..core.native import native
from ..transport.mpi import MPICH_SHM_PREFIX, mapped_mpich_segments
from ..transport.shm_segment import process_gone, sweep_stale
from .worker import worker_loop

__all__ = ["MpiexecRanks", "find_mpiexec", "shm_holders"]

_SHM_DIR = "/dev/shm"


def find_mpiexec() -> str:
    """The ``mpiexec`` beside this Python (where the ``mpich`` wheel puts it), else on PATH."""
    found = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("LocalWorld(launcher='mpiexec'): no mpiexec beside this Python or on PATH; "
                           "pip install 'moe-comm[mpi]' provides MPICH's")
    return found


# NOTES: Connection.send would pickle tensors as handles to shared memory that only processes of
# one multiprocessing family can open; plain pickle sends their bytes.
def _send(conn: Connection, item: Any) -> None:
    conn.send_bytes(pickle.dumps(item))


def _recv(conn: Connection) -> Any:
    return pickle.loads(conn.recv_bytes())


class _Link:
    """``worker_loop``'s task source and result sink over one connection to the parent."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn

    def get(self) -> Any:
        try:
            return _recv(self._conn)
        except (EOFError, OSError):  # the parent is gone: leave like a stopped rank
            return None

    def put(self, item: Any) -> None:
        _send(self._conn, item)


def _main_reference() -> Optional[tuple[str, str]]:
    """How a rank can load this process's ``__main__`` (functions defined in a script pickle as
    ``__main__.name``): ``("path", file)`` or ``("module", name)``, or None (interactive, or ``-m``
    of a package's ``__main__``), as multiprocessing's spawn decides."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None:
        return None if spec.name.endswith("__main__") else ("module", spec.name)
    path = getattr(main, "__file__", None)
    return ("path", os.path.abspath(path)) if path else None


_loading_main = False


def _load_main(reference: Optional[tuple[str, str]]) -> None:
    """Runs the parent's main script or module as ``__mp_main__`` (its ``if __name__ == "__main__"``
    block stays off) and makes it this process's ``__main__``."""
    global _loading_main
    if reference is None:
        return
    kind, target = reference
    module = types.ModuleType("__mp_main__")
    sys.modules["__mp_main__"] = module
    _loading_main = True
    try:
        content = runpy.run_path(target, run_name="__mp_main__") if kind == "path" else \
            runpy.run_module(target, run_name="__mp_main__", alter_sys=True)
    finally:
        _loading_main = False
    module.__dict__.update(content)
    sys.modules["__main__"] = module


def rank_main(address: tuple[str, int], key: str, store_port: int, backend: str, timeout_s: float,
              threads: int, main: Optional[tuple[str, str]]) -> None:
    """The body of one ``mpiexec`` rank (see the module docstring)."""
    from mpi4py import MPI
    _load_main(main)
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    conn = Client(address, authkey=bytes.fromhex(key))
    _send(conn, (rank, os.getpid(), mapped_mpich_segments()))
    worker_loop(rank, size, store_port, backend, timeout_s, threads, {}, _Link(conn), _Link(conn))
    conn.close()


class MpiexecRanks:
    """``world_size`` ranks started by ``mpiexec``, running ``worker_loop`` (a ``worker.Ranks``)."""

    def __init__(self, world_size: int, store_port: int, backend: str, timeout_s: float, threads: int,
                 environ: dict[str, str]) -> None:
        if _loading_main:  # the script starts ranks at import: each rank would start more, forever
            raise RuntimeError("LocalWorld(launcher='mpiexec') was started while an mpiexec rank loaded the main "
                               "script; start it under if __name__ == '__main__':")
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), backlog=world_size, authkey=key)
        code = (f"from moe_comm.launch.mpiexec import rank_main; rank_main({self._listener.address!r}, {key.hex()!r}, "
                f"{store_port}, {backend!r}, {timeout_s!r}, {threads}, {_main_reference()!r})")
        # The ranks import the modules of the functions they are sent, as spawned children do.
        paths = [p for p in sys.path if p and os.path.isdir(p)]
        env = {**os.environ, **environ, "PYTHONPATH": os.pathsep.join(paths)}
        # Without auto-cleanup a rank that exits leaves the others running, as spawned children do,
        # so that they can report what they saw.
        command = [find_mpiexec(), "-disable-auto-cleanup", "-n", str(world_size), sys.executable, "-c", code]
        self._conns: list[Optional[Connection]] = [None] * world_size
        self._pids = [0] * world_size
        self._segments: set[str] = set()  # the MPICH segments the ranks reported
        self._started = time.time()
        self._job = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._accept(world_size, timeout_s)
        except BaseException:
            self.stop(force=True)
            raise

    def _accept(self, world_size: int, timeout_s: float) -> None:
        """Takes each rank's connection, within ``timeout_s`` and while the job runs."""
        accepted: list[Connection] = []
        failure: list[BaseException] = []

        def take() -> None:
            try:
                while len(accepted) < world_size:
                    accepted.append(self._listener.accept())
            except OSError as exc:  # the listener was closed: given up on
                failure.append(exc)

        taker = threading.Thread(target=take, daemon=True)
        taker.start()
        deadline = time.monotonic() + timeout_s
        while taker.is_alive() and time.monotonic() < deadline and self._job.poll() is None:
            taker.join(0.05)
        if taker.is_alive() or failure:
            self._listener.close()
            code = self._job.poll()
            state = f"exited with code {code}" if code is not None else f"did not connect within {timeout_s:g} s"
            raise RuntimeError(f"LocalWorld(launcher='mpiexec'): {len(accepted)} of {world_size} ranks connected; "
                               f"the mpiexec job {state}")
        for conn in accepted:
            rank, pid, segments = _recv(conn)
            self._conns[rank], self._pids[rank] = conn, pid
            self._segments.update(segments)

    def send(self, rank: int, task: Any) -> None:
        conn = self._conns[rank]
        if conn is not None:
            try:
                _send(conn, task)
            except OSError:  # the rank is gone; alive() says so
                self._conns[rank] = None

    def receive(self, timeout_s: float) -> Optional[tuple[int, bool, Any]]:
        for conn in wait([c for c in self._conns if c is not None], timeout_s):
            try:
                return _recv(conn)
            except (EOFError, OSError):
                self._conns[self._conns.index(conn)] = None
        return None

    def alive(self, rank: int) -> bool:
        return self._conns[rank] is not None and self._job.poll() is None and native().process_alive(self._pids[rank])

    def stop(self, force: bool) -> None:
        for rank in range(len(self._conns)):
            self.send(rank, None)
        try:
            self._job.wait(timeout=0.1 if force else 10)
        except subprocess.TimeoutExpired:
            os.killpg(self._job.pid, signal.SIGKILL)
            self._job.wait()
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._conns = [None] * len(self._conns)
        self._listener.close()
        self._remove_segments()

    def _remove_segments(self) -> None:
        """After the job: unlinks its MPICH segments that no visible process maps or holds open (a
        job that ended normally has unlinked them itself), and sweeps moe-comm's files. When a rank
        never reported (killed while starting), the job's segment is found by its time instead: an
        ``mpich_shm_*`` created while the job ran that nothing holds."""
        deadline = time.monotonic() + 5.0  # the ranks end with mpiexec; wait for their last threads
        for pid in self._pids:
            while pid and not process_gone(pid) and time.monotonic() < deadline:
                time.sleep(0.01)
        sweep_stale()
        scanned = time.time()
        holders, unread = shm_holders()
        names = set(self._segments)
        if 0 in self._pids and unread <= _ancestors():  # (an ancestor maps none of a job it started)
            names.update(n for n in _created_between(MPICH_SHM_PREFIX, self._started - 1.0, scanned))
        for name in sorted(names - set(holders)):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
            except OSError:  # gone meanwhile, or not ours
                pass
        self._segments.clear()


def _created_between(prefix: str, start: float, end: float) -> list[str]:
    """Names in /dev/shm starting with ``prefix`` whose inode changed (created) in [start, end)."""
    found = []
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return found
    for name in names:
        if name.startswith(prefix):
            try:
                if start <= os.stat(os.path.join(_SHM_DIR, name), follow_symlinks=False).st_ctime < end:
                    found.append(name)
            except OSError:
                pass
    return found


def shm_holders() -> tuple[dict[str, set[int]], set[int]]:
    """``({name: pids}, unreadable)``: the entries of /dev/shm that visible processes map or hold
    open, and the pids whose maps or descriptors could not be read. Matched by inode, so a mapping
    made through another name of the file (glibc's semaphores map a temporary name) counts too."""
    try:
        shm_dev = os.stat(_SHM_DIR).st_dev
        inodes = {os.stat(os.path.join(_SHM_DIR, n), follow_symlinks=False).st_ino: n for n in os.listdir(_SHM_DIR)}
    except OSError:
        return {}, set()
    device = f"{os.major(shm_dev):02x}:{os.minor(shm_dev):02x}"
    holders: dict[str, set[int]] = {}
    unreadable: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid, held = int(entry), set()
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    st = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if st.st_dev == shm_dev:
                    held.add(st.st_ino)
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[3] == device:
                        held.add(int(fields[4]))
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile (reaped after its maps were opened: ESRCH)
            continue
        except PermissionError:
            unreadable.add(pid)
        for ino in held:
            if ino in inodes:
                holders.setdefault(inodes[ino], set()).add(pid)
    return holders, unreadable


def _ancestors() -> set[int]:
    """Pids of this process's parent, its parent, ... up to pid 1."""
    found, pid = set(), os.getppid()
    while pid > 0 and pid not in found:
        found.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return found

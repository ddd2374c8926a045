"""The rank side of a ``LocalWorld``, whichever launcher started the rank: ``worker_loop`` and the
``Ranks`` interface through which ``LocalWorld`` drives a launcher's ranks."""
from __future__ import annotations

import datetime
import os
import traceback
from typing import Any, Optional, Protocol

import torch
import torch.distributed as dist

__all__ = ["Ranks", "worker_loop"]


class Ranks(Protocol):
    """A launcher's ``world_size`` ranks, each running ``worker_loop``, as ``LocalWorld`` drives them."""

    def send(self, rank: int, task: Any) -> None:
        """Queues ``(fn, args)`` for ``rank``, or None to make it leave its group and exit."""

    def receive(self, timeout_s: float) -> Optional[tuple[int, bool, Any]]:
        """The next ``(rank, ok, value or traceback)`` of any rank, or None after ``timeout_s``."""

    def alive(self, rank: int) -> bool:
        """Whether ``rank``'s process still runs."""

    def stop(self, force: bool) -> None:
        """Ends every rank: idle ones leave their group; the rest (all of them when ``force``) are killed."""


def worker_loop(rank: int, world_size: int, store_port: int, backend: str, timeout_s: float, threads: int,
                environ: dict[str, str], tasks: Any, results: Any) -> None:
    """One rank of a ``LocalWorld``: joins the process group through the parent's store, then runs
    ``(fn, args)`` from ``tasks.get()`` until it gets None, putting ``(rank, ok, value or traceback)``
    into ``results``."""
    os.environ.update(environ)
    os.environ.setdefault("MOE_COMM_NUM_THREADS", str(threads))
    torch.set_num_threads(threads)
    if backend == "nccl":  # one GPU per rank, as torchrun users do with LOCAL_RANK
        torch.cuda.set_device(rank % torch.cuda.device_count())
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
    group = dist.group.WORLD
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(group, *args)))
        except BaseException:  # reported to the parent with the traceback
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()

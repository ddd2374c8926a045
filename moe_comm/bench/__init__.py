"""moe-comm's benchmarks, shipped with the package: ``python -m moe_comm.bench NAME [options]`` or
``moe-comm-bench NAME [options]``.

    normal       normal-mode dispatch/combine on every transport, the naive all-gather / reduce-scatter,
                 the raw all-to-all (gloo; MPI_Alltoallv under MPI) and the memory-copy floor
    low_latency  low-latency dispatch/combine, BF16 and FP8, with and without hooks, overlap with compute
    moe          the EP-MoE layer in every mode: communication alone, compute alone, overlap
    ops          the fused MoE ops against torch baselines and the device's copy and matmul ceilings

Each prints its tables, writes a JSON record (``--json``; default ``./moe_comm_bench_out/NAME.json``)
and, with ``--plot PATH`` (``pip install 'moe-comm[plot]'``), draws latency and bandwidth against
tokens per rank (``--tokens`` takes several counts). The distributed ones start their own ranks
(``--ranks N``) or run on a launcher's: ``torchrun --nproc-per-node N -m moe_comm.bench NAME``,
``mpirun -n N python -m moe_comm.bench NAME``.
"""
from __future__ import annotations

__all__ = ["BENCHMARKS"]

#: benchmark name -> the module of this package whose ``main(argv, prog)`` runs it
BENCHMARKS = {"normal": "normal", "low_latency": "low_latency", "moe": "moe", "ops": "ops"}

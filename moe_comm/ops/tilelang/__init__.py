"""TileLang tile programs of ``moe_comm.ops``, one module per op, written once for every TileLang target.

These modules import only ``tilelang`` (no torch, no moe_comm). Each builds a ``T.prim_func`` for a
``Dialect`` (``dialect.py``): the CPU build (target ``c``, TileLang's ``tilelang.cpu.language``) and the
CUDA build (sm_90/sm_100) differ only where the dialects force it: thread bindings, where a tile is staged
(shared memory and register fragments on a GPU, plain buffers on the CPU), and how a narrow float is stored
(the C target has no bf16 or FP8 types, so the CPU build keeps their bits in integers and converts with
integer arithmetic, ``codec.py``). ``build.py`` compiles a program for a target, once per process and shape.
The typed wrappers that launch them live in ``moe_comm.ops`` (``moe_comm/ops/tilelang_launch.py``).
"""

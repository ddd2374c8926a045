"""The NVIDIA backends: DeepEP-class kernels from ``csrc/cuda``, whose protocol headers compile for
the GPU (``moe_comm._cuda``) and for the host (``moe_comm._cuda_host``).

``cuda_host`` (``backend.py``) runs the host build on CPU tensors, ranks of one host sharing memory,
so every multi-rank test runs the kernels' own protocol code on the CPU. ``cuda``
(``device_backend.py``) runs the device build on the GPUs of one node over CUDA IPC: compiled, never
run on a GPU. Nothing here is imported
by ``moe_comm`` itself (``backends/__init__.py`` imports the backend class when a Buffer is built).
"""

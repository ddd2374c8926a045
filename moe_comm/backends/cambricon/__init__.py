"""The ``cambricon`` backend: Cambricon MLUs through ``torch_mlu`` (CNCL) and ``torch_mlu_ops``'
expert-parallel all-to-all. ``backend.py`` holds the backend, ``tmo.py`` the all-to-all's use,
``low_latency.py`` the low-latency mode on it."""

"""The ``ascend`` backend: Huawei Ascend NPUs through ``torch_npu`` (HCCL, MC2). ``backend.py`` holds the
backend, ``mc2.py`` the operators' limits and argument mapping, ``low_latency.py`` the layout conversion."""

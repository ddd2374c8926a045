"""``torch_npu.npu`` as the model answers it: one device, whose name says which Atlas product it is
(``TORCH_NPU_MODEL_DEVICE``, default an Atlas A2 name)."""
from __future__ import annotations

import os


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def get_device_name(device: int = 0) -> str:
    return os.environ.get("TORCH_NPU_MODEL_DEVICE", "Ascend910B3")

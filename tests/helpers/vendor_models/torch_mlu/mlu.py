"""``torch_mlu.mlu`` as the model answers it: one device."""


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1

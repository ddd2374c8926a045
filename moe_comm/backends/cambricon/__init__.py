"""The ``cambricon`` backend: Cambricon MLUs through ``torch_mlu`` (CNCL). ``backend.py`` holds it."""

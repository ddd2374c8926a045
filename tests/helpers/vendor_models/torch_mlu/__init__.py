"""A CPU model of what the cambricon backend asks of ``torch_mlu``: that it imports and sees an MLU
(``torch_mlu.mlu.is_available()``). The tests put this folder first on ``sys.path`` inside their rank
processes only; the backend's collectives then run on the gloo group the test gives it, and the
all-to-all on ``torch_mlu_ops``' model beside this one."""
from . import mlu

__version__ = "1.24.0.model"
__all__ = ["mlu"]

"""NumPy/CuPy-generic reference kernels; importing this registers them as `reference`."""
from . import activation, attention, dropout, elementwise, fp8, linear, loss  # noqa: F401
from . import normalization, softmax  # noqa: F401

"""NumPy/CuPy-generic reference kernels; importing this registers them as `reference`."""
from . import activation, attention, colsum, dropout, elementwise, fp8, linear  # noqa: F401
from . import inspect  # noqa: F401
from . import loss, normalization, softmax  # noqa: F401
from . import embedding, rope  # noqa: F401
from . import block_scaling  # noqa: F401

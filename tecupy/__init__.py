"""tecupy: Transformer Engine's FP8 training blocks on CuPy (and NumPy), in Python.

Functional ops take plain numpy or cupy arrays; `Tape` records them for backward;
`fp8_autocast` runs the linear-type ops in FP8 with Transformer Engine's delayed scaling.
"""
from . import reference  # noqa: F401  (registers the reference backend)
from . import kernels  # noqa: F401  (registers the cuda backend; compiles lazily)
from . import backends, fp8, recipe  # noqa: F401
from ._array import bfloat16, gpu_available  # noqa: F401
from .autocast import autocast, fp8_autocast  # noqa: F401
from .fp8_state import FP8State  # noqa: F401
from .fp8 import FP8Tensor, dequantize, quantize  # noqa: F401
from .fp8_params import FP8Weight, quantized_model_init  # noqa: F401
from .ops import (activation, add, add_bias, cross_entropy, dot_product_attention, dropout,  # noqa: F401
                  geglu, gelu, layernorm, layernorm_linear, layernorm_mlp, linear, relu,
                  reshape, rmsnorm, softmax, split, swiglu)
from .ops import apply_rotary_pos_emb, embedding  # noqa: F401
from .tape import Tape  # noqa: F401
from .graphs import make_graphed_step  # noqa: F401
from . import gemm  # noqa: F401,E402  (tecupy.gemm.tune)
from . import nn  # noqa: F401,E402
from .checkpoint import checkpoint  # noqa: F401,E402
from . import optim  # noqa: F401,E402  (tecupy.optim.AdamW, SGD, WarmupCosine)
from . import inspect  # noqa: F401,E402  (tecupy.inspect.FP8Inspector)
from .serialization import load, save  # noqa: F401,E402

__version__ = "0.1.0"

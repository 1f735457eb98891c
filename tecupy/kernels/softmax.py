"""CUDA scaled, masked softmax and its backward: cuda/softmax.cu."""
import numpy as np

from .. import backends, loader
from .._array import is_cupy
from .common import CTYPE, LOW_PRECISION, cbool

FILE = "softmax.cu"
_TYPES = [CTYPE[d] for d in LOW_PRECISION]
loader.declare(FILE, [f"softmax_fwd<{t}, {m}>" for t in _TYPES for m in ("false", "true")]
               + [f"softmax_bwd<{t}>" for t in _TYPES])


def supported(x, *args):
    return is_cupy(x) and x.dtype in LOW_PRECISION and x.ndim >= 1 and x.shape[-1] < 2**31


@backends.register("softmax_fwd", "cuda", supports=supported)
def softmax_fwd(x, scale, mask, causal):
    import cupy
    x = cupy.ascontiguousarray(x)
    sk = x.shape[-1]
    sq = x.shape[-2] if x.ndim >= 2 else 1
    rows = x.size // max(sk, 1)
    m = x if mask is None else cupy.ascontiguousarray(cupy.broadcast_to(mask, x.shape),
                                                      np.bool_).view(np.uint8)
    y = cupy.empty_like(x)
    k = loader.function(FILE, f"softmax_fwd<{CTYPE[x.dtype]}, {cbool(mask is not None)}>")
    if rows and sk:
        k((rows,), (128,), (x, m, y, np.int32(sq), np.int32(sk), np.float32(scale),
          np.int32(causal)))
    return y


@backends.register("softmax_bwd", "cuda", supports=supported)
def softmax_bwd(dy, y, scale):
    import cupy
    dy, y = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(y)
    sk = y.shape[-1]
    rows = y.size // max(sk, 1)
    dx = cupy.empty_like(y)
    k = loader.function(FILE, f"softmax_bwd<{CTYPE[y.dtype]}>")
    if rows and sk:
        k((rows,), (128,), (dy, y, dx, np.int32(sk), np.float32(scale)))
    return dx

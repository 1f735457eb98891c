"""CUDA gelu / relu / swiglu / geglu, forward and backward: cuda/act.cu."""
import itertools

import numpy as np

from .. import backends, loader
from .._array import is_cupy
from .common import CTYPE, LOW_PRECISION, grid_1d, vec_width

FILE = "act.cu"
ACT_ID = {"gelu": 0, "relu": 1, "swiglu": 2, "geglu": 0}  # gated ones: silu / gelu of a
_TYPES = [CTYPE[d] for d in LOW_PRECISION]
loader.declare(FILE, [f"{k}<{t}, {v}, {a}>" for k, t, v, a in itertools.product(
    ("act_fwd", "act_bwd", "gated_fwd", "gated_bwd"), _TYPES, (1, 4, 8), (0, 1, 2))
    if not (t == "float" and v == 8)])


def supported(x, *args):
    return is_cupy(x) and x.dtype in LOW_PRECISION


def _launch(kernel_name, name, n_last, total, args, dtype):
    vec = vec_width(dtype, n_last)
    k = loader.function(FILE, f"{kernel_name}<{CTYPE[dtype]}, {vec}, {ACT_ID[name]}>")
    if total:
        k((grid_1d(total, vec),), (256,), args)


def _plain(name):
    @backends.register(f"{name}_fwd", "cuda", supports=supported)
    def fwd(x):
        import cupy
        x = cupy.ascontiguousarray(x)
        y = cupy.empty_like(x)
        _launch("act_fwd", name, x.size, x.size, (x, y, np.int64(x.size)), x.dtype)
        return y

    @backends.register(f"{name}_bwd", "cuda", supports=supported)
    def bwd(dy, x):
        import cupy
        dy, x = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(x)
        dx = cupy.empty_like(x)
        _launch("act_bwd", name, x.size, x.size, (dy, x, dx, np.int64(x.size)), x.dtype)
        return dx


def _gated(name):
    @backends.register(f"{name}_fwd", "cuda", supports=supported)
    def fwd(x):
        import cupy
        x = cupy.ascontiguousarray(x)
        n = x.shape[-1] // 2
        rows = x.size // max(2 * n, 1)
        y = cupy.empty(x.shape[:-1] + (n,), x.dtype)
        _launch("gated_fwd", name, n, rows * n, (x, y, np.int64(rows), np.int32(n)), x.dtype)
        return y

    @backends.register(f"{name}_bwd", "cuda", supports=supported)
    def bwd(dy, x):
        import cupy
        dy, x = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(x)
        n = x.shape[-1] // 2
        rows = x.size // max(2 * n, 1)
        dx = cupy.empty_like(x)
        _launch("gated_bwd", name, n, rows * n, (dy, x, dx, np.int64(rows), np.int32(n)),
                x.dtype)
        return dx


for _name in ("gelu", "relu"):
    _plain(_name)
for _name in ("swiglu", "geglu"):
    _gated(_name)

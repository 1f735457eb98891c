"""CUDA dropout (Philox) fused with the residual add, and the plain add: cuda/dropout.cu."""
import itertools

import numpy as np

from .. import backends, loader
from .._array import row_of
from ..graphs import seed_pointer
from .dtypes import CTYPE, LOW_PRECISION, cbool, on_gpu_low_precision
from .launch import MANY_BLOCKS, grid_1d, launch

FILE = "dropout.cu"
_TYPES = [CTYPE[d] for d in LOW_PRECISION]
loader.declare(FILE, [f"dropout_fwd<{t}, {v}, {r}>" for t, v, r in itertools.product(
    _TYPES, (1, 4), ("false", "true"))] + [f"dropout_bwd<{t}, {v}>" for t, v in
                                           itertools.product(_TYPES, (1, 4))]
               + [f"add<{t}, {v}, {r}, {res}>" for t in _TYPES
                  for v in ((1, 4) if t == "float" else (1, 4, 8)) for r in ("false", "true")
                  for res in ("false", "true")])


supported = on_gpu_low_precision


def _factor(p):
    return np.float32(0 if p >= 1 else 1 / (1 - p))  # rounded as the reference rounds it


@backends.register("dropout_fwd", "cuda", supports=supported)
def dropout_fwd(x, p, seed, offset, residual=None):
    import cupy
    x = cupy.ascontiguousarray(x)
    res = x if residual is None else cupy.ascontiguousarray(residual)
    y, keep = cupy.empty(x.shape, x.dtype), cupy.empty(x.shape, np.uint8)
    vec = 4 if x.size % 4 == 0 else 1
    k = loader.function(FILE, f"dropout_fwd<{CTYPE[x.dtype]}, {vec}, "
                              f"{cbool(residual is not None)}>")
    if x.size:
        launch(k, (grid_1d(x.size, vec, 256, MANY_BLOCKS),), (256,),
               (x, res, y, keep, np.int64(x.size), np.float32(p), _factor(p),
                np.uint64(seed), seed_pointer(seed), np.uint64(offset)))  # [0, 2**64)
    return y, keep.view(np.bool_)


@backends.register("dropout_bwd", "cuda", supports=supported)
def dropout_bwd(dy, keep, p):
    import cupy
    dy, keep = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(keep).view(np.uint8)
    dx = cupy.empty(dy.shape, dy.dtype)
    vec = 4 if dy.size % 4 == 0 else 1
    k = loader.function(FILE, f"dropout_bwd<{CTYPE[dy.dtype]}, {vec}>")
    if dy.size:
        launch(k, (grid_1d(dy.size, vec, 256, MANY_BLOCKS),), (256,),
               (dy, keep, dx, np.int64(dy.size), _factor(p)))
    return dx


def _supports_add(a, b, residual=None):
    return (supported(a) and getattr(b, "dtype", None) == a.dtype and type(b) is type(a)
            and (b.shape == a.shape or row_of(a, b))
            and (residual is None or (type(residual) is type(a) and residual.dtype == a.dtype
                                      and residual.shape == a.shape)))


@backends.register("add_fwd", "cuda", supports=_supports_add)
def add_fwd(a, b, residual=None):
    """a + b in one pass (16-byte loads where the sizes allow): b of a's shape, or a row of
    a's last dimension broadcast over its rows (row_of: a bias after a tensor-parallel
    reduction); then + residual (a's shape), rounded as a second add would round it."""
    import cupy
    a, b = cupy.ascontiguousarray(a), cupy.ascontiguousarray(b)
    r = a if residual is None else cupy.ascontiguousarray(residual)
    y = cupy.empty(a.shape, a.dtype)  # (a contiguous: empty_like costs ~2x on the host)
    row = b.size != a.size
    vec = next(v for v in (16 // a.itemsize, 4, 1) if a.size % v == 0 and b.size % v == 0)
    if a.size:
        k = loader.function(FILE, f"add<{CTYPE[a.dtype]}, {vec}, {cbool(row)}, "
                                  f"{cbool(residual is not None)}>")
        launch(k, (grid_1d(a.size, vec, 256, MANY_BLOCKS),), (256,),
               (a, b, r, y, np.int64(a.size), np.int64(b.size)))
    return y

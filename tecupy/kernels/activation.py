"""CUDA gelu / relu / swiglu / geglu, forward and backward, with an optional bias and an
optional FP8 output: cuda/act.cu."""
import itertools

import numpy as np

from .. import backends, loader
from .common import (CTYPE, FP8TYPE, MANY_BLOCKS, amax_args, amax_grid, cbool, grid_1d, launch,
                     on_gpu_low_precision, vec_width)

FILE = "act.cu"
ACT_ID = {"gelu": 0, "relu": 1, "swiglu": 2, "geglu": 0}  # gated ones: silu / gelu of a
_VECS = {"float": (1, 4), "__half": (1, 8), "__nv_bfloat16": (1, 8)}
_B = ("false", "true")


def _names():
    for t, a, bias in itertools.product(_VECS, (0, 1, 2), _B):
        for v in _VECS[t]:
            for out in (t,) + tuple(FP8TYPE.values()):
                yield from (f"act_fwd<{t}, {v}, {a}, {out}, {bias}>",
                            f"gated_fwd<{t}, {v}, {a}, {out}, {bias}>")
            yield from (f"act_bwd<{t}, {v}, {a}, {bias}>", f"gated_bwd<{t}, {v}, {a}, {bias}>")
    for t in _VECS:
        yield f"col_sum<{t}, float>"


loader.declare(FILE, list(_names()))


supported = on_gpu_low_precision


def _kernel(prefix, name, x, vec, out=None, bias=None):
    types = f"{CTYPE[x.dtype]}, {vec}, {ACT_ID[name]}"
    if out is not None:
        types += f", {out}"
    return loader.function(FILE, f"{prefix}<{types}, {cbool(bias is not None)}>")


def _aligned(bias):
    """bias, contiguous and 16-byte aligned (the kernels load it by vectors)."""
    import cupy
    bias = cupy.ascontiguousarray(bias)
    return bias if bias.data.ptr % 16 == 0 else bias.copy()


def dbias(dx2):
    """Column sums of dx2 [rows, ncols] in float32: per-split partials, then their sum."""
    import cupy
    rows, ncols = dx2.shape
    splits = int(max(1, min(64, rows // 256)))
    per = -(-rows // splits)
    part = cupy.empty((splits, ncols), np.float32)
    k = loader.function(FILE, f"col_sum<{CTYPE[dx2.dtype]}, float>")
    k((-(-ncols // 32), splits), (32, 8), (dx2, part, np.int64(rows), np.int32(ncols),
      np.int64(per)))
    return col_sum(part)


def col_sum(part):
    """The float32 column sums of a float32 matrix of partial sums [splits, ncols]."""
    import cupy
    splits, ncols = part.shape
    out = cupy.empty((1, ncols), np.float32)
    k = loader.function(FILE, "col_sum<float, float>")
    k((-(-ncols // 32), 1), (32, 8), (part, out, np.int64(splits), np.int32(ncols),
      np.int64(splits)))
    return out[0]


@backends.register("bias_grad", "cuda", supports=lambda dy2, out_dtype: supported(dy2))
def bias_grad(dy2, out_dtype):
    """dbias of a linear: the float32 column sums of dy2 [rows, N] (no float32 copy of dy)."""
    import cupy
    dy2 = cupy.ascontiguousarray(dy2)
    if not dy2.size:
        return cupy.zeros(dy2.shape[1:], out_dtype)
    return dbias(dy2).astype(out_dtype, copy=False)


def _fwd(name, gated, x, bias, scale, fmt, amax_out=None):
    import cupy
    x = cupy.ascontiguousarray(x)
    n = x.shape[-1] // 2 if gated else x.shape[-1]
    rows = x.size // max(x.shape[-1], 1)
    y = cupy.empty(x.shape[:-1] + (n,), np.uint8 if fmt else x.dtype)
    # amax only for an FP8 output (the kernels read scale, amax and slot then only)
    amax, slot = amax_args(amax_out, rows * n) if fmt else (y, y)
    vec = vec_width(x.dtype, n)
    k = _kernel("gated_fwd" if gated else "act_fwd", name, x, vec,
                FP8TYPE[fmt.name] if fmt else CTYPE[x.dtype], bias)
    b = x if bias is None else _aligned(bias)
    s = amax if scale is None else scale
    if rows * n:
        shape = (np.int64(rows), np.int32(n)) if gated else (np.int64(x.size), np.int32(n))
        # gated: two streams (its a and b halves) take many blocks; plain ones the default;
        # an FP8 output (grid_amax) the resident blocks only
        grid = (amax_grid(k, rows * n, vec) if fmt else
                grid_1d(rows * n, vec, 256, MANY_BLOCKS) if gated else grid_1d(rows * n, vec))
        launch(k, (grid,), (256,), (x, b, y) + shape + (s, amax, slot))
    return (y, amax) if fmt else y


def _bwd(name, gated, dy, x, bias):
    import cupy
    dy, x = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(x)
    n = x.shape[-1] // 2 if gated else x.shape[-1]
    rows = x.size // max(x.shape[-1], 1)
    dx = cupy.empty_like(x)
    vec = vec_width(x.dtype, n)
    k = _kernel("gated_bwd" if gated else "act_bwd", name, x, vec, bias=bias)
    b = x if bias is None else _aligned(bias)
    if rows * n:
        shape = (np.int64(rows), np.int32(n)) if gated else (np.int64(x.size), np.int32(n))
        launch(k, (grid_1d(rows * n, vec, 256, MANY_BLOCKS),), (256,), (dy, x, b, dx) + shape)
    if bias is None:
        return dx, None
    db = dbias(dx.reshape(rows, x.shape[-1])) if rows else cupy.zeros(bias.shape, np.float32)
    return dx, db.astype(bias.dtype)


def _register(name, gated):
    backends.register(f"{name}_fwd", "cuda", supports=supported)(
        lambda x, bias=None, scale=None, fmt=None, amax_out=None:
        _fwd(name, gated, x, bias, scale, fmt, amax_out))
    backends.register(f"{name}_bwd", "cuda", supports=supported)(
        lambda dy, x, bias=None: _bwd(name, gated, dy, x, bias))


for _name in ("gelu", "relu"):
    _register(_name, False)
for _name in ("swiglu", "geglu"):
    _register(_name, True)

"""CUDA activations (the rows of tecupy/activation_table.py), forward and backward, with an
optional bias and an optional FP8 output: cuda/act.cu. dbias: kernels/colsum.py."""
import itertools

import numpy as np

from .. import backends, loader
from ..activation_table import TABLE
from .colsum import dbias
from .dtypes import CTYPE, FP8TYPE, cbool, on_gpu_low_precision, vec_width
from .launch import MANY_BLOCKS, Launcher, grid_1d, planned
from .pools import amax_args, amax_grid

FILE = "act.cu"
_VECS = {"float": (1, 4), "__half": (1, 8), "__nv_bfloat16": (1, 8)}
_B = ("false", "true")


def _names():
    """Per row: its kernels (gated_* or act_*) with its struct of act_math.cuh, for each
    dtype, vector width, bias or not and output (x's dtype or an FP8 format)."""
    for a, t, bias in itertools.product(TABLE.values(), _VECS, _B):
        kind = "gated" if a.gated else "act"
        for v in _VECS[t]:
            for out in (t,) + tuple(FP8TYPE.values()):
                yield f"{kind}_fwd<{t}, {v}, {a.cuda}, {out}, {bias}>"
            yield f"{kind}_bwd<{t}, {v}, {a.cuda}, {bias}>"


loader.declare(FILE, list(_names()))


supported = on_gpu_low_precision


def _aligned(bias):
    """bias, contiguous and 16-byte aligned (the kernels load it by vectors)."""
    import cupy
    bias = cupy.ascontiguousarray(bias)
    return bias if bias.data.ptr % 16 == 0 else bias.copy()


def _fwd(name, gated, x, bias, scale, fmt, amax_out=None):
    import cupy
    x = cupy.ascontiguousarray(x)
    n = x.shape[-1] // 2 if gated else x.shape[-1]
    rows = x.size // max(x.shape[-1], 1)
    y = cupy.empty(x.shape[:-1] + (n,), np.uint8 if fmt else x.dtype)
    # amax only for an FP8 output (the kernels read scale, amax and slot then only)
    amax, slot = amax_args(amax_out, rows * n) if fmt else (y, y)
    if rows * n:
        run, shape = _plan("fwd", name, rows, n, x.dtype, fmt and fmt.name, bias is not None)
        run((x, x if bias is None else _aligned(bias), y) + shape
            + (amax if scale is None else scale, amax, slot))
    return (y, amax) if fmt else y


def _bwd(name, gated, dy, x, bias, out=None):
    """out: where dx goes (None: a new array); may be dy itself (plain activations)."""
    import cupy
    dy, x = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(x)
    n = x.shape[-1] // 2 if gated else x.shape[-1]
    rows = x.size // max(x.shape[-1], 1)
    dx = cupy.empty(x.shape, x.dtype) if out is None else _out(out, x)
    if rows * n:
        run, shape = _plan("bwd", name, rows, n, x.dtype, None, bias is not None)
        run((dy, x, x if bias is None else _aligned(bias), dx) + shape)
    if bias is None:
        return dx, None
    if not rows:
        return dx, cupy.zeros(bias.shape, bias.dtype)
    return dx, dbias(dx.reshape(rows, x.shape[-1]), bias.dtype)  # (in bias's type: no astype)


_plans = {}  # launch plans (launch.planned): kernel, grid and sizes per call shape


def _plan(way, name, rows, n, dtype, fmt, bias):
    """(Launcher, the kernel's sizes: rows and n for gated rows, else all elements and n) of
    the activation `name`'s forward (`way` "fwd": output of x's dtype, or of FP8 format
    `fmt`) or backward ("bwd") over `rows` rows of `n` outputs, with a bias or not."""
    import cupy
    key = (way, name, rows, n, dtype, fmt, bias, cupy.cuda.runtime.getDevice(), MANY_BLOCKS)
    return planned(_plans, key, _choose, way, name, rows, n, dtype, fmt, bias)


def _choose(way, name, rows, n, dtype, fmt, bias):
    import cupy
    gated, vec = TABLE[name].gated, vec_width(dtype, n)
    types = f"{CTYPE[dtype]}, {vec}, {TABLE[name].cuda}"
    if way == "fwd":
        types += f", {FP8TYPE[fmt] if fmt else CTYPE[dtype]}"
    k = loader.function(FILE, f"{'gated' if gated else 'act'}_{way}<{types}, {cbool(bias)}>")
    nd = cupy.ndarray
    if way == "fwd":  # x, bias (or x), y, sizes, scale (or amax), amax, slot (or y)
        kinds = (nd, nd, nd, np.int64, np.int32, nd, nd, np.uint64)
        # gated: two streams (its a and b halves) take many blocks; plain ones the default;
        # an FP8 output (grid_amax) the resident blocks only
        grid = (amax_grid(k, rows * n, vec) if fmt else
                grid_1d(rows * n, vec, 256, MANY_BLOCKS) if gated else grid_1d(rows * n, vec))
    else:  # dy, x, bias (or x), dx, sizes
        kinds = (nd, nd, nd, nd, np.int64, np.int32)
        grid = grid_1d(rows * n, vec, 256, MANY_BLOCKS)
    size = rows if gated else rows * n  # (plain: x.size)
    return Launcher(k, (grid,), (256,), kinds), (np.int64(size), np.int32(n))


def _out(out, x):
    if out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise ValueError(f"activation backward: out must be a contiguous {x.dtype} array of "
                         f"shape {x.shape} (x's), got {out.dtype} {out.shape}")
    return out


def _register(name, gated):
    backends.register(f"{name}_fwd", "cuda", supports=supported)(
        lambda x, bias=None, scale=None, fmt=None, amax_out=None:
        _fwd(name, gated, x, bias, scale, fmt, amax_out))
    backends.register(f"{name}_bwd", "cuda", supports=supported)(
        lambda dy, x, bias=None, out=None: _bwd(name, gated, dy, x, bias, out))


for _a in TABLE.values():
    _register(_a.name, _a.gated)

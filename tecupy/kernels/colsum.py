"""CUDA column sums in float32, the bias gradients: cuda/colsum.cu. dbias of a linear
(bias_grad), of an activation with a bias (kernels/activation.py) and the second stage of
cast_transpose_dbias (kernels/cast.py, whose cast kernel writes the partial sums). The sums'
second stage writes them in the caller's type (float32 sums rounded once, as astype
rounds them): no cast launch after it."""
import numpy as np

from .. import backends, loader
from .dtypes import CTYPE, on_gpu_low_precision
from .launch import Launcher, planned

FILE = "colsum.cu"
loader.declare(FILE, [f"col_sum<{t}, float>" for t in ("float", "__half", "__nv_bfloat16")]
               + [f"col_sum<float, {t}>" for t in ("double", "__half", "__nv_bfloat16")])
_F32 = np.dtype(np.float32)
_plans = {}  # launch plans (launch.planned) of both stages, by stage, shape, types, device


def dbias(dx2, out_dtype=_F32):
    """Column sums of dx2 [rows, ncols] in float32, rounded to out_dtype: per-split float32
    partials, then their sum."""
    import cupy
    rows, ncols = dx2.shape
    run, splits, args = planned(
        _plans, ("parts", rows, ncols, dx2.dtype, cupy.cuda.runtime.getDevice()), _split_plan,
        rows, ncols, dx2.dtype)
    part = cupy.empty((splits, ncols), np.float32)
    run((dx2, part) + args)
    return col_sum(part, out_dtype)


def col_sum(part, out_dtype=_F32):
    """The column sums [ncols] of a float32 matrix of partial sums [splits, ncols]: summed in
    float32, then rounded once to out_dtype (nearest even), bit for bit astype's result."""
    import cupy
    splits, ncols = part.shape
    plan = planned(_plans, ("sum", splits, ncols, out_dtype, cupy.cuda.runtime.getDevice()),
                   _sum_plan, splits, ncols, out_dtype)
    if plan is None:  # a type the kernel does not write: the float32 sums cast
        return col_sum(part).astype(out_dtype)
    run, args = plan
    out = cupy.empty((ncols,), out_dtype)  # (1-D: split 0's row, no view to make)
    run((part, out) + args)
    return out


def _launcher(in_dtype, out_dtype, ncols, splits):
    """The Launcher of col_sum<in, out> over `splits` splits of ncols columns."""
    import cupy
    k = loader.function(FILE, f"col_sum<{CTYPE[in_dtype]}, {CTYPE[out_dtype]}>")
    kinds = (cupy.ndarray, cupy.ndarray, np.int64, np.int32, np.int64)  # x, out, rows, ncols,
    return Launcher(k, (-(-ncols // 32), splits), (32, 8), kinds)       # rows per split


def _split_plan(rows, ncols, dtype):
    """(Launcher, splits, the scalar arguments) of the first stage: up to 64 splits of at
    least 256 rows."""
    splits = int(max(1, min(64, rows // 256)))
    per = -(-rows // splits)
    return (_launcher(dtype, _F32, ncols, splits), splits,
            (np.int64(rows), np.int32(ncols), np.int64(per)))


def _sum_plan(splits, ncols, out_dtype):
    """(Launcher, the scalar arguments) of the second stage (one split of all the rows), or
    None for an output type the kernel is not built for."""
    out_dtype = np.dtype(out_dtype)
    if out_dtype not in CTYPE:
        return None
    return (_launcher(_F32, out_dtype, ncols, 1),
            (np.int64(splits), np.int32(ncols), np.int64(splits)))


@backends.register("bias_grad", "cuda",
                   supports=lambda dy2, out_dtype: on_gpu_low_precision(dy2))
def bias_grad(dy2, out_dtype):
    """dbias of a linear: the float32 column sums of dy2 [rows, N] in out_dtype (no float32
    copy of dy)."""
    import cupy
    dy2 = cupy.ascontiguousarray(dy2)
    if not dy2.size:
        return cupy.zeros(dy2.shape[1:], out_dtype)
    return dbias(dy2, out_dtype)

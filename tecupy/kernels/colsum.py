"""CUDA column sums in float32, the bias gradients: cuda/colsum.cu. dbias of a linear
(bias_grad), of an activation with a bias (kernels/activation.py) and the second stage of
cast_transpose_dbias (kernels/cast.py, whose cast kernel writes the partial sums)."""
import numpy as np

from .. import backends, loader
from .dtypes import CTYPE, on_gpu_low_precision

FILE = "colsum.cu"
loader.declare(FILE, [f"col_sum<{t}, float>" for t in ("float", "__half", "__nv_bfloat16")])


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


@backends.register("bias_grad", "cuda",
                   supports=lambda dy2, out_dtype: on_gpu_low_precision(dy2))
def bias_grad(dy2, out_dtype):
    """dbias of a linear: the float32 column sums of dy2 [rows, N] (no float32 copy of dy)."""
    import cupy
    dy2 = cupy.ascontiguousarray(dy2)
    if not dy2.size:
        return cupy.zeros(dy2.shape[1:], out_dtype)
    return dbias(dy2).astype(out_dtype, copy=False)

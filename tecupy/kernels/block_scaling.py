"""CUDA block quantization (Float8BlockScaling): cuda/block_scaling.cu.

block_quantize(x, fmt, block_dim, power_2_scale, amax_epsilon, transpose) -> (codes,
scale_inv, codes_t or None, scale_inv_t or None), bit for bit the reference's
(reference/block_scaling.py, which documents the layouts): one launch reads x once and
writes the row-wise codes and, with transpose, the column-wise copy, each with its own
block scales. The block GEMM ("fp8_block_gemm") has no kernel yet: it runs on the reference.
"""
import itertools

import numpy as np

from .. import backends, loader
from .._array import is_cupy
from ..reference.block_scaling import BLOCK, value_for_inf
from .dtypes import CTYPE, FP8TYPE, LOW_PRECISION, cbool

FILE = "block_scaling.cu"
loader.declare(FILE, [f"block_quantize<{CTYPE[t]}, {f}, {d}, {p}>" for t, f, d, p in
                      itertools.product(LOW_PRECISION, FP8TYPE.values(), ("false", "true"),
                                        ("false", "true"))])


def _supported(x, fmt, block_dim, *args, **kwargs):
    """2-D CuPy float32 / float16 / bfloat16, rows and cols multiples of 8 (whole 8 x 8
    thread pieces, 8-byte code stores), 16-byte aligned; else the reference runs."""
    return (is_cupy(x) and x.ndim == 2 and x.dtype in LOW_PRECISION and x.shape[0] % 8 == 0
            and x.shape[1] % 8 == 0 and x.flags.c_contiguous and x.data.ptr % 16 == 0)


@backends.register("block_quantize", "cuda", supports=_supported)
def block_quantize(x, fmt, block_dim, power_2_scale=True, amax_epsilon=0.0, transpose=False):
    import cupy
    rows, cols = x.shape
    nr, nc = -(-rows // BLOCK), -(-cols // BLOCK)
    q = cupy.empty((rows, cols), np.uint8)
    qt = cupy.empty((cols, rows), np.uint8) if transpose else None
    if block_dim == 2:
        s = cupy.empty((nr, nc), np.float32)
        st = cupy.empty((nc, nr), np.float32) if transpose else None
    else:
        s = cupy.empty((nc, rows), np.float32)
        st = cupy.empty((nr, cols), np.float32) if transpose else None
    if x.size:
        k = loader.function(FILE, f"block_quantize<{CTYPE[x.dtype]}, {FP8TYPE[fmt.name]}, "
                                  f"{cbool(block_dim == 2)}, {cbool(power_2_scale)}>")
        null = np.uint64(0)
        k((nc, nr), (256,), (x, q, s, null if qt is None else qt, null if st is None else st,
                             np.int32(rows), np.int32(cols), np.float32(fmt.max),
                             np.float32(amax_epsilon), value_for_inf(x.dtype)))
    return q, s, qt, st

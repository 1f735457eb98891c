"""CUDA cast to FP8 (with amax) and dequantize: cuda/cast.cu."""
import itertools

import numpy as np

from .. import backends, loader
from .common import CTYPE, FP8TYPE, grid_1d, on_gpu

FILE = "cast.cu"
loader.declare(FILE, [f"cast_to_fp8<{t}, {f}>" for t, f in itertools.product(
    CTYPE.values(), FP8TYPE.values())] + [f"fp8_dequantize<{f}, {t}>" for t, f in
                                          itertools.product(CTYPE.values(), FP8TYPE.values())])


@backends.register("cast_to_fp8", "cuda", supports=on_gpu)
def cast_to_fp8(x, scale, fmt):
    import cupy
    x = cupy.ascontiguousarray(x)
    q = cupy.empty(x.shape, np.uint8)
    amax = cupy.zeros((1,), np.float32)
    if x.size:
        kernel = loader.function(FILE, f"cast_to_fp8<{CTYPE[x.dtype]}, {FP8TYPE[fmt.name]}>")
        kernel((grid_1d(x.size, 4),), (256,), (x, scale, q, amax, np.int64(x.size)))
    return q, amax


@backends.register("fp8_dequantize", "cuda", supports=on_gpu)
def fp8_dequantize(data, fmt, scale_inv, dtype):
    import cupy
    data = cupy.ascontiguousarray(data)
    y = cupy.empty(data.shape, dtype)
    if data.size:
        kernel = loader.function(FILE, f"fp8_dequantize<{FP8TYPE[fmt.name]}, {CTYPE[y.dtype]}>")
        kernel((grid_1d(data.size),), (256,), (data, scale_inv, y, np.int64(data.size)))
    return y

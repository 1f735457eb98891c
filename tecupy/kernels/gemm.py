"""High-precision GEMM on CuPy arrays through cuBLAS (cupy.matmul) in the inputs' own dtype:
tensor cores for bf16/fp16 with float32 accumulation, instead of the reference's upcast to
float32. (FP8 GEMMs are issue 4's CUTLASS kernels.)"""
import numpy as np

from .. import backends
from .._array import is_cupy
from .dtypes import LOW_PRECISION

_works = {}  # dtype -> whether cupy.matmul takes it on this install (bf16 support varies)


def _matmul_ok(dtype):
    if dtype not in _works:
        import cupy
        try:
            a = cupy.ones((16, 16), dtype)
            _works[dtype] = bool(abs(float((a @ a)[0, 0].astype(np.float32)) - 16) < 1e-3)
        except Exception:
            _works[dtype] = False
    return _works[dtype]


def supported(a, b, out_dtype, bias=None, trans_b=True):
    return (is_cupy(a) and a.dtype in LOW_PRECISION and b.dtype == a.dtype
            and np.dtype(out_dtype) == a.dtype and _matmul_ok(a.dtype))


@backends.register("gemm", "cuda", supports=supported)
def gemm(a, b, out_dtype, bias=None, trans_b=True):
    """a [M, K] @ (b [N, K]).T or a @ b [K, N], + bias [N]; cuBLAS accumulates in float32
    and rounds once to the output dtype, then the bias is added in that dtype."""
    y = a @ (b.T if trans_b else b)
    if bias is not None:
        y += bias
    return y

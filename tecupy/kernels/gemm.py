"""GEMMs on CuPy arrays through cuBLAS (cupy.matmul) in the inputs' own dtype: tensor cores
for bf16/fp16 with float32 accumulation, instead of the reference's upcast to float32; and an
interim FP8 GEMM on bf16 tensor cores until the CUTLASS kernel (issue 4) lands."""
import numpy as np

from .. import backends
from .._array import bfloat16, is_cupy
from .common import LOW_PRECISION

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


def fp8_supported(a, *args):
    return is_cupy(a) and _matmul_ok(bfloat16)


@backends.register("fp8_gemm", "cuda", supports=fp8_supported)
def fp8_gemm(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias=None):
    """Interim FP8 GEMM until the CUTLASS kernel (issue 4): FP8 codes decode exactly to
    bf16, cuBLAS multiplies in bf16 with float32 accumulation (one extra bf16 rounding of
    the product, ~2^-9 relative, far under FP8's own 2^-4), then the product is scaled by
    scale_inv_a * scale_inv_b (read on the device) and the bias added in float32."""
    import cupy
    one = cupy.ones((1,), np.float32)
    da = backends.dispatch("fp8_dequantize", a, a_fmt, one, bfloat16)
    db = backends.dispatch("fp8_dequantize", b, b_fmt, one, bfloat16)
    y = (da @ db.T).astype(np.float32) * (a_scale_inv * b_scale_inv)
    if bias is not None:
        y += bias.astype(np.float32)
    return y.astype(out_dtype)

"""Reference GEMM (high precision): the cuBLAS path on CuPy, BLAS on NumPy."""
from .. import backends
from .._array import compute_dtype, xp_of


@backends.register("gemm", "reference")
def gemm(a, b, out_dtype, bias=None, trans_b=True):
    """a [M, K] @ (b [N, K]).T (trans_b) or a @ b [K, N], computed in float32 (float64 for
    float64 inputs), plus bias [N]; returned in out_dtype."""
    xp = xp_of(a)
    ct = compute_dtype(a.dtype)
    b = b.astype(ct, copy=False)
    acc = xp.matmul(a.astype(ct, copy=False), b.T if trans_b else b)
    if bias is not None:
        acc = acc + bias.astype(ct, copy=False)
    return acc.astype(out_dtype, copy=False)

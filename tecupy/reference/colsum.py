"""Reference column sums: the bias gradient (kernels/colsum.py's bias_grad)."""
from .. import backends
from .._array import compute_dtype


@backends.register("bias_grad", "reference")
def bias_grad(dy2, out_dtype):
    """dbias = the column sums of dy2 [rows, N], summed in float32 (float64 for float64)."""
    return dy2.astype(compute_dtype(dy2.dtype), copy=False).sum(0).astype(out_dtype,
                                                                          copy=False)

"""Reference elementwise ops: the residual add (NumPy broadcasting)."""
from .. import backends
from .._array import compute_dtype


@backends.register("add_fwd", "reference")
def add_fwd(a, b, residual=None):
    """a + b (NumPy broadcasting), the sum in float32 (float64) rounded once to a's dtype;
    then + residual, rounded again (two adds)."""
    ct = compute_dtype(a.dtype)
    y = (a.astype(ct, copy=False) + b.astype(ct, copy=False)).astype(a.dtype, copy=False)
    return y if residual is None else add_fwd(y, residual)

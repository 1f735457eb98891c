"""What the kernel wrappers share about types: the C names of dtypes and FP8 formats in
template arguments, the supports() tests of the common cases, vector widths."""
import numpy as np

from .._array import bfloat16, is_cupy

CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
         np.dtype(np.float16): "__half", bfloat16: "__nv_bfloat16"}
FP8TYPE = {"e4m3": "__nv_fp8_e4m3", "e5m2": "__nv_fp8_e5m2"}
LOW_PRECISION = (np.dtype(np.float32), np.dtype(np.float16), bfloat16)


def on_gpu(x, *args, **kwargs):
    """supports(): the first argument is a CuPy array."""
    return is_cupy(x)


def on_gpu_low_precision(x, *args, **kwargs):
    """supports(): the first argument is a CuPy array of float32, float16 or bfloat16."""
    return is_cupy(x) and x.dtype in LOW_PRECISION


def vec_width(dtype, n):
    """Elements per 16-byte access when every row of length n stays 16-byte aligned, else 1."""
    v = 16 // np.dtype(dtype).itemsize
    return v if n % v == 0 else 1


def cbool(flag):
    return "true" if flag else "false"

"""FP8 formats, the FP8 array container and the cast functions.

CuPy has no float8 dtype, so FP8 data is stored as uint8 with its format and the
dequantizing factor `scale_inv` beside it: value = decode(data) * scale_inv.
Cast (Transformer Engine's rule): q = saturate(x * scale) rounded to nearest even,
computed in float32; overflow and inf saturate to +-max; NaN of either sign becomes 0x7F,
the canonical NaN code of both formats (CUDA's cuda_fp8.hpp conversion, which Transformer
Engine's casts use); amax = max|x| of the input before scaling, ignoring NaN (as CUDA's
fmaxf does).
"""
import dataclasses

import ml_dtypes
import numpy as np

from . import backends
from ._array import FLOAT_DTYPES, array_module, check_float, xp_of

FLT_MAX = float(np.finfo(np.float32).max)


@dataclasses.dataclass(frozen=True)
class FP8Format:
    name: str
    max: float       # largest finite value
    mbits: int       # mantissa bits
    bias: int        # exponent bias
    ml_dtype: type   # the ml_dtypes type the NumPy reference decodes with

    def __repr__(self):
        return f"tecupy.fp8.{self.name.upper()}"

    def __reduce__(self):  # pickle and deepcopy give back the one E4M3 / E5M2 object
        return as_format, (self.name,)


E4M3 = FP8Format("e4m3", 448.0, 3, 7, ml_dtypes.float8_e4m3fn)
E5M2 = FP8Format("e5m2", 57344.0, 2, 15, ml_dtypes.float8_e5m2)
FORMATS = {"e4m3": E4M3, "e5m2": E5M2}


def as_format(fmt):
    if isinstance(fmt, FP8Format):
        return fmt
    if isinstance(fmt, str) and fmt.lower() in FORMATS:
        return FORMATS[fmt.lower()]
    raise ValueError(f"unknown FP8 format {fmt!r}; accepted: 'e4m3', 'e5m2'")


class FP8Tensor:
    """uint8 `data` in format `fmt`, with `scale_inv` (float32, shape (1,)) on the same device.
    `data_t`, when the cast made it, is the transposed copy (2-D data only)."""

    def __init__(self, data, fmt, scale_inv, data_t=None):
        if data.dtype != np.uint8:
            raise TypeError(f"FP8Tensor data must be uint8, got {data.dtype}")
        array_module("FP8Tensor", data=data, scale_inv=scale_inv, data_t=data_t)
        self.data, self.fmt, self.scale_inv = data, as_format(fmt), scale_inv
        self.data_t = data_t

    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)

    def __repr__(self):
        return f"FP8Tensor(shape={self.shape}, fmt={self.fmt.name})"

    def dequantize(self, dtype=np.float32):
        return dequantize(self, dtype)

    def transpose(self):
        """The column-wise copy (a 2-D transpose, contiguous), as wgrad and dgrad need it."""
        if self.ndim != 2:
            raise ValueError(f"FP8Tensor.transpose needs 2-D data, got shape {self.shape}")
        t = self.data_t
        if t is None:
            t = backends.dispatch("fp8_transpose", self.data)
        return FP8Tensor(t, self.fmt, self.scale_inv, data_t=self.data)

    T = property(transpose)


def _scale_array(xp, scale):
    if isinstance(scale, (int, float)):
        return xp.full((1,), scale, dtype=np.float32)
    if scale.dtype != np.float32 or scale.size != 1:
        raise TypeError(f"scale must be a float32 array of one element, got {scale.dtype} "
                        f"shape {tuple(scale.shape)}")
    return scale.reshape(1)


def quantize(x, scale, fmt, amax_out=None, transpose=False, dbias_dtype=None):
    """Cast `x` to FP8: returns an FP8Tensor; if `amax_out` (float32, one element, holding a
    value >= +0, as an amax history row does) is given, max(amax_out, amax(x)) is written
    into it (the cast kernels atomicMax into it, with no amax of their own).
    transpose=True (2-D x) also makes the transposed copy in the same pass; with it,
    dbias_dtype (a dtype) returns (FP8Tensor, the column sums of x in that dtype) from the
    same read of x (Transformer Engine's cast_transpose_dbias, for a linear's dy)."""
    fmt = as_format(fmt)
    xp = array_module("quantize", x=x, amax_out=amax_out)
    check_float("quantize", x=x)
    if transpose and x.ndim != 2:
        raise ValueError(f"quantize(transpose=True) needs 2-D x, got shape {tuple(x.shape)}")
    if dbias_dtype is not None and not transpose:
        raise ValueError("quantize: dbias_dtype comes with transpose=True (the backward's "
                         "cast of dy)")
    scale = _scale_array(xp, scale)
    data_t = dbias = None
    if dbias_dtype is not None:
        data, data_t, _, dbias = backends.dispatch(
            "cast_transpose_dbias", x, scale, fmt, np.dtype(dbias_dtype), amax_out=amax_out)
    elif transpose:
        data, data_t, _ = backends.dispatch("cast_transpose", x, scale, fmt, amax_out=amax_out)
    else:
        data, _ = backends.dispatch("cast_to_fp8", x, scale, fmt, amax_out=amax_out)
    # A fresh scale_inv, not a view of the state's: the forward update at autocast exit
    # rewrites the state's scales before backward uses this tensor (TE saves them too).
    t = FP8Tensor(data, fmt, (1.0 / scale).astype(np.float32), data_t)
    return t if dbias_dtype is None else (t, dbias)


def dequantize(t, dtype=np.float32):
    """decode(t.data) * t.scale_inv in `dtype`, a floating dtype (an integer dtype would
    truncate the values silently)."""
    if not isinstance(t, FP8Tensor):
        raise TypeError(f"dequantize: t must be an FP8Tensor, got {type(t).__name__}")
    try:  # (None would mean float64 to numpy, and np.dtype("f8") == None is True)
        dt = None if dtype is None else np.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt not in FLOAT_DTYPES:
        raise TypeError(f"dequantize: dtype must be a floating dtype (float16, bfloat16, "
                        f"float32, float64), got {dtype!r}")
    return backends.dispatch("fp8_dequantize", t.data, t.fmt, t.scale_inv, dt)


def scaled_max(fp8_max, margin):
    """fp8_max * 2**-margin in float32 (exact: margin <= 126 keeps 2**-margin normal), the
    numerator of Transformer Engine's delayed-scaling scale (delayed_scaling.cu: scaled_max
    / amax, finite at margin >= 1 for amaxes where fp8_max / amax alone overflows)."""
    return fp8_max * np.float32(2.0 ** -margin)


def amax(x):
    """max |x| over all elements as a float32 array of shape (1,), NaN ignored, 0 if empty."""
    array_module("amax", x=x)
    return backends.dispatch("amax", x)


def current_scale(amax_arr, fmt):
    """Per-tensor current scaling: fmt.max / amax; 1 where amax is 0 or not finite; an
    infinite result (a tiny amax) becomes FLT_MAX."""
    xp = xp_of(amax_arr)
    a = amax_arr.astype(np.float32)
    ok = xp.isfinite(a) & (a > 0)
    with np.errstate(over="ignore"):  # a tiny amax overflows to inf on purpose
        s = xp.where(ok, np.float32(as_format(fmt).max) / xp.where(ok, a, 1), np.float32(1))
    return xp.where(xp.isinf(s), np.float32(FLT_MAX), s).astype(np.float32)


def quantize_current(x, fmt, transpose=False, dbias_dtype=None):
    """Cast with this tensor's own amax (Float8CurrentScaling)."""
    return quantize(x, current_scale(amax(x), fmt), fmt, transpose=transpose,
                    dbias_dtype=dbias_dtype)

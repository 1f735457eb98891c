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
import numbers

import ml_dtypes
import numpy as np

from . import backends
from ._array import FLOAT_DTYPES, array_module, check_float, is_cupy, xp_of
from ._check import fail

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


def as_format(fmt, op="as_format", name="fmt"):
    """The FP8Format `fmt` is or names ('e4m3' / 'e5m2', any case); the error names the
    calling function `op` and its argument `name`."""
    if isinstance(fmt, FP8Format):
        return fmt
    if isinstance(fmt, str) and fmt.lower() in FORMATS:
        return FORMATS[fmt.lower()]
    fail(op, name, "'e4m3', 'e5m2' or a tecupy.fp8 format (tecupy.fp8.E4M3, E5M2)", fmt,
         ValueError if isinstance(fmt, str) else TypeError)


class FP8Tensor:
    """uint8 `data` in format `fmt`, with `scale_inv` (float32, shape (1,)) on the same device.
    `data_t`, when the cast made it, is the transposed copy (2-D data only)."""
    # the backend op that multiplies two of these (ops.linear.fp8_gemm): a recipe whose
    # tensors carry other scales (blocks) names its own GEMM op in its subclass
    gemm_op = "fp8_gemm"

    def __init__(self, data, fmt, scale_inv, data_t=None):
        array_module("FP8Tensor", data=data, scale_inv=scale_inv, data_t=data_t)
        for name, a in (("data", data), ("data_t", data_t)):
            if a is not None and a.dtype != np.uint8:
                fail("FP8Tensor", name, "a uint8 array (FP8 codes)", a, TypeError)
        if data_t is not None and tuple(data_t.shape) != tuple(data.shape)[::-1]:
            raise ValueError(f"FP8Tensor: data_t has shape {tuple(data_t.shape)}, expected "
                             f"{tuple(data.shape)[::-1]} (the transpose of data)")
        if scale_inv.dtype != np.float32 or scale_inv.size != 1:
            fail("FP8Tensor", "scale_inv", "a float32 array of one element", scale_inv,
                 TypeError)
        self.data, self.fmt, self.scale_inv = data, as_format(fmt, "FP8Tensor"), scale_inv
        self.data_t = data_t

    @classmethod
    def made(cls, data, fmt, scale_inv, data_t=None):
        """An FP8Tensor of arrays tecupy made itself (a cast's outputs, a transpose), without
        the constructor's checks: ~4 us less per tensor, six tensors per FP8 linear."""
        t = cls.__new__(cls)
        t.data, t.fmt, t.scale_inv, t.data_t = data, fmt, scale_inv, data_t
        return t

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
        return type(self).made(t, self.fmt, self.scale_inv, data_t=self.data)

    T = property(transpose)

    def columnwise(self):
        """The column-wise copy (the cast's, or transposed now) as a tensor of its own, with
        no reference to the row-wise codes: the backward GEMMs read only these (dgrad the
        weight's, wgrad the input's), so the row-wise codes can be freed once the forward
        GEMM has run (issue 22: a fifth of the FP8 step's memory at the quickstart size)."""
        t = self.data_t
        if t is None:
            t = backends.dispatch("fp8_transpose", self.data)
        return type(self).made(t, self.fmt, self.scale_inv)

    def rowwise(self):
        """The row-wise codes as a tensor of their own, with no reference to the column-wise
        copy (a GEMM that read that copy is done with it)."""
        return type(self).made(self.data, self.fmt, self.scale_inv)

    def rows(self, start, stop):
        """Rows start:stop of 2-D codes as a tensor of their own (a view; the same scale)."""
        return type(self).made(self.data[start:stop], self.fmt, self.scale_inv)



class FP8BlockTensor(FP8Tensor):
    """FP8 codes with one float32 scale per block (recipe.Float8BlockScaling): `data`
    [rows, cols] uint8 with `scale_inv` (its blocks' dequantizing factors), and optionally
    the column-wise copy `data_t` [cols, rows] with its own `scale_inv_t`: quantized from the
    high-precision tensor, not transposed from `data` (1x128 blocks along a row and along a
    column are different blocks). block_dim 1: 1x128 blocks, scale_inv [ceil(cols / 128),
    rows] (scale_inv[j, r] for data[r, 128j:128j+128], K-block major as the GEMM reads it);
    block_dim 2: 128x128 blocks, scale_inv [ceil(rows / 128), ceil(cols / 128)];
    scale_inv_t is laid out the same way for data_t (reference/block_scaling.py). A GEMM of
    two of these is the backend op "fp8_block_gemm". Dequantize with t.dequantize()."""
    gemm_op = "fp8_block_gemm"

    def __init__(self, data, fmt, scale_inv, data_t=None, scale_inv_t=None, block_dim=1):
        from .reference.block_scaling import block_dim_of
        array_module("FP8BlockTensor", data=data, scale_inv=scale_inv, data_t=data_t,
                     scale_inv_t=scale_inv_t)
        if block_dim not in (1, 2):
            raise ValueError(f"FP8BlockTensor: block_dim must be 1 (1x128 blocks) or 2 "
                             f"(128x128), got {block_dim!r}")
        for name, a, s in (("data", data, scale_inv), ("data_t", data_t, scale_inv_t)):
            if a is None:
                if s is not None:
                    raise ValueError(f"FP8BlockTensor: {name} is None but its scales are not")
                continue
            if a.dtype != np.uint8 or a.ndim != 2:
                fail("FP8BlockTensor", name, "a 2-D uint8 array (FP8 codes)", a, TypeError)
            if s is None or s.dtype != np.float32:
                fail("FP8BlockTensor", f"scale_inv of {name}", "a float32 array", s, TypeError)
            if block_dim_of(a.shape, s.shape, "FP8BlockTensor") != block_dim \
                    and min(a.shape) > 1:
                raise ValueError(f"FP8BlockTensor: the scales of {name} are not "
                                 f"block_dim={block_dim}'s layout")
        if data_t is not None and tuple(data_t.shape) != tuple(data.shape)[::-1]:
            raise ValueError(f"FP8BlockTensor: data_t has shape {tuple(data_t.shape)}, "
                             f"expected {tuple(data.shape)[::-1]} (the transpose of data)")
        self.data, self.fmt, self.scale_inv = data, as_format(fmt, "FP8BlockTensor"), scale_inv
        self.data_t, self.scale_inv_t, self.block_dim = data_t, scale_inv_t, block_dim

    @classmethod
    def made(cls, data, fmt, scale_inv, data_t=None, scale_inv_t=None, block_dim=1):
        """As FP8Tensor.made: arrays tecupy made itself, no checks."""
        t = cls.__new__(cls)
        t.data, t.fmt, t.scale_inv, t.data_t = data, fmt, scale_inv, data_t
        t.scale_inv_t, t.block_dim = scale_inv_t, block_dim
        return t

    def __repr__(self):
        return (f"FP8BlockTensor(shape={self.shape}, fmt={self.fmt.name}, "
                f"blocks={'1x128' if self.block_dim == 1 else '128x128'})")

    def dequantize(self, dtype=np.float32):
        """decode(data) * its block's scale_inv, in `dtype` (a floating dtype)."""
        dt = _float_dtype("FP8BlockTensor.dequantize", "dtype", dtype)
        return backends.dispatch("fp8_block_dequantize", self.data, self.fmt, self.scale_inv,
                                 dt)

    def _copy_t(self, what):
        if self.data_t is not None:
            return self.data_t, self.scale_inv_t
        if self.block_dim == 2:  # the same 128x128 blocks: the transpose is exact
            xp = xp_of(self.data)
            return (backends.dispatch("fp8_transpose", self.data),
                    xp.ascontiguousarray(self.scale_inv.T))
        raise ValueError(f"FP8BlockTensor.{what}: 1x128-blocked codes have no column-wise "
                         "copy unless the cast made one (quantize with transpose=True): "
                         "transposing them would need other blocks")

    def transpose(self):
        """The column-wise copy as the row-wise tensor, this one as its copy."""
        t, st = self._copy_t("transpose")
        return FP8BlockTensor.made(t, self.fmt, st, self.data, self.scale_inv, self.block_dim)

    T = property(transpose)

    def columnwise(self):
        t, st = self._copy_t("columnwise")
        return FP8BlockTensor.made(t, self.fmt, st, block_dim=self.block_dim)

    def rowwise(self):
        return FP8BlockTensor.made(self.data, self.fmt, self.scale_inv,
                                   block_dim=self.block_dim)

    def rows(self, start, stop):
        """Rows start:stop (a view of the codes) with their scales (1x128: a copy of their
        columns of scale_inv; 128x128: start and stop on block edges, or stop the end)."""
        rows = self.data.shape[0]
        if self.block_dim == 1:
            s = xp_of(self.scale_inv).ascontiguousarray(self.scale_inv[:, start:stop])
        else:
            if start % 128 or (stop % 128 and stop < rows):
                raise ValueError(f"FP8BlockTensor.rows({start}, {stop}): 128x128-blocked "
                                 "codes split on block edges only (multiples of 128)")
            s = self.scale_inv[start // 128:-(-min(stop, rows) // 128)]
        return FP8BlockTensor.made(self.data[start:stop], self.fmt, s,
                                   block_dim=self.block_dim)

_SCALE = "a float32 array of one element or a number, finite and > 0"


def _scale_array(x, scale):
    """scale as a float32 array of shape (1,) on x's device. A number, or a NumPy array (read
    on the host, no cost), must be finite and > 0: a NaN scale makes every code NaN, a zero
    or negative one zeros or flips the data. A CuPy array's value is not read (that would
    synchronise with the GPU on every cast): a NaN there gives NaN codes, as in Transformer
    Engine, whose casts do not check the scale either."""
    if isinstance(scale, numbers.Real) and not isinstance(scale, (bool, np.bool_)):
        arr = None
        try:
            value = float(scale)
        except OverflowError:  # an int beyond float64
            value = float("inf")
    elif isinstance(scale, np.ndarray) or is_cupy(scale):
        array_module("quantize", x=x, scale=scale)
        if scale.dtype != np.float32 or scale.size != 1:
            fail("quantize", "scale", _SCALE, scale, TypeError)
        arr = scale.reshape(1)
        if is_cupy(arr):
            return arr
        value = float(arr[0])
    else:
        fail("quantize", "scale", _SCALE, scale, TypeError)
    if not 0 < value <= FLT_MAX:  # (NaN fails this too)
        got = repr(scale) if arr is None else f"a numpy array holding {value!r}"
        raise ValueError(f"quantize: scale must be {_SCALE}, got {got}")
    return arr if arr is not None else xp_of(x).full((1,), value, dtype=np.float32)


def _check_amax_out(amax_out):
    """The kernels atomicMax a float32 into it: another dtype or size would be misread."""
    if amax_out is not None and (amax_out.dtype != np.float32 or amax_out.size != 1):
        fail("quantize", "amax_out", "None or a float32 array of one element", amax_out,
             TypeError)


def quantize(x, scale, fmt, amax_out=None, transpose=False, dbias_dtype=None):
    """Cast `x` to FP8: returns an FP8Tensor. `scale`: a float32 array of one element on x's
    device (an FP8State's slot) or a number, finite and > 0; a CuPy scale's value is not
    read (no host sync), so a NaN there gives NaN codes, as in Transformer Engine.
    amax_out (float32, one element, holding a value >= +0, as an amax history row does):
    max(amax_out, amax(x)) is written into it (the kernels atomicMax into it).
    transpose=True (2-D x) also makes the transposed copy in the same pass; with it,
    dbias_dtype (a floating dtype) returns (FP8Tensor, the column sums of x in that dtype)
    from the same read of x (Transformer Engine's cast_transpose_dbias, for a linear's dy)."""
    fmt = as_format(fmt, "quantize")
    array_module("quantize", x=x, amax_out=amax_out)
    check_float("quantize", x=x)
    _check_amax_out(amax_out)
    if transpose and x.ndim != 2:
        raise ValueError(f"quantize(transpose=True) needs 2-D x, got shape {tuple(x.shape)}")
    if dbias_dtype is not None and not transpose:
        raise ValueError("quantize: dbias_dtype comes with transpose=True (the backward's "
                         "cast of dy)")
    if dbias_dtype is not None:
        dbias_dtype = _float_dtype("quantize", "dbias_dtype", dbias_dtype)
    scale = _scale_array(x, scale)
    out = cast(x, scale, fmt, amax_out, transpose, dbias_dtype)
    inspector = _active_inspector()
    if inspector is not None:
        inspector.record_quantize(x, out[0] if dbias_dtype is not None else out, scale)
    return out


def cast(x, scale, fmt, amax_out=None, transpose=False, dbias_dtype=None):
    """quantize without its checks, for callers that made them (the quantizers): scale a
    float32 (1,) array on x's device, fmt an FP8Format, dbias_dtype None or a np.dtype."""
    # A fresh scale_inv, not a view of the state's: the forward update at autocast exit
    # rewrites the state's scales before backward uses this tensor (TE saves them too).
    # The cast kernel writes it (IEEE 1 / scale): no launch of its own.
    # (amax_out and scale_inv_out passed by position: keywords cost a dict per call level)
    inv = xp_of(x).empty((1,), np.float32)
    data_t = dbias = None
    if dbias_dtype is not None:
        data, data_t, _, dbias = backends.dispatch("cast_transpose_dbias", x, scale, fmt,
                                                   dbias_dtype, amax_out, inv)
    elif transpose:
        data, data_t, _ = backends.dispatch("cast_transpose", x, scale, fmt, amax_out, inv)
    else:
        data, _ = backends.dispatch("cast_to_fp8", x, scale, fmt, amax_out, inv)
    t = FP8Tensor.made(data, fmt, inv, data_t)
    return t if dbias_dtype is None else (t, dbias)


def bound_cast(a, scale, fmt, amax_out):
    """cast(x, scale, fmt, amax_out, transpose=True) for arrays x like `a` (2-D, its shape,
    dtype and array type; scale and amax_out float32 (1,) arrays on its device), bound now to
    the implementation dispatch chooses for `a` and its launch plan: f(x, rows=None) ->
    FP8Tensor (rows: a uint8 array of x's shape the row-wise codes go into), or
    None where that implementation has no bound form (kernels' `bind`: an op's kept plan,
    ops/linear.py). The same kernel, arguments and outputs as cast (scale_inv written by
    the kernel), without dispatch and checks per call."""
    impl = backends.choose("cast_transpose", a, scale, fmt, amax_out, amax_out)
    bind = getattr(getattr(impl, "fn", None), "bind", None)
    if bind is None or impl.failure is not None or not a.size:
        return None
    launch = bind(a.shape[0], a.shape[1], a.dtype, fmt)

    def cast_bound(x, rows=None):  # (rows: given row-wise codes' array, kernels' q)
        data, data_t, inv = launch(x, scale, amax_out, rows)
        return FP8Tensor.made(data, fmt, inv, data_t)
    return cast_bound


def bound_cast_pair(a, qa, b, qb):
    """bound_cast of arrays like `a` with quantizer qa (its scale, fmt and amax_out) and of
    arrays like `b` with qb, both in one launch (kernels' `bind_pair`): f(xa, xb) -> (the
    FP8Tensor of xa, that of xb), the same as two bound casts; or None where there is no
    such form (other formats, dtypes or array types, shapes it does not take)."""
    impl = backends.choose("cast_transpose", a, qa.scale, qa.fmt, qa.amax_out, qa.amax_out)
    bind = getattr(getattr(impl, "fn", None), "bind_pair", None)
    if (bind is None or impl.failure is not None or qa.fmt != qb.fmt or a.dtype != b.dtype
            or type(a) is not type(b) or a.ndim != 2 or b.ndim != 2):
        return None
    launch = bind(a.shape, b.shape, a.dtype, qa.fmt)
    if launch is None:
        return None
    fmt, sa, ma, sb, mb = qa.fmt, qa.scale, qa.amax_out, qb.scale, qb.amax_out

    def cast_pair(xa, xb, rows_a=None, rows_b=None):  # (given row-wise codes' arrays)
        (da, ta, ia), (db, tb, ib) = launch(xa, sa, ma, xb, sb, mb, rows_a, rows_b)
        return FP8Tensor.made(da, fmt, ia, ta), FP8Tensor.made(db, fmt, ib, tb)
    return cast_pair


def dact_cast(dy, x, bias, name, scale, fmt, amax_out, dbias_dtype=None):
    """cast(dx, ..., transpose=True, dbias_dtype) of the activation `name`'s backward
    dx = dy * f'(x + bias) (in dy's dtype), in one pass where a kernel has it: dx is never
    in memory (Transformer Engine's cast_transpose_dbias_dgelu) -> (FP8Tensor, dbias or
    None)."""
    inv = xp_of(dy).empty((1,), np.float32)
    data, data_t, _, dbias = backends.dispatch("dact_cast_transpose", dy, x, bias, name, scale,
                                               fmt, dbias_dtype, amax_out, inv)
    t = FP8Tensor.made(data, fmt, inv, data_t)
    inspector = _active_inspector()
    if inspector is not None:  # dx is in no array: the inspector may recompute it (exact)
        inspector.record_dact(t, scale, amax_out,
                              lambda: backends.dispatch(f"{name}_bwd", dy, x, bias)[0])
    return t, dbias


def dact_cast_chunked(dgrad, x, bias, name, scale, fmt, amax_out, dbias_dtype, chunk):
    """dact_cast of dy = dgrad(c0, c1) (dy's columns c0:c1, made on demand: a GEMM's output)
    over column chunks of `chunk` columns, so that dy exists one chunk at a time (issue 22:
    fc2's dgrad output at the quickstart layer is 256 MiB; 64 MiB per chunk) -> (FP8Tensor,
    dbias or None): bit for bit dact_cast's of the whole dy (each code, each column sum and
    the amax depend on no other column)."""
    rows, cols = x.shape
    if chunk >= cols:
        return dact_cast(dgrad(0, cols), x, bias, name, scale, fmt, amax_out, dbias_dtype)
    xp = xp_of(x)
    data, data_t = xp.empty((rows, cols), np.uint8), xp.empty((cols, rows), np.uint8)
    inv = xp.empty((1,), np.float32)
    dbias = None if dbias_dtype is None else xp.empty((cols,), dbias_dtype)
    spans = [(c0, min(cols, c0 + chunk)) for c0 in range(0, cols, chunk)]
    for c0, c1 in spans:
        b = None if bias is None else bias[c0:c1]
        _, _, _, db = backends.dispatch("dact_cast_transpose", dgrad(c0, c1), x[:, c0:c1], b,
                                        name, scale, fmt, dbias_dtype, amax_out, inv,
                                        out=(data[:, c0:c1], data_t[c0:c1]))
        if dbias is not None:
            dbias[c0:c1] = db
    t = FP8Tensor.made(data, fmt, inv, data_t)
    inspector = _active_inspector()
    if inspector is not None:
        inspector.record_dact(t, scale, amax_out, lambda: xp.concatenate([backends.dispatch(
            f"{name}_bwd", dgrad(c0, c1), x[:, c0:c1], None if bias is None else bias[c0:c1])[0]
            for c0, c1 in spans], axis=1))
    return t, dbias


def _active_inspector():
    """The active FP8Inspector or None (one contextvar read; inspect.py imports this module,
    hence the import here)."""
    from .inspect import ACTIVE_INSPECTOR
    return ACTIVE_INSPECTOR.get()


def _float_dtype(op, name, value):
    """np.dtype(value) when it is float16, bfloat16, float32 or float64: an integer dtype
    would truncate silently. None is refused (numpy would read it as float64)."""
    try:
        dt = None if value is None else np.dtype(value)
    except (TypeError, ValueError):  # "data type 'foo' not understood"
        dt = None
    if dt is None or dt not in FLOAT_DTYPES:
        fail(op, name, "a floating dtype (float16, bfloat16, float32, float64)", value,
             TypeError)
    return dt


def dequantize(t, dtype=np.float32):
    """decode(t.data) * t.scale_inv in `dtype`, a floating dtype (an integer dtype would
    truncate the values silently)."""
    if not isinstance(t, FP8Tensor):
        fail("dequantize", "t", "a tecupy.FP8Tensor (what quantize returns)", t, TypeError)
    if type(t).dequantize is not FP8Tensor.dequantize:  # a subclass with its own scales
        return t.dequantize(dtype)
    dt = _float_dtype("dequantize", "dtype", dtype)
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
    fp8_max = np.float32(as_format(fmt, "current_scale").max)
    xp = xp_of(amax_arr)
    a = amax_arr.astype(np.float32)
    ok = xp.isfinite(a) & (a > 0)
    with np.errstate(over="ignore"):  # a tiny amax overflows to inf on purpose
        s = xp.where(ok, fp8_max / xp.where(ok, a, 1), np.float32(1))
    return xp.where(xp.isinf(s), np.float32(FLT_MAX), s).astype(np.float32)


def quantize_current(x, fmt, transpose=False, dbias_dtype=None):
    """Cast with this tensor's own amax (Float8CurrentScaling)."""
    fmt = as_format(fmt, "quantize_current")
    array_module("quantize_current", x=x)
    return quantize(x, current_scale(amax(x), fmt), fmt, transpose=transpose,
                    dbias_dtype=dbias_dtype)

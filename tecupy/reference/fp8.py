"""Reference FP8 kernels: cast with amax, dequantize, FP8 GEMM, delayed-scaling update.

Array-module generic (NumPy or CuPy). The encoder works on float32 bit patterns, so it runs
where there is no float8 dtype (CuPy) and matches ml_dtypes bit for bit.
"""
import numpy as np

from .. import backends
from .._array import xp_of
from ..fp8 import FLT_MAX, FP8Format, scaled_max
from .elementwise import add_fwd

_decode_tables = {}


def _encode(v, fmt):
    """float32 array -> uint8 FP8 codes: saturate to +-max, round to nearest even, NaN ->
    the canonical NaN code 0x7F."""
    xp = xp_of(v)
    nan = xp.isnan(v)
    a = xp.where(nan, np.float32(0), xp.minimum(xp.abs(v), np.float32(fmt.max)))
    bits = a.view(np.uint32).astype(np.int64)
    shift = 23 - fmt.mbits
    rounded = (bits + ((1 << (shift - 1)) - 1) + ((bits >> shift) & 1)) >> shift
    normal = rounded - ((127 - fmt.bias) << fmt.mbits)
    subnormal = xp.rint(a * np.float32(2.0 ** (fmt.bias - 1 + fmt.mbits))).astype(np.int64)
    code = xp.where(a < np.float32(2.0 ** (1 - fmt.bias)), subnormal, normal)
    code = code | (xp.signbit(v).astype(np.int64) << 7)
    # NaN of either sign -> 0x7F in both formats: cuda_fp8.hpp canonicalizes a NaN input to
    # 0x7FFFFFFF before converting (sign dropped, mantissa all ones), as the sm_89+ cvt
    # does; ml_dtypes would keep the sign (0xFF) and give 0x7E for E5M2
    return xp.where(nan, 0x7F, code).astype(np.uint8)


def _decode_table(xp, fmt):
    key = (xp.__name__, fmt.name)
    if key not in _decode_tables:
        table = np.arange(256, dtype=np.uint8).view(fmt.ml_dtype).astype(np.float32)
        _decode_tables[key] = xp.asarray(table)
    return _decode_tables[key]


@backends.register("amax", "reference")
def amax(x):
    xp = xp_of(x)
    if x.size == 0:
        return xp.zeros((1,), np.float32)
    a = xp.abs(x.astype(np.float32))
    return xp.max(xp.where(xp.isnan(a), np.float32(0), a)).reshape(1)


def amax_into(amax_out, a):
    """The amax output of the FP8 casts: `a` itself, or with `amax_out` (float32, one
    element, >= +0: an amax history row) max(amax_out, a) written into amax_out, which is
    returned (the kernels' atomicMax into a given amax, Transformer Engine's way)."""
    if amax_out is None:
        return a
    amax_out[...] = xp_of(a).maximum(amax_out, a.reshape(amax_out.shape))
    return amax_out


@backends.register("cast_to_fp8", "reference")
def cast_to_fp8(x, scale, fmt, amax_out=None, scale_inv_out=None):
    """x (any float dtype), scale float32 (1,) -> (uint8 data, amax float32 (1,)).
    scale_inv_out (float32 (1,) or None): 1 / scale is written into it, as the kernel does
    (the FP8 tensor's dequantizing factor)."""
    # a signalling NaN in x: NaN out; beyond float32: inf, which saturates (as on the GPU)
    with np.errstate(invalid="ignore", over="ignore"):
        v = x.astype(np.float32) * scale[0]
    if scale_inv_out is not None:
        fp8_scale_inv(scale, scale_inv_out)
    return _encode(v, fmt), amax_into(amax_out, amax(x))


@backends.register("cast_transpose", "reference")
def cast_transpose(x, scale, fmt, amax_out=None, scale_inv_out=None):
    """x [rows, cols] -> (q, q.T contiguous, amax): both FP8 copies GEMMs need."""
    q, a = cast_to_fp8(x, scale, fmt, amax_out, scale_inv_out)
    return q, xp_of(q).ascontiguousarray(q.T), a


@backends.register("dact_cast_transpose", "reference")
def dact_cast_transpose(dy, x, bias, name, scale, fmt, dbias_dtype=None, amax_out=None,
                        scale_inv_out=None, out=None):
    """The activation `name`'s backward (its <name>_bwd: dx in dy's dtype), then
    cast_transpose(_dbias) of dx -> (q, qt, amax, dbias or None); out: None or (q, qt)
    to write them into (views of wider arrays allowed)."""
    dx, _ = backends.dispatch(f"{name}_bwd", dy, x, bias)
    if dbias_dtype is None:
        res = cast_transpose(dx, scale, fmt, amax_out, scale_inv_out) + (None,)
    else:
        res = cast_transpose_dbias(dx, scale, fmt, dbias_dtype, amax_out, scale_inv_out)
    if out is None:
        return res
    out[0][...], out[1][...] = res[0], res[1]
    return (*out, *res[2:])


@backends.register("act_cast_transpose", "reference")
def act_cast_transpose(x, bias, name, scale, fmt, amax_out=None, scale_inv_out=None):
    """The activation `name`'s forward with an FP8 output (its <name>_fwd: the codes of
    f(x + bias) * scale, amax of f), and their transpose -> (q, qt, amax)."""
    q, a = backends.dispatch(f"{name}_fwd", x, bias, scale, fmt, amax_out=amax_out)
    if scale_inv_out is not None:
        fp8_scale_inv(scale, scale_inv_out)
    return q, xp_of(q).ascontiguousarray(q.T), a


@backends.register("cast_transpose_dbias", "reference")
def cast_transpose_dbias(x, scale, fmt, dbias_dtype, amax_out=None, scale_inv_out=None):
    """cast_transpose, and dbias = the column sums of x in dbias_dtype (bias_grad): the
    backward's cast of dy with its linear's bias gradient."""
    from .colsum import bias_grad
    return cast_transpose(x, scale, fmt, amax_out, scale_inv_out) + (bias_grad(x, dbias_dtype),)


@backends.register("fp8_transpose", "reference")
def fp8_transpose(data):
    """The transposed, contiguous copy of 2-D FP8 codes."""
    return xp_of(data).ascontiguousarray(data.T)


@backends.register("fp8_dequantize", "reference")
def fp8_dequantize(data, fmt, scale_inv, dtype):
    table = _decode_table(xp_of(data), fmt)
    with np.errstate(over="ignore"):  # beyond float16's range is inf, as the kernel gives
        return (table[data] * scale_inv[0]).astype(dtype)


@backends.register("fp8_gemm", "reference")
def fp8_gemm(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias=None, out=None,
             accumulate=False, split_accumulator=False, out_scale=None, amax_out=None,
             gelu=False, dgelu_aux=None, residual=None):
    """TN GEMM: a [M, K], b [N, K] (uint8, both K-major) -> a @ b.T [M, N].

    Products of the decoded codes are summed in float32, then multiplied by
    a_scale_inv * b_scale_inv (read from device memory) and the bias is added. With
    accumulate, the result is added into `out` (float32, wgrad accumulation) in place.
    out_dtype an FP8Format: the result is cast with `out_scale` (float32 (1,)) to uint8 codes
    and max(amax_out, amax(result)) written into `amax_out`, as the cast kernel does.
    gelu: returns (gelu(result), result) in out_dtype (the second for gelu's backward).
    dgelu_aux ([M, N], the values gelu saw): gelu's backward, out_dtype(result) *
    gelu'(dgelu_aux + bias), bias then belonging to the activation, not to the result;
    written into `out` where given (which may be dgelu_aux).
    residual ([M, N]): the residual add, out_dtype(out_dtype(result) + residual) summed in
    float32 as the add op does (two roundings: the GEMM's output, then the add's).
    split_accumulator is the kernels' choice between fast and float32 accumulation (TE's
    use_split_accumulator); float32 accumulation is what this reference always does."""
    for name, s in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        if s.size != 1:  # (a block-scaled operand's: fp8_block_gemm's)
            raise ValueError(f"fp8_gemm: {name} must be one float32 scale (per tensor), got "
                             f"shape {tuple(s.shape)}; block scales go to fp8_block_gemm")
    xp = xp_of(a)
    fa, fb = _decode_table(xp, a_fmt)[a], _decode_table(xp, b_fmt)[b]
    acc = xp.matmul(fa, fb.T) * (a_scale_inv[0] * b_scale_inv[0])
    return gemm_epilogue(xp, acc.astype(np.float32, copy=False), out_dtype, bias, out,
                         accumulate, out_scale, amax_out, gelu, dgelu_aux, "fp8_gemm",
                         residual)


def gemm_epilogue(xp, acc, out_dtype, bias, out, accumulate, out_scale, amax_out, gelu,
                  dgelu_aux, op, residual=None):
    """An FP8 GEMM's epilogue on its float32 result acc (fp8_gemm's, fp8_block_gemm's)."""
    if residual is not None:
        if gelu or accumulate or isinstance(out_dtype, FP8Format):
            raise ValueError(f"{op}: a residual goes with a plain high-precision output")
        d = gemm_epilogue(xp, acc, out_dtype, bias, None, False, None, None, False, None, op)
        d = add_fwd(d, residual)  # the add op's arithmetic: the unfused path's bits
        if out is None:
            return d
        out[...] = d
        return out
    if dgelu_aux is not None:  # (out may be dgelu_aux: read before written)
        d = _dgelu(xp, acc.astype(out_dtype), dgelu_aux, bias).astype(out_dtype)
        if out is None:
            return d
        out[...] = d
        return out
    if bias is not None:
        acc = acc + bias.astype(np.float32)
    if gelu:
        k0, k1 = np.float32(0.7978845608028654), np.float32(0.044715)
        y = np.float32(0.5) * acc * (1 + xp.tanh(k0 * acc * (1 + k1 * acc * acc)))
        return y.astype(out_dtype), acc.astype(out_dtype)
    if isinstance(out_dtype, FP8Format):
        if out_scale is None or amax_out is None:
            raise ValueError(f"{op}: an FP8 output needs out_scale and amax_out")
        return cast_to_fp8(acc, out_scale, out_dtype, amax_out)[0]
    if accumulate:
        out += acc.astype(out.dtype)
        return out
    if out is not None:
        out[...] = acc
        return out
    return acc.astype(out_dtype)


def _dgelu(xp, d, aux, bias):
    """d * gelu'(aux + bias) in float32 (gelu's derivative from the activation table)."""
    from ..activation_table import TABLE
    h = aux.astype(np.float32) + (0 if bias is None else bias.astype(np.float32))
    return d.astype(np.float32) * TABLE["gelu"].df(h, xp).astype(np.float32)


@backends.register("fp8_scale_inv", "reference")
def fp8_scale_inv(scale, out):
    """out = 1 / scale in float32, subnormal results kept (on CuPy this runs under CuPy's
    -ftz=true and flushes them: the cuda implementation does not)."""
    out[...] = np.float32(1) / scale


@backends.register("delayed_scaling_update", "reference")
def delayed_scaling_update(metas, algo, margin):
    """Transformer Engine's fused amax-and-scale update, in place, for many FP8 metas.

    Each meta has amax_history [L, n], scale [n], scale_inv [n], fp8_max [n] (float32).
    Per slot: a = history[0]; if a == 0 nothing changes. Else the history rolls by -1 and
    row 0 is zeroed; amax = max over the old history (NaN ignored, as fmaxf) for "max", or
    a for "most_recent"; scale = (fp8_max * 2**-margin) / amax when amax is finite and > 0,
    else the old scale (TE's scaled_max / amax: finite at margin >= 1 for amaxes where
    fp8_max / amax alone overflows); an infinite scale becomes FLT_MAX; scale_inv = 1 / scale.
    """
    for m in metas:
        xp = xp_of(m.amax_history)
        h = m.amax_history
        last = h[0].copy()
        active = last != 0
        clean = xp.where(xp.isnan(h), np.float32(0), h)
        amax = clean.max(axis=0) if algo == "max" else last
        amax = xp.where(active, amax, np.float32(0))
        rolled = xp.roll(h, -1, axis=0)
        rolled[0] = 0
        h[...] = xp.where(active[None, :], rolled, h)
        ok = xp.isfinite(amax) & (amax > 0)
        with np.errstate(over="ignore"):  # a tiny amax gives inf, which becomes FLT_MAX
            new = scaled_max(m.fp8_max, margin) / xp.where(ok, amax, np.float32(1))
        scale = xp.where(ok, new, m.scale)
        scale = xp.where(xp.isinf(scale), np.float32(FLT_MAX), scale).astype(np.float32)
        m.scale[...] = scale
        m.scale_inv[...] = (np.float32(1) / scale).astype(np.float32)

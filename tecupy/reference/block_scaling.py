"""Reference block scaling (Float8BlockScaling): block quantize, dequantize, the block GEMM.

Array-module generic (NumPy or CuPy). Blocks of BLOCK = 128: block_dim 1 is 1x128 (128
consecutive values of a row), block_dim 2 is 128x128. Per block (Transformer Engine's
compute_scale_from_amax, common/recipe/recipe_common.cuh, used by its blockwise kernels in
common/transpose/quantize_transpose_{vector,square}_blockwise.cu):
    amax  = max |x| over the block in float32, NaN ignored (fmaxf); values past the tensor's
            edge count as 0
    a     = max(amax, amax_epsilon)
    scale = 1                        where a is 0, inf or NaN
            fp8_max / a (IEEE float32), an infinite quotient replaced by the input dtype's
            largest finite value (float32 and float64 inputs: FLT_MAX, bfloat16: 0x1.FEp127,
            float16: 65504)
            power_2_scale: then the mantissa bits cleared (rounded down to a power of two)
    codes = fp8(x * scale), as tecupy's per-tensor cast (round to nearest even, saturate;
            inf gives +-max, NaN the code 0x7F)
    scale_inv = 1 / scale (IEEE float32)

Layouts of scale_inv (float32, contiguous) for codes [rows, cols]:
    block_dim 1: [ceil(cols / 128), rows]; scale_inv[j, r] dequantizes codes[r, 128j:128j+128]
                 (K-block major, as Transformer Engine's GEMM-ready layout without its padding
                 to 4 and DeepGEMM's: the GEMM reads one contiguous row per K block)
    block_dim 2: [ceil(rows / 128), ceil(cols / 128)]; scale_inv[i, j] dequantizes
                 codes[128i:128i+128, 128j:128j+128]
The column-wise copy (codes_t [cols, rows], what wgrad and dgrad read) is laid out the same
way as a tensor of its own: block_dim 1 quantizes each column of x in blocks of 128 rows
from x itself (never from the row-wise codes), scale_inv_t [ceil(rows / 128), cols];
block_dim 2 has the same blocks, so codes_t = codes.T and scale_inv_t = scale_inv.T.
"""
import numpy as np

from .. import backends
from .._array import xp_of
from ..fp8 import FLT_MAX
from .fp8 import _decode_table, _encode, gemm_epilogue

BLOCK = 128
# an infinite fp8_max / amax becomes the input dtype's largest finite value (TE's
# compute_scale_from_types: TypeInfo<IType>::max_finite_value); TE has no float64 input
_INF_SCALE = {"float32": FLT_MAX, "float64": FLT_MAX, "float16": 65504.0,
              "bfloat16": float.fromhex("0x1.FEp127")}


def _cdiv(a, b):
    return -(-a // b)


def value_for_inf(dtype):
    return np.float32(_INF_SCALE[np.dtype(dtype).name])


def block_scale(amax, fp8_max, power_2_scale, amax_epsilon, inf_value):
    """Transformer Engine's compute_scale_from_amax on an array of float32 amaxes."""
    xp = xp_of(amax)
    a = amax.astype(np.float32)
    a = xp.where(a < np.float32(amax_epsilon), np.float32(amax_epsilon), a)
    one = xp.isinf(a) | xp.isnan(a) | (a == 0)
    with np.errstate(over="ignore", divide="ignore"):
        s = np.float32(fp8_max) / xp.where(one, np.float32(1), a)
    s = xp.where(xp.isinf(s), np.float32(inf_value), s).astype(np.float32)
    if power_2_scale:
        s = (s.view(np.uint32) & np.uint32(0xFF800000)).view(np.float32)
    return xp.where(one, np.float32(1), s).astype(np.float32)


def _padded(x32, rows, cols):
    """x32 [r, c] with zeros appended to `rows` x `cols` (zeros change no block's amax)."""
    xp = xp_of(x32)
    r, c = x32.shape
    if (r, c) == (rows, cols):
        return x32
    out = xp.zeros((rows, cols), np.float32)
    out[:r, :c] = x32
    return out


def _rowwise_1d(x32, fmt, p2, eps, inf_value):
    """1x128 blocks along the rows of x32 [R, C] -> (codes [R, C], scale_inv [nb, R])."""
    xp = xp_of(x32)
    r, c = x32.shape
    nb = _cdiv(c, BLOCK)
    xb = _padded(x32, r, nb * BLOCK).reshape(r, nb, BLOCK)
    a = xp.abs(xb)
    amax = xp.where(xp.isnan(a), np.float32(0), a).max(axis=2)  # [R, nb]
    s = block_scale(amax, fmt.max, p2, eps, inf_value)
    with np.errstate(invalid="ignore", over="ignore"):
        codes = _encode((xb * s[:, :, None]).reshape(r, nb * BLOCK), fmt)[:, :c]
    return xp.ascontiguousarray(codes), xp.ascontiguousarray((np.float32(1) / s).T)


def _tiles_2d(x32, fmt, p2, eps, inf_value):
    """128x128 blocks of x32 [R, C] -> (codes [R, C], scale_inv [rb, cb])."""
    xp = xp_of(x32)
    r, c = x32.shape
    rb, cb = _cdiv(r, BLOCK), _cdiv(c, BLOCK)
    xb = _padded(x32, rb * BLOCK, cb * BLOCK).reshape(rb, BLOCK, cb, BLOCK)
    a = xp.abs(xb)
    amax = xp.where(xp.isnan(a), np.float32(0), a).max(axis=(1, 3))  # [rb, cb]
    s = block_scale(amax, fmt.max, p2, eps, inf_value)
    with np.errstate(invalid="ignore", over="ignore"):
        codes = _encode((xb * s[:, None, :, None]).reshape(rb * BLOCK, cb * BLOCK), fmt)
    return xp.ascontiguousarray(codes[:r, :c]), (np.float32(1) / s).astype(np.float32)


@backends.register("block_quantize", "reference")
def block_quantize(x, fmt, block_dim, power_2_scale=True, amax_epsilon=0.0, transpose=False):
    """x [rows, cols] (any float dtype) -> (codes, scale_inv, codes_t or None, scale_inv_t
    or None): the row-wise codes with their block scales and, with transpose, the
    column-wise copy [cols, rows] with its own (layouts in the module's docstring)."""
    xp = xp_of(x)
    with np.errstate(over="ignore", invalid="ignore"):
        x32 = x.astype(np.float32)  # (float64 beyond float32: inf, which saturates)
    inf_value = value_for_inf(x.dtype)
    if block_dim == 2:
        q, s = _tiles_2d(x32, fmt, power_2_scale, amax_epsilon, inf_value)
        if not transpose:
            return q, s, None, None
        return q, s, xp.ascontiguousarray(q.T), xp.ascontiguousarray(s.T)
    q, s = _rowwise_1d(x32, fmt, power_2_scale, amax_epsilon, inf_value)
    if not transpose:
        return q, s, None, None
    qt, st = _rowwise_1d(xp.ascontiguousarray(x32.T), fmt, power_2_scale, amax_epsilon,
                         inf_value)
    return q, s, qt, st


@backends.register("block_quantize_act", "reference")
def block_quantize_act(h, bias, name, fmt, block_dim, power_2_scale=True, amax_epsilon=0.0,
                       transpose=False):
    """block_quantize of the activation `name`'s output act(h + bias) in h's dtype (the
    activation op's, then block_quantize)."""
    a = backends.dispatch(f"{name}_fwd", h, bias)
    return block_quantize(a, fmt, block_dim, power_2_scale, amax_epsilon, transpose)


@backends.register("block_quantize_dact", "reference")
def block_quantize_dact(dy, h, bias, name, fmt, power_2_scale, amax_epsilon, dbias_dtype):
    """The activation's backward dx = dy * act'(h + bias) in dy's dtype (the activation op's
    backward), then block_quantize_dbias of dx (dbias_dtype None: block_quantize, no dbias)
    -> (codes, scale_inv, codes_t, scale_inv_t, dbias or None)."""
    dx, _ = backends.dispatch(f"{name}_bwd", dy, h, bias)
    if dbias_dtype is None:
        return block_quantize(dx, fmt, 1, power_2_scale, amax_epsilon, True) + (None,)
    return block_quantize_dbias(dx, fmt, power_2_scale, amax_epsilon, dbias_dtype)


@backends.register("block_quantize_dbias", "reference")
def block_quantize_dbias(x, fmt, power_2_scale, amax_epsilon, dbias_dtype):
    """block_quantize(x, fmt, 1, power_2_scale, amax_epsilon, transpose=True) (the
    backward's cast of dy: 1x128 blocks, both copies), and dbias = the float32 column sums
    of x in dbias_dtype (bias_grad) -> (codes, scale_inv, codes_t, scale_inv_t, dbias)."""
    from .colsum import bias_grad
    return block_quantize(x, fmt, 1, power_2_scale, amax_epsilon, True) + (
        bias_grad(x, dbias_dtype),)


def block_dim_of(shape, scale_shape, op="fp8 block scaling"):
    """1 or 2: the blocks of codes of `shape` [rows, cols] whose scale_inv has
    `scale_shape` (where both fit, rows <= 1, they are the same blocks)."""
    r, c = shape
    if tuple(scale_shape) == (_cdiv(c, BLOCK), r):
        return 1
    if tuple(scale_shape) == (_cdiv(r, BLOCK), _cdiv(c, BLOCK)):
        return 2
    raise ValueError(f"{op}: scale_inv of shape {tuple(scale_shape)} fits neither 1x128 "
                     f"blocks ({(_cdiv(c, BLOCK), r)}) nor 128x128 blocks "
                     f"({(_cdiv(r, BLOCK), _cdiv(c, BLOCK))}) of codes {tuple(shape)}")


def row_scales(shape, scale_inv, op="fp8 block scaling"):
    """scale_inv as [rows, ceil(cols / 128)]: each row's factor per 128 of its columns."""
    xp = xp_of(scale_inv)
    if block_dim_of(shape, scale_inv.shape, op) == 1:
        return scale_inv.T
    return scale_inv[xp.arange(shape[0]) // BLOCK]


@backends.register("fp8_block_dequantize", "reference")
def fp8_block_dequantize(data, fmt, scale_inv, dtype):
    """decode(data) * its block's scale_inv, in `dtype`."""
    s = row_scales(data.shape, scale_inv, "fp8_block_dequantize")
    cols = data.shape[1]
    full = xp_of(data).repeat(s, BLOCK, axis=1)[:, :cols]
    with np.errstate(over="ignore"):
        return (_decode_table(xp_of(data), fmt)[data] * full).astype(dtype)


@backends.register("fp8_block_gemm", "reference")
def fp8_block_gemm(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias=None,
                   out=None, accumulate=False, split_accumulator=True, out_scale=None,
                   amax_out=None, gelu=False, dgelu_aux=None, residual=None):
    """TN GEMM of block-scaled codes: a [M, K], b [N, K] (uint8, K-major, each with its
    scale_inv in a block layout of the module's docstring) -> a @ b.T [M, N].

    Accumulation order (the GPU GEMM's promotion, DeepGEMM's and Transformer Engine's
    split accumulator): for each K block kb = 0, 1, ... in order,
        partial = sum over k in block kb of decode(a[m, k]) * decode(b[n, k])   (float32
                  matmul of the decoded codes; the order within a block is BLAS's here,
                  the tensor cores' on the GPU: not bit-exact between the two)
        acc     = acc + partial * (sa[m, kb] * sb[n, kb])     (float32, two roundings;
                  the GPU's FMA rounds once: with power-of-two scales both are exact)
    starting from acc = 0, then the epilogue as fp8_gemm's (bias added in float32, the
    output dtype, accumulate into `out`, an FP8 output, gelu, dgelu_aux, the residual add).
    split_accumulator is accepted and always on (block scaling requires it)."""
    xp = xp_of(a)
    (m, k), (n, k2) = a.shape, b.shape
    if k != k2:
        raise ValueError(f"fp8_block_gemm: a is [M, K] = {tuple(a.shape)} and b [N, K] = "
                         f"{tuple(b.shape)}: their K differ")
    sa = row_scales(a.shape, a_scale_inv, "fp8_block_gemm (a)")  # [M, kb]
    sb = row_scales(b.shape, b_scale_inv, "fp8_block_gemm (b)")  # [N, kb]
    fa, fb = _decode_table(xp, a_fmt)[a], _decode_table(xp, b_fmt)[b]
    acc = xp.zeros((m, n), np.float32)
    for kb in range(_cdiv(k, BLOCK)):
        ks = slice(kb * BLOCK, min(k, (kb + 1) * BLOCK))
        partial = xp.matmul(fa[:, ks], fb[:, ks].T)
        acc = acc + partial * (sa[:, kb:kb + 1] * sb[None, :, kb])
    return gemm_epilogue(xp, acc, out_dtype, bias, out, accumulate, out_scale, amax_out,
                         gelu, dgelu_aux, "fp8_block_gemm", residual)



"""Reference statistics of one FP8 cast for FP8Inspector (kernels/inspect.py's inspect_cast
and inspect_codes, same arguments): array ops on NumPy or CuPy, adding into row `row` of the
step's int64 accumulator acc [records, 8], whose words 0, 1, 6, 7 hold float64 bits:
    0 amax (max |x|, NaN ignored; as fp8.amax: in float32)   1 scale
    2 nonzero (non-NaN x != 0)     3 flushed (those with a +-0 code)
    4 valid (non-NaN x)            5 saturated (|float32(x) * scale| > the format's max)
    6 err2, 7 ref2: sums of (dequantize(code) - x)^2 and x^2 in float64 over the finite x
      of the elements i % stride == 0
From codes alone (a producer-fused cast): amax the slot's (NaN without one), the scale, the
non-NaN codes (2 and 4), +-0 codes (3), +-max codes (5), NaN sums."""
import numpy as np

from .. import backends
from .._array import xp_of


def _words(acc, row):
    """(int64 row, float64 view of it) of acc[row]."""
    r = acc[row]
    return r, r.view(np.float64)


@backends.register("inspect_cast", "reference")
def inspect_cast(x, codes, fmt, scale, scale_inv, acc, row, stride):
    xp = xp_of(x)
    ints, floats = _words(acc, row)
    xf = x.reshape(-1)
    if xf.dtype not in (np.float32, np.float64):  # half types: exact in float32
        xf = xf.astype(np.float32)
    codes = codes.reshape(-1)
    if codes.size != xf.size:
        raise ValueError(f"inspect_cast: {codes.size} codes for {xf.size} values")
    a = xp.abs(xf.astype(np.float32))  # fp8.amax's reference: float32, NaN ignored
    a = xp.max(xp.where(xp.isnan(a), np.float32(0), a)) if a.size else np.float32(0)
    floats[0] = xp.maximum(floats[0], a.astype(np.float64))
    floats[1] = scale.reshape(-1)[0].astype(np.float64)
    valid = xp.count_nonzero(xf == xf)
    nonzero = xp.count_nonzero(xf) - (xf.size - valid)  # (NaN is nonzero)
    flushed = xp.count_nonzero((xf != 0) & (xf == xf) & ((codes & 0x7F) == 0))
    with np.errstate(over="ignore", invalid="ignore"):  # as the cast: float32 product
        v = xf.astype(np.float32) * scale.reshape(-1)[0]
        saturated = xp.count_nonzero(xp.abs(v) > np.float32(fmt.max))
    for k, c in zip((2, 3, 4, 5), (nonzero, flushed, valid, saturated)):
        ints[k] += c
    err2, ref2 = _round_trip(xf, codes, fmt, scale_inv, max(1, int(stride)))
    floats[6] += err2
    floats[7] += ref2


def _round_trip(xf, codes, fmt, scale_inv, stride):
    """(sum of squared errors of the dequantized codes, sum of squares of x) in float64 over
    the finite elements i % stride == 0."""
    xp = xp_of(xf)
    if stride > 1:
        xf, codes = xf[::stride], xp.ascontiguousarray(codes[::stride])
    deq = backends.dispatch("fp8_dequantize", codes, fmt, scale_inv, np.dtype(np.float32))
    ref = xf.astype(np.float64)
    finite = xp.isfinite(ref)
    ref = xp.where(finite, ref, 0.0)
    err = xp.where(finite, deq.astype(np.float64) - ref, 0.0)
    return (err * err).sum(), (ref * ref).sum()


@backends.register("inspect_block_cast", "reference")
def inspect_block_cast(x, codes, fmt, scale_inv, acc, row, stride):
    """inspect_cast of a block cast (Float8BlockScaling): x [rows, cols] cast into codes
    with one scale per 1x128 or 128x128 block (scale_inv in its block layout). Word 1 holds
    the smallest of the blocks' scales, 1 / max(scale_inv) (the block of the largest amax);
    saturated: |float32(x)| > max * its block's scale_inv (what exceeds the format at its
    block's scale; the scales come from the blocks' own amaxes, so only inf can). Array ops
    on NumPy or CuPy: this also runs on the GPU, a few passes over x."""
    from .block_scaling import BLOCK, row_scales
    xp = xp_of(x)
    ints, floats = _words(acc, row)
    if codes.shape != x.shape or x.ndim != 2:
        raise ValueError(f"inspect_block_cast: codes {codes.shape} for x {x.shape} (2-D)")
    xf = x if x.dtype in (np.float32, np.float64) else x.astype(np.float32)
    per = xp.repeat(row_scales(x.shape, scale_inv), BLOCK, axis=1)[:, :x.shape[1]]
    a = xp.abs(xf.astype(np.float32))
    a = xp.max(xp.where(xp.isnan(a), np.float32(0), a)) if a.size else np.float32(0)
    floats[0] = xp.maximum(floats[0], a.astype(np.float64))
    floats[1] = 1.0 / scale_inv.max().astype(np.float64) if scale_inv.size else np.nan
    valid = xp.count_nonzero(xf == xf)
    nonzero = xp.count_nonzero(xf) - (xf.size - valid)
    flushed = xp.count_nonzero((xf != 0) & (xf == xf) & ((codes & 0x7F) == 0))
    with np.errstate(over="ignore", invalid="ignore"):
        saturated = xp.count_nonzero(xp.abs(xf.astype(np.float32))
                                     > np.float32(fmt.max) * per.astype(np.float32))
    for k, c in zip((2, 3, 4, 5), (nonzero, flushed, valid, saturated)):
        ints[k] += c
    deq = backends.dispatch("fp8_block_dequantize", codes, fmt, scale_inv,
                            np.dtype(np.float32)).reshape(-1)[::max(1, int(stride))]
    ref = xf.reshape(-1)[::max(1, int(stride))].astype(np.float64)
    finite = xp.isfinite(ref)
    ref = xp.where(finite, ref, 0.0)
    err = xp.where(finite, deq.astype(np.float64) - ref, 0.0)
    floats[6] += (err * err).sum()
    floats[7] += (ref * ref).sum()


# the magnitude code of each format's max (0x7E: 448 in E4M3, 0x7B: 57344 in E5M2)
def max_code(fmt):
    return int(np.array(fmt.max, np.float32).astype(fmt.ml_dtype).view(np.uint8))


@backends.register("inspect_codes", "reference")
def inspect_codes(codes, fmt, scale, amax, acc, row):
    xp = xp_of(codes)
    ints, floats = _words(acc, row)
    mag = codes.reshape(-1) & 0x7F
    top = max_code(fmt)
    valid = xp.count_nonzero(mag <= top)  # above max: inf and NaN codes (NaN casts: 0x7F)
    floats[0] = np.nan if amax is None else amax.reshape(-1)[0].astype(np.float64)
    floats[1] = scale.reshape(-1)[0].astype(np.float64)
    for k, c in zip((2, 3, 4, 5), (valid, xp.count_nonzero(mag == 0), valid,
                                   xp.count_nonzero(mag == top))):
        ints[k] += c
    floats[6] = floats[7] = np.nan

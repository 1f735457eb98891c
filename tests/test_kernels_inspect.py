"""FP8Inspector's per-cast statistics (backend ops inspect_cast / inspect_codes): the NumPy
reference (tecupy/reference/inspect.py) against a plain element-by-element NumPy computation
on fresh random data of odd sizes with NaN, inf, zeros, values flushed to zero, values
saturated at the format's max built in, both formats; the accumulator's layout; cuda/inspect.cu
compiling with NVRTC. The CUDA kernels against this reference: tests/test_inspect_gpu.py."""
import math

import numpy as np
import pytest

import tecupy
from tecupy import fp8, loader
from tecupy.inspect import _decode
from tecupy.kernels import inspect as kernel
from tecupy.reference import inspect as ref

FMTS = [fp8.E4M3, fp8.E5M2]
DTYPES = [np.float32, np.float16, tecupy.bfloat16]


def special_input(rng, fmt, scale, n, dtype):
    """x (dtype) of n values, about a third of them special: NaN, +-inf, +-0, values that
    flush (below half the smallest subnormal after scaling: some land at exactly half, which
    rounds to even, 0), values just above (kept), values at and above the max (saturate),
    values far beyond (inf after the float32 product); the rest normal, both signs."""
    tiny, scale = 2.0 ** (1 - fmt.bias - fmt.mbits), float(scale)  # the smallest subnormal
    pool = np.array([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, tiny / 2, -tiny / 2,
                     tiny * 0.3, tiny * 0.51, tiny, fmt.max, -fmt.max, fmt.max * 1.2,
                     -fmt.max * 7, 1e38 * scale, -3e38 * scale])
    x = rng.uniform(-1, 1, n) * fmt.max * 10.0 ** rng.uniform(-6, 0, n)
    pick = rng.random(n) < 0.35
    x[pick] = rng.choice(pool, int(pick.sum()))
    with np.errstate(over="ignore"):
        return (x / scale).astype(dtype)


def cast_codes(x, fmt, scale):
    """Transformer Engine's cast, independently: float32 product, clip to +-max (NaN stays),
    ml_dtypes' round to nearest even."""
    with np.errstate(over="ignore", invalid="ignore"):
        v = x.astype(np.float32) * np.float32(scale)
    return np.clip(v, -fmt.max, fmt.max).astype(fmt.ml_dtype).view(np.uint8)


def plain_stats(x, codes, fmt, scale, stride):
    """The record's 8 numbers, element by element in float64 (math.fsum for the sums)."""
    x32 = x.reshape(-1).astype(np.float32)
    codes = codes.reshape(-1)
    deq = codes.view(fmt.ml_dtype).astype(np.float32) * (np.float32(1) / np.float32(scale))
    nonzero = flushed = valid = saturated = 0
    amax, err, sq = 0.0, [], []
    for i, (v, c, d) in enumerate(zip(x32.tolist(), codes.tolist(), deq.tolist())):
        if math.isnan(v):
            continue
        valid += 1
        amax = max(amax, abs(v))
        if v != 0:
            nonzero += 1
            flushed += (c & 0x7F) == 0
        with np.errstate(over="ignore"):
            saturated += abs(float(np.float32(v) * np.float32(scale))) > fmt.max
        if i % stride == 0 and math.isfinite(v):
            err.append((d - v) ** 2)
            sq.append(v * v)
    return [amax, float(np.float32(scale)), nonzero, flushed, valid, saturated,
            math.fsum(err), math.fsum(sq)]


def record(acc, row):
    return _decode(acc[row:row + 1])[0]


def run_cast(x, codes, fmt, scale, stride, rows=3, row=1):
    """The reference into row `row` of an accumulator whose other rows hold a pattern that
    must stay."""
    acc = np.zeros((rows, 8), np.int64)
    others = [r for r in range(rows) if r != row]
    acc[others] = np.arange(8) * 1000 + 7
    inv = np.float32(1) / np.float32(scale)
    ref.inspect_cast(x, codes, fmt, np.array([scale], np.float32), np.array([inv], np.float32),
                     acc, row, stride)
    assert (acc[others] == np.arange(8) * 1000 + 7).all()
    return acc


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (997,), (31, 45)], ids=str)
@pytest.mark.parametrize("stride", [1, 2, 7, 100])
def test_reference_equals_plain_numpy(rng, fmt, dtype, shape, stride):
    scale = np.float32(2.0 ** rng.uniform(-4, 4))  # not a power of two
    x = special_input(rng, fmt, scale, int(np.prod(shape)), dtype).reshape(shape)
    codes = cast_codes(x, fmt, scale).reshape(shape)
    got = record(run_cast(x, codes, fmt, scale, stride), 1)
    want = plain_stats(x, codes, fmt, scale, stride)
    np.testing.assert_array_equal(got[:6], want[:6])  # amax, scale and the counts: exact
    np.testing.assert_allclose(got[6:], want[6:], rtol=1e-12, atol=0)


@pytest.mark.parametrize("fmt", FMTS)
def test_the_boundaries_are_counted(rng, fmt):
    """Built value by value: which values flush, saturate, are skipped."""
    tiny = 2.0 ** (1 - fmt.bias - fmt.mbits)
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, tiny / 2, -tiny / 2, tiny * 0.51,
                  fmt.max, fmt.max * 1.0001, -fmt.max * 3, 1.0], np.float32)
    codes = cast_codes(x, fmt, 1.0)
    got = record(run_cast(x, codes, fmt, 1.0, 1), 1)
    # nonzero non-NaN: inf, -inf, +-tiny/2 (flushed: half the smallest subnormal rounds to
    # even, 0), tiny * 0.51 (kept), max, 1.0001 max, -3 max, 1; non-NaN: those and +-0;
    # saturated: inf, -inf, 1.0001 max, -3 max (max itself is not)
    assert list(got[2:6]) == [9, 2, 11, 4]
    assert got[0] == np.inf and got[1] == 1.0
    fin = np.isfinite(x)
    deq = codes.view(fmt.ml_dtype).astype(np.float64)
    np.testing.assert_allclose(got[6], np.sum((deq[fin] - x[fin].astype(np.float64)) ** 2),
                               rtol=1e-12)
    np.testing.assert_allclose(got[7], np.sum(x[fin].astype(np.float64) ** 2), rtol=1e-12)


def test_adds_into_the_row(rng):
    """Two casts into one row: counts and sums add, amax is the max, the scale the last."""
    fmt = fp8.E4M3
    a = special_input(rng, fmt, 2.0, 301, np.float32)
    b = special_input(rng, fmt, 0.125, 77, np.float32)
    acc = np.zeros((1, 8), np.int64)
    for x, s in ((a, 2.0), (b, 0.5)):
        ref.inspect_cast(x, cast_codes(x, fmt, s), fmt, np.array([s], np.float32),
                         np.array([1 / s], np.float32), acc, 0, 3)
    got = record(acc, 0)
    wa, wb = (plain_stats(x, cast_codes(x, fmt, s), fmt, s, 3) for x, s in ((a, 2.0), (b, 0.5)))
    assert got[0] == max(wa[0], wb[0]) and got[1] == 0.5
    np.testing.assert_array_equal(got[2:6], np.add(wa[2:6], wb[2:6]))
    np.testing.assert_allclose(got[6:], np.add(wa[6:], wb[6:]), rtol=1e-12)


def test_empty_and_all_nan():
    fmt = fp8.E5M2
    one = np.ones(1, np.float32)
    got = record(run_cast(np.zeros(0, np.float32), np.zeros(0, np.uint8), fmt, 1.0, 1), 1)
    np.testing.assert_array_equal(got, [0, 1, 0, 0, 0, 0, 0, 0])
    x = np.full(5, np.nan, np.float32)
    acc = np.zeros((1, 8), np.int64)
    ref.inspect_cast(x, cast_codes(x, fmt, 1.0), fmt, one, one, acc, 0, 1)
    np.testing.assert_array_equal(record(acc, 0), [0, 1, 0, 0, 0, 0, 0, 0])


def plain_code_counts(codes, fmt):
    """(non-NaN codes, +-0 codes, +-max codes) from ml_dtypes' decoding."""
    v = codes.reshape(-1).view(fmt.ml_dtype).astype(np.float64)
    ok = ~np.isnan(v) & ~np.isinf(v)
    return (int(ok.sum()), int((ok & (v == 0)).sum()), int((ok & (np.abs(v) == fmt.max)).sum()))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("shape", [(5,), (255,), (4099,), (37, 91)], ids=str)
@pytest.mark.parametrize("with_amax", [False, True])
def test_codes_reference_equals_plain_numpy(rng, fmt, shape, with_amax):
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    codes.reshape(-1)[:4] = [0x00, 0x80, kernel.MAX_CODE[fmt.name], 0x7F]  # +-0, max, NaN
    scale = np.array([2.0 ** rng.uniform(-3, 3)], np.float32)
    amax = np.array([rng.uniform(0, 100)], np.float32) if with_amax else None
    acc = np.full((2, 8), 12345, np.int64)
    acc[0] = 0
    ref.inspect_codes(codes, fmt, scale, amax, acc, 0)
    assert (acc[1] == 12345).all()
    got = record(acc, 0)
    valid, zeros, at_max = plain_code_counts(codes, fmt)
    assert zeros >= 2 and at_max >= 1
    np.testing.assert_array_equal(got[2:6], [valid, zeros, valid, at_max])
    assert got[1] == scale[0] and np.isnan(got[6:]).all()
    assert got[0] == amax[0] if with_amax else np.isnan(got[0])


def test_max_codes_agree():
    """The launcher's table of max codes (kernels/inspect.py) is the one ml_dtypes gives."""
    assert kernel.MAX_CODE == {f.name: ref.max_code(f) for f in FMTS} == {"e4m3": 0x7E,
                                                                           "e5m2": 0x7B}


def test_decode_layout():
    """Words 0, 1, 6, 7 are float64 bits, 2-5 int64 counts (cuda/inspect.cu's record)."""
    words = np.zeros((1, 8), np.int64)
    words.view(np.float64)[0, [0, 1, 6, 7]] = [3.5, 0.25, 1e-3, np.nan]
    words[0, 2:6] = [2 ** 53, 5, 6, 7]
    np.testing.assert_array_equal(_decode(words)[0], [3.5, 0.25, 2.0 ** 53, 5, 6, 7, 1e-3,
                                                      np.nan])


def test_kernels_compile_with_nvrtc():
    names = loader.declared("sm_90a")["inspect.cu"]
    _, lowered = loader.compile_together("inspect.cu", names, "sm_90a")
    # inspect_cast and inspect_block_cast x 3 dtypes x 2 formats x 2 vector widths, codes x 2
    assert len(lowered) == len(names) == 2 * 3 * 2 * 2 + 2

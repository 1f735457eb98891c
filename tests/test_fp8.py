"""FP8 numerics: the cast is bit-exact against ml_dtypes (after clipping to +-max, which is
the saturating cast Transformer Engine uses), dequantize and amax follow TE's rules."""
import ml_dtypes
import numpy as np
import pytest

import tecupy
from tecupy.fp8 import E4M3, E5M2, current_scale
from conftest import asnp

FORMATS = [E4M3, E5M2]


def expected_codes(x32, fmt):
    """ml_dtypes does not saturate (500 -> NaN in e4m3fn): clip first, then convert; NaN is
    the canonical code 0x7F (ml_dtypes keeps the sign and gives 0x7E for E5M2)."""
    clipped = np.where(np.isnan(x32), x32, np.clip(x32, -fmt.max, fmt.max))
    return np.where(np.isnan(x32), np.uint8(0x7F), clipped.astype(fmt.ml_dtype).view(np.uint8))


def special_values(fmt):
    tiny = 2.0 ** (1 - fmt.bias - fmt.mbits)  # smallest subnormal
    vals = [0.0, -0.0, fmt.max, -fmt.max, fmt.max * 1.01, -fmt.max * 4, np.inf, -np.inf,
            tiny, tiny / 2, tiny * 0.51, tiny * 1.5, tiny * 2.5, 2.0 ** (1 - fmt.bias),
            1e-30, -1e-38, 1.0, 1.0625, 1.1875, 3.4e38]
    return np.array(vals, np.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_cast_bit_exact_random(xp, rng, fmt):
    # Values spread over the whole range, including subnormals and saturation.
    x = (rng.standard_normal(4099) * 2.0 ** rng.integers(-25, 20, 4099)).astype(np.float32)
    scale = np.float32(rng.uniform(0.5, 4))
    q = tecupy.quantize(xp.asarray(x), xp.asarray([scale], np.float32), fmt)
    np.testing.assert_array_equal(asnp(q.data), expected_codes(x * scale, fmt))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_cast_specials_saturate_and_keep_nan(xp, fmt):
    x = special_values(fmt)
    q = tecupy.quantize(xp.asarray(x), 1.0, fmt)
    np.testing.assert_array_equal(asnp(q.data), expected_codes(x, fmt))
    back = asnp(q.dequantize())
    assert back[x == np.inf][0] == fmt.max and back[x == -np.inf][0] == -fmt.max
    qn = tecupy.quantize(xp.asarray(np.array([np.nan, 1.0], np.float32)), 1.0, fmt)
    assert np.isnan(asnp(qn.dequantize())[0])


def test_cast_ties_round_to_even(xp):
    # 1 + 1/16 lies halfway between 1 and 1.125 in E4M3: even mantissa (1.0) wins;
    # 1 + 3/16 is halfway between 1.125 and 1.25: 1.25 (even) wins.
    x = xp.asarray(np.array([1.0625, 1.1875, -1.0625], np.float32))
    np.testing.assert_array_equal(asnp(tecupy.quantize(x, 1.0, E4M3).dequantize()),
                                  [1.0, 1.25, -1.0])


@pytest.mark.parametrize("dtype", [np.float16, tecupy.bfloat16, np.float32])
def test_cast_low_precision_inputs_and_amax(xp, rng, dtype):
    x = rng.standard_normal((37, 19)).astype(dtype)
    x[3, 4] = np.nan
    amax_out = xp.zeros((1,), np.float32)
    q = tecupy.quantize(xp.asarray(x), 2.0, E4M3, amax_out=amax_out)
    x32 = x.astype(np.float32)
    np.testing.assert_array_equal(asnp(q.data), expected_codes(x32 * 2, E4M3))
    assert asnp(amax_out)[0] == np.nanmax(np.abs(x32))  # NaN ignored, as fmaxf
    np.testing.assert_allclose(asnp(q.scale_inv), [0.5])


def test_amax_accumulates_max_and_handles_empty(xp):
    out = xp.asarray(np.array([5.0], np.float32))
    tecupy.quantize(xp.asarray(np.array([1.0, -3.0], np.float32)), 1.0, E4M3, amax_out=out)
    assert asnp(out)[0] == 5.0  # max with what is there, like the kernel's atomicMax
    assert asnp(tecupy.fp8.amax(xp.zeros((0,), np.float32)))[0] == 0.0
    all_nan = xp.asarray(np.full(3, np.nan, np.float32))
    assert asnp(tecupy.fp8.amax(all_nan))[0] == 0.0


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_dequantize_every_code(xp, fmt):
    codes = np.arange(256, dtype=np.uint8)
    t = tecupy.FP8Tensor(xp.asarray(codes), fmt, xp.asarray([0.25], np.float32))
    want = codes.view(fmt.ml_dtype).astype(np.float32) * np.float32(0.25)
    got = asnp(t.dequantize(np.float32))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    assert asnp(t.dequantize(tecupy.bfloat16)).dtype == tecupy.bfloat16


def test_roundtrip_error_within_format_precision(xp, rng):
    x = rng.standard_normal((64, 33)).astype(np.float32)
    for fmt, rel in ((E4M3, 2.0 ** -4), (E5M2, 2.0 ** -3)):
        s = current_scale(tecupy.fp8.amax(xp.asarray(x)), fmt)
        y = asnp(tecupy.quantize(xp.asarray(x), s, fmt).dequantize())
        big = np.abs(x) > 1e-2 * np.abs(x).max()
        assert np.all(np.abs(y - x)[big] <= rel * np.abs(x)[big] + 1e-6)


def test_current_scale_rules(xp):
    # 1e-37 is a normal float32 whose 448/amax overflows (CuPy's kernels flush denormals).
    a = xp.asarray(np.array([0.0, np.inf, 1e-37, 2.0], np.float32))
    s = asnp(current_scale(a, E4M3))
    np.testing.assert_array_equal(s, np.array([1.0, 1.0, np.finfo(np.float32).max, 224.0],
                                              np.float32))


def test_transpose_copy(xp, rng):
    x = xp.asarray(rng.standard_normal((16, 48)).astype(np.float32))
    q = tecupy.quantize(x, 1.0, E4M3)
    np.testing.assert_array_equal(asnp(q.T.data), asnp(q.data).T)
    assert q.T.data.flags.c_contiguous


def test_ml_dtypes_behaviour_we_rely_on():
    # The reason the reference clips before converting (DESIGN.md).
    assert np.isnan(np.float32(500).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    assert np.isinf(np.float32(61440).astype(ml_dtypes.float8_e5m2).astype(np.float32))


def test_bad_fp8_inputs():
    with pytest.raises(ValueError, match="quantize: fmt must be 'e4m3', 'e5m2'"):
        tecupy.quantize(np.ones(4, np.float32), 1.0, "e3m4")
    with pytest.raises(TypeError, match="accepted"):
        tecupy.quantize(np.ones(4, np.int32), 1.0, E4M3)
    with pytest.raises(TypeError, match="uint8"):
        tecupy.FP8Tensor(np.ones(4, np.float32), E4M3, np.ones(1, np.float32))
    with pytest.raises(TypeError, match="float32 array of one element"):
        tecupy.quantize(np.ones(4, np.float32), np.ones(2, np.float32), E4M3)


@pytest.mark.parametrize("bad", [np.nan, 0.0, -1.0, np.inf])
def test_scale_checked_where_it_costs_no_device_read(xp, bad):
    """A number or a NumPy scale is checked (finite, > 0); a CuPy scale is not read (a host
    sync on every cast): a NaN there gives NaN codes, 0x7F, as Transformer Engine's casts."""
    x = xp.asarray(np.array([1.0, -2.0, 3.0], np.float32))
    with pytest.raises(ValueError, match="quantize: scale must be"):
        tecupy.quantize(x, bad, E4M3)
    scale = xp.asarray(np.array([bad], np.float32))
    if xp is np:
        with pytest.raises(ValueError, match="got a numpy array holding"):
            tecupy.quantize(x, scale, E4M3)
    elif np.isnan(bad):
        assert (asnp(tecupy.quantize(x, scale, E4M3).data) == 0x7F).all()


def test_quantize_with_transpose_keeps_both_copies(xp, rng):
    x = xp.asarray(rng.standard_normal((16, 48)).astype(np.float32))
    q = tecupy.quantize(x, 2.0, E4M3, transpose=True)
    np.testing.assert_array_equal(asnp(q.data_t), asnp(q.data).T)
    assert q.T.data is q.data_t and q.T.T.data is q.data  # no new copies
    with pytest.raises(ValueError, match="2-D"):
        tecupy.quantize(xp.ones((2, 2, 2), np.float32), 1.0, E4M3, transpose=True)


@pytest.mark.parametrize("dtype", [np.float32, tecupy.bfloat16])
def test_quantize_with_dbias_returns_the_column_sums(xp, rng, dtype):
    """dbias_dtype: (the same FP8 tensor, dy's column sums) from one call (on CuPy, one
    pass of the cast_transpose_dbias kernel), as bias_grad computes them."""
    x = xp.asarray((rng.standard_normal((272, 40)) + 1.0).astype(dtype))
    q, db = tecupy.quantize(x, 2.0, E5M2, transpose=True, dbias_dtype=dtype)
    plain = tecupy.quantize(x, 2.0, E5M2, transpose=True)
    np.testing.assert_array_equal(asnp(q.data), asnp(plain.data))
    np.testing.assert_array_equal(asnp(q.data_t), asnp(plain.data_t))
    want = asnp(x).astype(np.float64).sum(0)
    assert db.dtype == np.dtype(dtype) and db.shape == (40,)
    np.testing.assert_allclose(asnp(db).astype(np.float64), want, rtol=1e-2, atol=1e-3)
    with pytest.raises(ValueError, match="transpose=True"):
        tecupy.quantize(x, 2.0, E5M2, dbias_dtype=dtype)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_nan_casts_to_the_canonical_code(xp, rng, fmt):
    """+NaN and -NaN (any payload) give 0x7F in both formats, as CUDA's conversion does
    (cuda_fp8.hpp, __nv_cvt_float_to_fp8: a NaN input is made 0x7FFFFFFF first; the
    conversion of that gives 0x7F for E4M3 and 0x7E | mantissa = 0x7F for E5M2), which
    Transformer Engine's casts use (static_cast to __nv_fp8_e4m3 / __nv_fp8_e5m2)."""
    payloads = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF,
                         0xFFFFFFFF], np.uint32).view(np.float32)
    x = np.concatenate([payloads, rng.standard_normal(10).astype(np.float32)])
    q = asnp(tecupy.quantize(xp.asarray(x), 2.0, fmt).data)
    np.testing.assert_array_equal(q[:6], 0x7F)
    np.testing.assert_array_equal(q[6:], expected_codes(x[6:] * 2, fmt))
    assert np.isnan(asnp(tecupy.FP8Tensor(xp.asarray(q), fmt, xp.ones(1, np.float32))
                         .dequantize())[:6]).all()


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_, "int64", None, "nonsense"])
def test_dequantize_refuses_non_floating_dtypes(dtype):
    """An integer dtype would truncate silently (the issue: dequantize(dtype=int32))."""
    t = tecupy.quantize(np.array([1.5, -2.25], np.float32), 1.0, E4M3)
    with pytest.raises(TypeError, match="dequantize: dtype must be a floating dtype"):
        t.dequantize(dtype)
    with pytest.raises(TypeError, match="FP8Tensor"):
        tecupy.dequantize(np.zeros(2, np.uint8))


@pytest.mark.parametrize("dtype", [np.float16, tecupy.bfloat16, np.float32, np.float64])
def test_dequantize_floating_dtypes(dtype):
    t = tecupy.quantize(np.array([1.5, -2.25], np.float32), 1.0, E4M3)
    y = tecupy.dequantize(t, dtype)
    assert y.dtype == np.dtype(dtype) and np.all(y.astype(np.float32) == [1.5, -2.25])


def test_formats_pickle_to_themselves():
    import copy
    import pickle
    for fmt in FORMATS:
        assert pickle.loads(pickle.dumps(fmt)) is fmt and copy.deepcopy(fmt) is fmt

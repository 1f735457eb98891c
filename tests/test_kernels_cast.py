"""CUDA cast to FP8 with amax, and dequantize, against the reference, bit for bit (NaN
included: both give the canonical code 0x7F for a NaN of either sign)."""
import ml_dtypes
import numpy as np
import pytest

import tecupy
from tecupy.activation_table import TABLE
from tecupy.fp8 import E4M3, E5M2
from tecupy.reference import fp8 as ref
from conftest import poison_gpu_pool

pytestmark = pytest.mark.gpu


def assert_cast_transpose_of(x, scale, q, qt, amax):
    """The E5M2 codes, transposed codes and amax (CuPy) are the reference cast's of x."""
    import cupy
    q_ref, qt_ref, amax_ref = ref.cast_transpose(x, cupy.asnumpy(scale), E5M2)
    assert_same_codes(cupy.asnumpy(q), q_ref, E5M2)
    assert_same_codes(cupy.asnumpy(qt), qt_ref, E5M2)
    np.testing.assert_array_equal(cupy.asnumpy(amax), amax_ref)


def assert_same_codes(got, want, fmt):
    np.testing.assert_array_equal(got, want, err_msg=f"{fmt.name} codes")


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16, np.float64])
# sizes for each path: scalar (odd sizes), one 16-byte vector per step (5 x 24 of 16-bit
# types), two (37 x 48, and every size a multiple of 16 with a 32-byte aligned base)
@pytest.mark.parametrize("shape", [(1,), (1023,), (257, 129), (4099, 33), (5, 24), (37, 48)])
def test_cast_matches_reference(rng, fmt, dtype, shape):
    import cupy
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-12, 12, shape)).astype(dtype)
    x.reshape(-1)[:: 97] = np.nan
    x.reshape(-1)[5 % x.size] = np.inf
    scale = cupy.asarray([rng.uniform(0.1, 8)], np.float32)
    poison_gpu_pool()
    assert tecupy.backends.chosen("cast_to_fp8", cupy.asarray(x), scale, fmt) == "cuda"
    q, amax = tecupy.backends.dispatch("cast_to_fp8", cupy.asarray(x), scale, fmt)
    q_ref, amax_ref = ref.cast_to_fp8(x, cupy.asnumpy(scale), fmt)
    assert_same_codes(cupy.asnumpy(q), q_ref, fmt)
    np.testing.assert_array_equal(cupy.asnumpy(amax), amax_ref)


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
def test_dequantize_matches_reference(rng, fmt, dtype):
    import cupy
    codes = rng.integers(0, 256, (333, 77)).astype(np.uint8)
    sinv = np.array([rng.uniform(0.01, 3)], np.float32)
    poison_gpu_pool()
    got = tecupy.backends.dispatch("fp8_dequantize", cupy.asarray(codes), fmt,
                                   cupy.asarray(sinv), np.dtype(dtype))
    want = ref.fp8_dequantize(codes, fmt, sinv, np.dtype(dtype))
    np.testing.assert_array_equal(cupy.asnumpy(got).astype(np.float32),
                                  want.astype(np.float32))


def test_quantize_accumulates_amax_on_gpu(rng):
    import cupy
    x = cupy.asarray(rng.standard_normal(1000).astype(np.float32))
    out = cupy.asarray([100.0], np.float32)
    tecupy.quantize(x, 1.0, E4M3, amax_out=out)
    assert float(out[0]) == 100.0
    out[...] = 0
    tecupy.quantize(x, 1.0, E4M3, amax_out=out)
    assert float(out[0]) == float(abs(x).max())


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("shape", [(16, 8), (144, 72), (1008, 520), (64, 4096), (272, 136),
                                   (1, 1), (3001, 1001), (131, 64), (16, 7), (272, 1001)],
                         ids=str)
def test_cast_transpose_matches_reference(rng, fmt, dtype, shape):
    import cupy
    x = (rng.standard_normal(shape) * 2.0 ** rng.integers(-8, 8, shape)).astype(dtype)
    scale = cupy.asarray([rng.uniform(0.1, 8)], np.float32)
    poison_gpu_pool()
    assert tecupy.backends.chosen("cast_transpose", cupy.asarray(x), scale, fmt) == "cuda"
    q, qt, amax = tecupy.backends.dispatch("cast_transpose", cupy.asarray(x), scale, fmt)
    q_ref, qt_ref, amax_ref = ref.cast_transpose(x, cupy.asnumpy(scale), fmt)
    assert_same_codes(cupy.asnumpy(q), q_ref, fmt)
    assert_same_codes(cupy.asnumpy(qt), qt_ref, fmt)
    np.testing.assert_array_equal(cupy.asnumpy(amax), amax_ref)



@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("shape", [(16, 8), (144, 72), (1008, 520), (272, 4104), (133, 77)],
                         ids=str)
def test_cast_transpose_dbias_matches_reference(rng, dtype, shape):
    """The same codes as cast_transpose, and dbias (float32 sums of 128-row partials) within
    float32 summation error of the float64 column sums, in the bias dtype."""
    import cupy
    x = (rng.standard_normal(shape) + 0.5).astype(dtype)
    scale = cupy.asarray([rng.uniform(0.1, 8)], np.float32)
    poison_gpu_pool()
    args = (cupy.asarray(x), scale, E5M2, np.dtype(dtype))
    assert tecupy.backends.chosen("cast_transpose_dbias", *args) == "cuda"
    q, qt, amax, db = tecupy.backends.dispatch("cast_transpose_dbias", *args)
    assert_cast_transpose_of(x, scale, q, qt, amax)
    want = x.astype(np.float64).sum(0)
    assert db.dtype == np.dtype(dtype) and db.shape == (shape[1],)
    tol = float(np.finfo(np.float32).eps) * shape[0] * np.abs(x.astype(np.float64)).sum(0)
    tol += np.abs(want) * float(ml_dtypes.finfo(dtype).eps)  # the cast to the bias dtype
    assert (np.abs(cupy.asnumpy(db).astype(np.float64) - want) <= tol).all()


def _with_nans(rng, shape, dtype):
    """Random values with +NaN and -NaN (several payloads) spread over every position mod
    32, so each vector width and each lane of the kernels sees some."""
    x = rng.standard_normal(shape).astype(np.float32).reshape(-1)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7FFFFFFF, 0xFFFFFFFF], np.uint32).view(np.float32)
    idx = rng.choice(x.size, size=max(1, x.size // 7), replace=False)
    x[idx] = nans[np.arange(idx.size) % 4]
    return x.astype(dtype).reshape(shape), idx


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16, np.float64])
@pytest.mark.parametrize("shape", [(1,), (7,), (64,), (37, 48), (4096,)], ids=str)
def test_cast_nan_is_canonical_0x7f(rng, fmt, dtype, shape):
    """Transformer Engine's cast converts with CUDA's __nv_cvt_float_to_fp8 (cuda_fp8.hpp):
    a NaN of either sign becomes 0x7F in E4M3 and in E5M2 (the software path makes the
    input 0x7FFFFFFF first; cvt.rn.satfinite on sm_89+ gives the same). Every vector width
    of cast_to_fp8 (scalar, 16-byte, two 16-byte) and the reference must give exactly it."""
    import cupy
    x, idx = _with_nans(rng, shape, dtype)
    args = (cupy.asarray(x), cupy.asarray([1.5], np.float32), fmt)
    assert tecupy.backends.chosen("cast_to_fp8", *args) == "cuda"
    q, _ = tecupy.backends.dispatch("cast_to_fp8", *args)
    q = cupy.asnumpy(q).reshape(-1)
    np.testing.assert_array_equal(q[idx], 0x7F)
    np.testing.assert_array_equal(q, ref.cast_to_fp8(x, np.array([1.5], np.float32),
                                                     fmt)[0].reshape(-1))


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("shape", [(16, 8), (144, 72), (131, 64), (16, 7)], ids=str)
def test_cast_transpose_nan_is_canonical_0x7f(rng, fmt, dtype, shape):
    """The same rule for the tiled cast+transpose (both copies), aligned and ragged."""
    import cupy
    x, idx = _with_nans(rng, shape, dtype)
    args = (cupy.asarray(x), cupy.asarray([1.0], np.float32), fmt)
    assert tecupy.backends.chosen("cast_transpose", *args) == "cuda"
    q, qt, _ = tecupy.backends.dispatch("cast_transpose", *args)
    np.testing.assert_array_equal(cupy.asnumpy(q).reshape(-1)[idx], 0x7F)
    np.testing.assert_array_equal(cupy.asnumpy(qt), cupy.asnumpy(q).T)


# scales whose inverse is normal, subnormal (above 2^126: CuPy's -ftz=true division gives
# 0 there, Transformer Engine's kernels keep it), and at the top of float32
SCALES = [0.37, 7.5, 2.0 ** 127 * 1.5, 3e38]


@pytest.mark.parametrize("op, dtype, shape", [
    ("cast_to_fp8", np.float32, (1023,)),          # scalar path
    ("cast_to_fp8", tecupy.bfloat16, (5, 24)),     # one 16-byte vector per step
    ("cast_to_fp8", tecupy.bfloat16, (37, 48)),    # two
    ("cast_to_fp8", np.float64, (0,)),             # no cast launch: scale_inverse
    ("cast_transpose", np.float16, (144, 72)),
    ("cast_transpose", tecupy.bfloat16, (131, 7)),  # ragged
    ("cast_transpose", np.float32, (0, 16)),
    ("cast_transpose_dbias", tecupy.bfloat16, (272, 136)),
    ("cast_transpose_dbias", np.float32, (0, 8))], ids=str)
def test_cast_writes_scale_inv(rng, op, dtype, shape):
    """The casts write scale_inv_out = 1 / scale (IEEE float32, subnormals kept) into a
    poisoned output, bit for bit the reference's; the codes are unchanged by it."""
    import cupy
    x = rng.standard_normal(shape).astype(dtype)
    extra = (np.dtype(dtype),) if op.endswith("dbias") else ()
    for s in SCALES:
        scale = np.array([s], np.float32)
        poison_gpu_pool()
        inv = cupy.full(1, np.nan, np.float32)
        args = (cupy.asarray(x), cupy.asarray(scale), E4M3) + extra
        assert tecupy.backends.chosen(op, *args, scale_inv_out=inv) == "cuda"
        got = tecupy.backends.dispatch(op, *args, scale_inv_out=inv)
        inv_ref = np.full(1, np.nan, np.float32)
        want = getattr(ref, op)(x, scale, E4M3, *extra, scale_inv_out=inv_ref)
        assert inv.get().tobytes() == inv_ref.tobytes() == (np.float32(1) / scale).tobytes()
        if s == 2.0 ** 127 * 1.5:
            assert 0 < inv_ref[0] < np.finfo(np.float32).tiny  # subnormal, kept
        assert_same_codes(cupy.asnumpy(got[0]), want[0], E4M3)


def test_quantize_scale_inv_keeps_subnormals_on_gpu(rng):
    """tecupy.quantize's FP8Tensor.scale_inv comes from the cast kernel: no Python 1 / scale
    (which CuPy's -ftz=true division flushes to 0 above 2^126)."""
    import cupy
    host = rng.standard_normal((64, 32))
    x, x16 = cupy.asarray(host.astype(np.float32)), cupy.asarray(host.astype(tecupy.bfloat16))
    for s in SCALES:
        scale = cupy.asarray([s], np.float32)
        for kw in ({}, {"transpose": True}, {"transpose": True, "dbias_dtype": np.float32}):
            t = tecupy.quantize(x16 if kw else x, scale, "e4m3", **kw)
            t = t[0] if "dbias_dtype" in kw else t
            want = (np.float32(1) / np.array([s], np.float32)).tobytes()
            assert t.scale_inv.get().tobytes() == want, (s, kw)


@pytest.mark.parametrize("name", [n for n, a in TABLE.items() if not a.gated])
@pytest.mark.parametrize("dtype", [np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("shape,bias", [((16, 8), True), ((272, 136), False),
                                        ((1008, 520), True)], ids=str)
def test_dact_cast_transpose_matches_act_bwd_then_cast(rng, name, dtype, shape, bias):
    """The activation's backward cast in the same pass: the codes of the CUDA act_bwd's dx
    (the same maths, rounded to the dtype) cast by the reference, bit for bit, its amax,
    scale_inv, and dbias within float32 summation error of dx's float64 column sums."""
    import cupy
    dy = rng.standard_normal(shape).astype(dtype)
    h = (rng.standard_normal(shape) * 3).astype(dtype)
    b = rng.standard_normal(shape[1]).astype(dtype) if bias else None
    g = [None if a is None else cupy.asarray(a) for a in (dy, h, b)]
    scale = cupy.asarray([rng.uniform(0.1, 8)], np.float32)
    dx, _ = tecupy.backends.dispatch(f"{name}_bwd", *g)
    dx = cupy.asnumpy(dx)
    poison_gpu_pool()
    inv = cupy.full((1,), np.nan, np.float32)
    args = (*g, name, scale, E5M2, np.dtype(dtype), None, inv)
    assert tecupy.backends.chosen("dact_cast_transpose", *args) == "cuda"
    q, qt, amax, db = tecupy.backends.dispatch("dact_cast_transpose", *args)
    assert_cast_transpose_of(dx, scale, q, qt, amax)
    assert float(inv[0]) == np.float32(1) / cupy.asnumpy(scale)[0]
    want = dx.astype(np.float64).sum(0)
    tol = float(np.finfo(np.float32).eps) * shape[0] * np.abs(dx.astype(np.float64)).sum(0)
    tol += np.abs(want) * float(ml_dtypes.finfo(dtype).eps)
    assert db.dtype == np.dtype(dtype)
    assert (np.abs(cupy.asnumpy(db).astype(np.float64) - want) <= tol).all()


@pytest.mark.parametrize("name", [n for n, a in TABLE.items() if not a.gated])
@pytest.mark.parametrize("dtype", [np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("shape,bias", [((16, 8), True), ((272, 136), False),
                                        ((1008, 520), True)], ids=str)
def test_act_cast_transpose_matches_act_fwd(rng, name, dtype, fmt, shape, bias):
    """The activation's forward cast with its transpose in one pass (fc2's input): bit for
    bit the CUDA act_fwd's FP8 output (the same float maths, not rounded to the dtype), its
    transpose, the same amax (maxed into a nonzero one) and scale_inv; outputs poisoned.
    (act_fwd's own FP8 output against the float64 reference: test_kernels_act.py.)"""
    import cupy
    h = cupy.asarray((rng.standard_normal(shape) * 3).astype(dtype))
    b = cupy.asarray(rng.standard_normal(shape[1]).astype(dtype)) if bias else None
    scale = cupy.asarray([rng.uniform(0.1, 8)], np.float32)
    amax0 = cupy.asarray([0.25], np.float32)
    want_amax = amax0.copy()
    q_ref, _ = tecupy.backends.dispatch(f"{name}_fwd", h, b, scale, fmt, amax_out=want_amax)
    poison_gpu_pool()
    inv, amax = cupy.full((1,), np.nan, np.float32), amax0.copy()
    args = (h, b, name, scale, fmt, amax)
    assert tecupy.backends.chosen("act_cast_transpose", *args) == "cuda"
    q, qt, got_amax = tecupy.backends.dispatch("act_cast_transpose", *args, scale_inv_out=inv)
    assert got_amax is amax
    np.testing.assert_array_equal(cupy.asnumpy(q), cupy.asnumpy(q_ref))
    np.testing.assert_array_equal(cupy.asnumpy(qt), cupy.asnumpy(q_ref).T)
    np.testing.assert_array_equal(cupy.asnumpy(amax), cupy.asnumpy(want_amax))
    assert float(inv[0]) == np.float32(1) / cupy.asnumpy(scale)[0]


@pytest.mark.parametrize("dtype", [np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_dact_cast_transpose_into_column_chunks(rng, dtype, bias):
    """h read and q written as column chunks of wider arrays (rows ld apart), qt as a row
    chunk: each chunk's codes, transposed codes and dbias equal the whole array's, bit for
    bit, and nothing outside the chunk is written (the pool poisoned, the rest 0xAA)."""
    import cupy
    rows, cols = 272, 200  # chunks of 64, 64, 72 columns: 8-column multiples, odd tile ends
    dy = cupy.asarray(rng.standard_normal((rows, cols)).astype(dtype))
    h = cupy.asarray((rng.standard_normal((rows, cols)) * 3).astype(dtype))
    b = cupy.asarray(rng.standard_normal(cols).astype(dtype)) if bias else None
    scale = cupy.asarray([rng.uniform(0.1, 8)], np.float32)
    inv = cupy.empty((1,), np.float32)
    q, qt, _, db = tecupy.backends.dispatch("dact_cast_transpose", dy, h, b, "gelu", scale,
                                            E5M2, np.dtype(dtype), None, inv)
    poison_gpu_pool()
    q2, qt2 = cupy.full((rows, cols), 0xAA, np.uint8), cupy.full((cols, rows), 0xAA, np.uint8)
    for c0, c1 in ((0, 64), (64, 128), (128, 200)):
        args = (cupy.ascontiguousarray(dy[:, c0:c1]), h[:, c0:c1],
                None if b is None else b[c0:c1], "gelu", scale, E5M2, np.dtype(dtype), None,
                inv)
        out = (q2[:, c0:c1], qt2[c0:c1])
        assert tecupy.backends.chosen("dact_cast_transpose", *args, out=out) == "cuda"
        got = tecupy.backends.dispatch("dact_cast_transpose", *args, out=out)
        assert got[0] is out[0] and got[1] is out[1]
        assert cupy.asnumpy(got[3]).tobytes() == cupy.asnumpy(db[c0:c1]).tobytes()
        seen = cupy.asnumpy(q2[:, c1:])
        assert (seen == 0xAA).all(), "written past the chunk"
    assert cupy.asnumpy(q2).tobytes() == cupy.asnumpy(q).tobytes()
    assert cupy.asnumpy(qt2).tobytes() == cupy.asnumpy(qt).tobytes()

"""The Hopper FP8 GEMM (cutlass_templates/fp8_gemm.cu) against the float64 product of the
dequantized inputs, for every format pair, output dtype, bias, accumulation mode and
wgrad-style accumulation, with M, N and K tails that are not multiples of the tiles."""
import numpy as np
import pytest

import tecupy
from tecupy import backends
from tecupy.fp8 import E4M3, E5M2
from tecupy.reference.fp8 import _decode_table
from conftest import HAVE_GPU, asnp, assert_split_gemm_close, gemm_absdot, poison_gpu_pool

pytestmark = pytest.mark.gpu


def _hopper():
    from tecupy.kernels.fp8_gemm import hopper
    return HAVE_GPU and hopper()


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the FP8 GEMM kernel needs sm_90")
PAIRS = [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)]
OUTS = [np.float32, np.float16, tecupy.bfloat16]


def _codes(rng, shape, fmt):
    """Random FP8 codes of normal-ish data (no NaN codes), via the reference cast."""
    x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.5, 4)
    return tecupy.quantize(x, 1.0, fmt).data


def _operands(rng, m, n, k, fa, fb):
    a, b = _codes(rng, (m, k), fa), _codes(rng, (n, k), fb)
    sa = np.array([rng.uniform(0.5, 2)], np.float32)
    sb = np.array([rng.uniform(0.01, 0.1)], np.float32)
    return a, sa, b, sb


def _dequant64(q, fmt, s):
    """decode(q) * the tensor's scale_inv, in float64 (exact)."""
    return _decode_table(np, fmt)[q].astype(np.float64) * float(s[0])


def _want64(a, fa, sa, b, fb, sb, bias):
    """(A B^T (+ bias), |A| |B|^T) of the dequantized operands, in float64."""
    want, absdot = gemm_absdot(_dequant64(a, fa, sa), _dequant64(b, fb, sb))
    return (want if bias is None else want + bias.astype(np.float64)), absdot


def _gpu(*arrays):
    import cupy
    return [cupy.asarray(x) if isinstance(x, np.ndarray) else x for x in arrays]


def _check(got, want, ref_lp, name, absdot=None):
    """Split accumulation (absdot = |A| |B|^T given): conftest's elementwise bound, 2 err_ref
    + 2^-11 |A| |B|^T + half an ulp (assert_split_gemm_close; the max-based bound used here
    before reached 0.97 of itself at (1000, 528, 256), PERFLOG session 24). Fast accumulation
    (absdot None): wgmma sums all of K in place, never promoted to float32, so the 2^-11
    (four roundings per k-block of 128) does not hold; flash-attention's 2x rule against the
    float32-accumulating reference plus 1e-2 of the output's magnitude (measured 3.5e-3 on
    an H200 at K = 4112; at most 0.47 of this bound over 60 draws of each case on an H100)."""
    if absdot is not None:
        return assert_split_gemm_close(got, want, ref_lp, absdot, name)
    got, ref_lp = asnp(got).astype(np.float64), asnp(ref_lp).astype(np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{name}: non-finite values (unwritten output?)"
    err, err_ref = np.abs(got - want).max(), np.abs(ref_lp - want).max()
    extra = 1e-2 * np.abs(want).max()
    assert err <= 2 * err_ref + extra, f"{name}: error {err:.3e} vs reference {err_ref:.3e}"


@needs_hopper
@pytest.mark.parametrize("fa,fb", PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("out_dtype", OUTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("split", [False, True], ids=["fast", "split"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mnk", [(200, 272, 4112), (16, 32, 48), (1000, 528, 256)], ids=str)
def test_fp8_gemm(rng, fa, fb, out_dtype, split, bias, mnk):
    m, n, k = mnk
    a, sa, b, sb = _operands(rng, m, n, k, fa, fb)
    bvec = (rng.standard_normal(n) * 3).astype(out_dtype) if bias else None
    args = [a, fa, sa, b, fb, sb, out_dtype, bvec]
    gargs = _gpu(*args)
    assert backends.chosen("fp8_gemm", *gargs, split_accumulator=split) == "cutlass"
    poison_gpu_pool()
    got = backends.candidates("fp8_gemm", *gargs)[0].fn(*gargs, split_accumulator=split)
    assert got.dtype == np.dtype(out_dtype) and got.shape == (m, n)
    ref_lp = backends.dispatch("fp8_gemm", *args)  # NumPy reference, float32 accumulation
    want, absdot = _want64(a, fa, sa, b, fb, sb, bvec)
    _check(got, want, ref_lp, f"{mnk}", absdot if split else None)


@needs_hopper
@pytest.mark.parametrize("split", [False, True], ids=["fast", "split"])
def test_fp8_gemm_accumulates_into_float32(rng, split):
    import cupy
    m, n, k = 300, 144, 1040
    a, sa, b, sb = _operands(rng, m, n, k, E5M2, E4M3)
    start = rng.standard_normal((m, n)).astype(np.float32)
    out = cupy.asarray(start)
    impl = backends.candidates("fp8_gemm", *_gpu(a, E5M2, sa, b, E4M3, sb, np.float32))[0]
    assert impl.kind == "cutlass"
    got = impl.fn(*_gpu(a, E5M2, sa, b, E4M3, sb), np.float32, None, out=out,
                  accumulate=True, split_accumulator=split)
    assert got is out
    want, absdot = _want64(a, E5M2, sa, b, E4M3, sb, None)
    ref = backends.dispatch("fp8_gemm", a, E5M2, sa, b, E4M3, sb, np.float32, None,
                            out=start.copy(), accumulate=True)
    _check(out, want + start, ref, "accumulate", absdot if split else None)


@needs_hopper
@pytest.mark.parametrize("fa,fb", PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("out_fmt", [E4M3, E5M2], ids=lambda f: f.name)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("headroom", [2.0, 0.25], ids=["fits", "saturates"])
def test_fp8_gemm_fp8_output_and_amax(rng, fa, fb, out_fmt, bias, headroom):
    """FP8 output: codes of y * out_scale (saturating), amax of y gathered into amax_out."""
    import cupy
    m, n, k = 200, 272, 4112
    a, sa, b, sb = _operands(rng, m, n, k, fa, fb)
    bvec = (rng.standard_normal(n) * 3).astype(np.float32) if bias else None
    want = _want64(a, fa, sa, b, fb, sb, bvec)[0]
    top = np.abs(want).max()
    scale = np.array([out_fmt.max / top / headroom], np.float32)
    amax = cupy.full(1, 1e-3, np.float32)
    gargs = _gpu(a, fa, sa, b, fb, sb)
    impl = backends.candidates("fp8_gemm", *gargs, out_fmt, None)[0]
    assert impl.kind == "cutlass"
    poison_gpu_pool()
    codes = impl.fn(*gargs, out_fmt, *_gpu(bvec), out_scale=cupy.asarray(scale), amax_out=amax)
    assert codes.dtype == np.uint8 and codes.shape == (m, n)
    decode = _decode_table(np, out_fmt)
    scaled = decode[asnp(codes)].astype(np.float64)
    got = scaled / scale[0]
    assert np.all(np.isfinite(got)), "NaN/inf codes: unwritten output or no saturation"
    assert abs(float(amax[0]) - top) <= 1e-2 * top  # fast-accumulation tolerance
    if headroom > 1:
        ref_codes = backends.dispatch("fp8_gemm", a, fa, sa, b, fb, sb, out_fmt, bvec,
                                      out_scale=scale, amax_out=np.zeros(1, np.float32))
        # fast accumulation (the default), so the max-based criterion (and an FP8 output's
        # rounding is a step of the format, not an epsilon the elementwise bound knows)
        _check(got, want, decode[ref_codes].astype(np.float64) / scale[0], "fp8 out")
    else:  # values past the format's range saturate to +-max, never inf or NaN
        over = np.abs(want) * scale[0] > 1.05 * out_fmt.max
        assert over.any()
        np.testing.assert_array_equal(np.abs(scaled[over]), out_fmt.max)


@needs_hopper
@pytest.mark.parametrize("fa,fb", PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("out_dtype", [np.float32, tecupy.bfloat16], ids=lambda d: np.dtype(d).name)
def test_fp8_gemm_bias_gelu_epilogue(rng, fa, fb, out_dtype):
    """gelu(y + bias) and, for the backward, y + bias itself."""
    m, n, k = 200, 272, 1040
    a, sa, b, sb = _operands(rng, m, n, k, fa, fb)
    bvec = (rng.standard_normal(n) * 3).astype(out_dtype)
    args = [a, fa, sa, b, fb, sb, out_dtype, bvec]
    impl = backends.candidates("fp8_gemm", *_gpu(*args), gelu=True)[0]
    assert impl.kind == "cutlass"
    poison_gpu_pool()
    y, pre = impl.fn(*_gpu(*args), gelu=True)
    y_ref, pre_ref = backends.dispatch("fp8_gemm", *args, gelu=True)
    want = _want64(a, fa, sa, b, fb, sb, bvec)[0]
    _check(pre, want, pre_ref, "pre-gelu")  # fast accumulation (the default)
    want_y = 0.5 * want * (1 + np.tanh(np.sqrt(2 / np.pi) * (want + 0.044715 * want ** 3)))
    _check(y, want_y, y_ref, "gelu")


@needs_hopper
@pytest.mark.parametrize("fa,fb", [(E5M2, E4M3), (E4M3, E4M3)], ids=lambda f: f.name)
@pytest.mark.parametrize("out_dtype", [np.float16, tecupy.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_fp8_gemm_dgelu_epilogue(rng, fa, fb, out_dtype, with_bias):
    """gelu's backward as the dgrad epilogue: T(y) * gelu'(aux + bias), aux read (the
    forward's pre-gelu values), with M, N, K tails; against the float64 maths (2x rule)."""
    m, n, k = 200, 272, 1040
    a, sa, b, sb = _operands(rng, m, n, k, fa, fb)
    aux = (rng.standard_normal((m, n)) * 2).astype(out_dtype)
    bvec = (rng.standard_normal(n)).astype(out_dtype) if with_bias else None
    args = [a, fa, sa, b, fb, sb, out_dtype, bvec]
    kw = dict(split_accumulator=True)
    impl = backends.candidates("fp8_gemm", *_gpu(*args), dgelu_aux=_gpu(aux)[0], **kw)[0]
    assert impl.kind == "cutlass"
    poison_gpu_pool()
    got = impl.fn(*_gpu(*args), dgelu_aux=_gpu(aux)[0], **kw)
    ref = backends.dispatch("fp8_gemm", *args, dgelu_aux=aux, **kw)
    h = aux.astype(np.float64) + (0 if bvec is None else bvec.astype(np.float64))
    u = np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)
    du = np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * h ** 2)
    t = np.tanh(u)
    dg = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * du  # gelu'(h), float64
    prod, absdot = _want64(a, fa, sa, b, fb, sb, None)
    # D = T(T(acc) * gelu'(h)): the split accumulator's error and the first rounding scale
    # with |gelu'(h)| (absdot times it), then a second rounding to T (roundings=2), and the
    # kernel's float32 gelu' (the fast sigmoid) is off by a few 1e-7 absolute, times |acc|
    # <= |A| |B|^T: 2^-16 of that covers it and the first rounding's own rounding
    assert_split_gemm_close(got, prod * dg, ref, absdot * np.abs(dg), "dgelu", roundings=2,
                            atol=2.0 ** -16 * absdot)
    in_place = _gpu(aux)[0]  # over the aux values themselves: the same result
    assert impl.fn(*_gpu(*args), dgelu_aux=in_place, out=in_place, **kw) is in_place
    np.testing.assert_array_equal(asnp(in_place).view(np.uint16), asnp(got).view(np.uint16))


@needs_hopper
def test_fp8_gemm_reads_scales_from_device_memory(rng):
    """Changing the scale arrays on the device changes the next result (no cached value)."""
    import cupy
    a, sa, b, sb = _operands(rng, 64, 64, 64, E4M3, E4M3)
    ga, gsa, gb, gsb = _gpu(a, sa, b, sb)
    impl = backends.candidates("fp8_gemm", ga, E4M3, gsa, gb, E4M3, gsb, np.float32)[0]
    y1 = impl.fn(ga, E4M3, gsa, gb, E4M3, gsb, np.float32)
    gsa *= 2
    y2 = impl.fn(ga, E4M3, gsa, gb, E4M3, gsb, np.float32)
    np.testing.assert_allclose(asnp(y2), 2 * asnp(y1), rtol=1e-6)
    assert float(cupy.abs(y1).max()) > 0


@needs_hopper
def test_fp8_gemm_declines_what_it_cannot_take(rng):
    a, sa, b, sb = _gpu(*_operands(rng, 32, 32, 48, E5M2, E5M2))
    assert backends.chosen("fp8_gemm", a, E5M2, sa, b, E5M2, sb, np.float32) == "reference"
    a2, sa, b2, sb = _gpu(*_operands(rng, 32, 32, 40, E4M3, E4M3))  # K % 16 != 0
    assert backends.chosen("fp8_gemm", a2, E4M3, sa, b2, E4M3, sb, np.float32) == "reference"


@needs_hopper
def test_linear_fp8_runs_on_the_kernel(rng):
    """The FP8 linear, forward and backward, through the kernel, close to high precision."""
    import cupy
    x = cupy.asarray(rng.standard_normal((96, 160)).astype(np.float32)).astype(tecupy.bfloat16)
    w = cupy.asarray((rng.standard_normal((48, 160)) / 12).astype(np.float32)).astype(
        tecupy.bfloat16)
    with tecupy.Tape() as tape, tecupy.fp8_autocast():
        y = tecupy.linear(x, w)
    dx, dw = tape.gradient(y, [x, w], cupy.ones_like(y))
    y_hp = (x.astype(np.float32) @ w.astype(np.float32).T)
    rel = float(cupy.abs(y.astype(np.float32) - y_hp).max() / cupy.abs(y_hp).max())
    assert rel < 0.1 and dx.shape == x.shape and dw.shape == w.shape


@needs_hopper
def test_tune_remembers_the_winner(rng, tmp_path, monkeypatch):
    import json
    from tecupy.kernels import fp8_gemm as K
    monkeypatch.setattr(K, "_tune_file", lambda: tmp_path / "fp8_gemm_tuned.json")
    times = tecupy.gemm.tune(256, 512, 384, "e5m2", "e4m3", split_accumulator=True, calls=2)
    assert set(times) == set(tecupy.gemm.CANDIDATES[True]) and min(times.values()) > 0
    table = json.loads((tmp_path / "fp8_gemm_tuned.json").read_text())
    assert table["256,512,384,e5m2,e4m3,split"] == list(min(times, key=times.get))
    a, sa, b, sb = _operands(rng, 256, 512, 384, E5M2, E4M3)  # the tuned config gives
    got = backends.candidates("fp8_gemm", *_gpu(a, E5M2, sa, b, E4M3, sb, np.float32))[0].fn(
        *_gpu(a, E5M2, sa, b, E4M3, sb), np.float32, split_accumulator=True)  # right results
    want, absdot = _want64(a, E5M2, sa, b, E4M3, sb, None)
    _check(got, want, backends.dispatch("fp8_gemm", a, E5M2, sa, b, E4M3, sb, np.float32),
           "tuned", absdot)



def _bias_view(cupy, bias, how):
    """bias [n] on the GPU as the caller may hold it: a fresh array, a view 2 bytes past an
    allocation's start (the epilogue loads it one element at a time), or a strided view."""
    if how == "offset":
        full = cupy.empty(bias.size + 1, bias.dtype)
        full[1:] = cupy.asarray(bias)
        return full[1:]
    if how == "strided":
        full = cupy.zeros(2 * bias.size, bias.dtype)
        full[::2] = cupy.asarray(bias)
        return full[::2]
    return cupy.asarray(bias)


@needs_hopper
@pytest.mark.parametrize("out_dtype", [np.float16, tecupy.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("split", [False, True], ids=["fast", "split"])
@pytest.mark.parametrize("how", ["fresh", "offset", "strided"])
@pytest.mark.parametrize("mnk", [(37, 264, 4112), (1000, 24, 48), (129, 200, 272)], ids=str)
def test_fp8_gemm_16bit_bias_in_its_own_dtype(rng, out_dtype, split, how, mnk):
    """The epilogue reads a bf16 / half bias as it is (issue 21: no float32 copy per call):
    against the float64 product plus the bias (2x rule), M, N and K tails, a poisoned pool."""
    import cupy
    m, n, k = mnk
    a, sa, b, sb = _operands(rng, m, n, k, E4M3, E4M3)
    bias = (rng.standard_normal(n) * 3).astype(out_dtype)
    ga, gsa, gb, gsb = _gpu(a, sa, b, sb)
    impl = backends.candidates("fp8_gemm", ga, E4M3, gsa, gb, E4M3, gsb, out_dtype,
                               cupy.asarray(bias), split_accumulator=split)[0]
    assert impl.kind == "cutlass"
    gbias = _bias_view(cupy, bias, how)
    poison_gpu_pool()
    got = impl.fn(ga, E4M3, gsa, gb, E4M3, gsb, out_dtype, gbias, split_accumulator=split)
    assert got.dtype == np.dtype(out_dtype) and got.shape == (m, n)
    ref = backends.dispatch("fp8_gemm", a, E4M3, sa, b, E4M3, sb, out_dtype, bias)
    want, absdot = _want64(a, E4M3, sa, b, E4M3, sb, bias)
    _check(got, want, ref, f"{mnk} {how}", absdot if split else None)


@needs_hopper
@pytest.mark.parametrize("out_dtype", [np.float16, tecupy.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("split", [False, True], ids=["fast", "split"])
def test_fp8_gemm_16bit_bias_sums_are_those_of_a_float32_bias(rng, out_dtype, split):
    """Bit for bit: D in bf16 / half with the bias in that dtype is the float32 D of the
    same GEMM with that bias in float32 (what the epilogue used to read), rounded once."""
    import cupy
    m, n, k = 200, 272, 4112
    a, sa, b, sb = _gpu(*_operands(rng, m, n, k, E5M2, E4M3))
    bias = cupy.asarray((rng.standard_normal(n) * 3).astype(out_dtype))
    kw = dict(split_accumulator=split)
    impl = backends.candidates("fp8_gemm", a, E5M2, sa, b, E4M3, sb, out_dtype, bias, **kw)[0]
    assert impl.kind == "cutlass"
    poison_gpu_pool()
    got = impl.fn(a, E5M2, sa, b, E4M3, sb, out_dtype, bias, **kw)
    d32 = impl.fn(a, E5M2, sa, b, E4M3, sb, np.float32, bias.astype(np.float32), **kw)
    want = asnp(d32).astype(out_dtype)
    np.testing.assert_array_equal(asnp(got).view(np.uint16), want.view(np.uint16))
    assert np.abs(want.astype(np.float32)).max() > 0


# ---- the residual add in the epilogue (EPI 4, 5; issue 21) -------------------------------

def _residual_case(rng, m, n, k, out_dtype, bias):
    a, sa, b, sb = _operands(rng, m, n, k, E4M3, E4M3)
    bvec = (rng.standard_normal(n) * 3).astype(out_dtype) if bias else None
    r = (rng.standard_normal((m, n)) * 8).astype(out_dtype)
    return _gpu(a, E4M3, sa, b, E4M3, sb, out_dtype, bvec), _gpu(r)[0]


def _gemm_then_add(gargs, r):
    """The unfused path: the GEMM's 16-bit output, then the add kernel."""
    from tecupy.kernels.dropout import add_fwd
    return add_fwd(backends.candidates("fp8_gemm", *gargs)[0].fn(*gargs), r)


@needs_hopper
@pytest.mark.parametrize("out_dtype", [np.float16, tecupy.bfloat16], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("mnk", [(200, 272, 4112), (37, 264, 48), (1000, 24, 256),
                                 (129, 520, 272)], ids=str)
@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "noprefetch"])
def test_fp8_gemm_residual_epilogue_is_gemm_then_add(rng, monkeypatch, out_dtype, bias, mnk,
                                                     prefetch):
    """T(T(acc (+ bias)) + residual) in the epilogue: the bits of the GEMM then the add
    kernel, with M, N, K tails, into poisoned memory; the residual is left as it was. With
    and without the L2 prefetch of the residual (EPI 4, 5 and 6, 7)."""
    from tecupy.kernels import fp8_gemm as K
    monkeypatch.setattr(K, "RESIDUAL_PREFETCH", prefetch)
    gargs, r = _residual_case(rng, *mnk, out_dtype, bias)
    impl = backends.candidates("fp8_gemm", *gargs, residual=r)[0]
    assert impl.kind == "cutlass"
    r_before = r.copy()
    poison_gpu_pool()
    got = impl.fn(*gargs, residual=r)
    want = _gemm_then_add(gargs, r)
    assert got.dtype == np.dtype(out_dtype) and got.shape == mnk[:2]
    np.testing.assert_array_equal(asnp(got).view(np.uint16), asnp(want).view(np.uint16))
    np.testing.assert_array_equal(asnp(r).view(np.uint16), asnp(r_before).view(np.uint16))
    ref = backends.dispatch("fp8_gemm", *[asnp(x) if hasattr(x, "get") else x for x in gargs],
                            residual=asnp(r))  # the reference: the same two roundings, close
    want = _want64(*[asnp(x) if hasattr(x, "get") else x for x in gargs[:6]],
                   None if gargs[7] is None else asnp(gargs[7]))[0]
    # fast accumulation: the kernel takes a residual only without the split accumulator
    _check(got, want + asnp(r).astype(np.float64), ref, "residual")


@needs_hopper
@pytest.mark.parametrize("config", [(256, 3, False, 1), (256, 3, False, 2),
                                    (128, 6, False, 2)], ids=str)
def test_fp8_gemm_residual_epilogue_tuned_configs(rng, tmp_path, monkeypatch, config):
    """Every fast-accumulation candidate tile (what tecupy.gemm.tune may pick for a forward
    GEMM) gives the bits of the GEMM then the add."""
    from tecupy.kernels import fp8_gemm as K
    monkeypatch.setattr(K, "_tune_file", lambda: tmp_path / "fp8_gemm_tuned.json")
    monkeypatch.setattr(K, "_tuned_cache", {})
    m, n, k = 300, 1024, 512
    K.remember(m, n, k, "e4m3", "e4m3", False, config)
    gargs, r = _residual_case(rng, m, n, k, tecupy.bfloat16, True)
    poison_gpu_pool()
    got = K.fp8_gemm(*gargs, residual=r)
    want = _gemm_then_add(gargs, r)
    np.testing.assert_array_equal(asnp(got).view(np.uint16), asnp(want).view(np.uint16))


@needs_hopper
def test_fp8_gemm_residual_declines_what_it_cannot_take(rng):
    """A residual of another dtype, shape or layout, with gelu, split accumulation, an FP8
    or float32 output: the kernel declines (the reference runs)."""
    import cupy
    gargs, r = _residual_case(rng, 64, 64, 64, tecupy.bfloat16, False)
    assert backends.chosen("fp8_gemm", *gargs, residual=r) == "cutlass"
    for bad in (r.astype(np.float16), r[:, :32], cupy.asfortranarray(r),
                cupy.empty(64 * 64 + 1, r.dtype)[1:].reshape(64, 64)):
        assert backends.chosen("fp8_gemm", *gargs, residual=bad) == "reference"
    for kw in (dict(gelu=True), dict(split_accumulator=True)):
        assert backends.chosen("fp8_gemm", *gargs, residual=r, **kw) == "reference"
    g32 = gargs[:6] + [np.float32, None]
    assert backends.chosen("fp8_gemm", *g32, residual=r.astype(np.float32)) == "reference"


@needs_hopper
@pytest.mark.parametrize("split", [False, True], ids=["fast", "split"])
def test_fp8_gemm_under_sm_margin_is_bit_exact_on_fewer_sms(rng, split):
    """launch.sm_margin(n): the persistent GEMM's grid leaves n SMs free (a plan of its
    own: the key holds the margin), and its output is bit for bit the full grid's (a tile's
    sums do not depend on which CTA computes it)."""
    from tecupy.kernels import fp8_gemm as G
    from tecupy.kernels.launch import sm_count, sm_margin
    m, n, k = 2048, 4096, 512  # 16 x 16+ tiles: more than any grid
    a, sa, b, sb = _gpu(*_operands(rng, m, n, k, E4M3, E4M3))

    def run():
        return G.fp8_gemm(a, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, split_accumulator=split)
    full = asnp(run())
    grids = {}
    for margin in (16, 40):
        with sm_margin(margin):
            got = asnp(run())
        assert np.array_equal(got.view(np.uint16), full.view(np.uint16)), margin
        grids[margin] = [p[1][0] for key, p in G._plans.items()
                         if key[:3] == (m, n, k) and key[-1] == margin and key[5] == split]
    assert grids[16] == [sm_count() - 16] and grids[40] == [sm_count() - 40], grids

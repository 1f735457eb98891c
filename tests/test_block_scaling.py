"""Float8BlockScaling (issue 20): the recipe, the block quantizer and FP8BlockTensor, the
NumPy reference against an element-by-element computation, the block kernels against the
reference (GPU), and Linear / LayerNormMLP / TransformerLayer under the recipe.

Transformer Engine's rules checked here: common/recipe/__init__.py (Float8BlockScaling's
fields and __post_init__ asserts), common/recipe/recipe_common.cuh
(compute_scale_from_amax: amax floored at epsilon; scale 1 for a zero, inf or NaN amax;
an infinite fp8_max / amax replaced by the input type's largest finite value; power-of-two
scales by clearing the mantissa) and common/transpose/quantize_transpose_vector_blockwise.cu
(amax by fmaxf, NaN ignored; the column-wise copy quantized from x in its own 128-row
blocks; scale_inv = 1 / scale). NaN and inf values cast as tecupy's per-tensor cast does.
"""
import ast
import importlib
import inspect
import pathlib

import ml_dtypes
import numpy as np
import pytest

import tecupy
from tecupy import backends
from tecupy.fp8 import E4M3, E5M2, FP8BlockTensor
from tecupy.fp8_state import FP8State
from tecupy.quantization import BlockQuantizer, gemm_quantizers
from tecupy.recipe import Float8BlockScaling, Format, QParams
from conftest import asnp

E4M3_TOL = dict(rtol=0.125, atol=0.0675)  # TE's tests/pytorch/utils.py
DTYPES = [np.float32, np.float16, tecupy.bfloat16]


# ---- an independent element-by-element computation --------------------------------------
def _inf_value(dtype):
    if np.dtype(dtype) == np.float64:
        return float(np.finfo(np.float32).max)
    return float(ml_dtypes.finfo(dtype).max)


def _scale(amax, fmt, p2, eps, inf_value):
    """TE's compute_scale_from_amax, written out with Python floats and frexp."""
    a = max(amax, eps)
    if a == 0 or not np.isfinite(a):
        return np.float32(1)
    s = np.float32(np.float32(fmt.max) / np.float32(a))
    if np.isinf(s):
        s = np.float32(inf_value)
    if p2:
        _, e = np.frexp(s)  # s = m * 2**e, 0.5 <= m < 1
        s = np.float32(np.ldexp(np.float32(1), int(e) - 1))
    return s


def _code(v, fmt):
    """FP8 codes of float32 v: ml_dtypes (round to nearest even) after clipping to +-max
    (ml_dtypes would give NaN or inf past it); NaN -> 0x7F (CUDA's canonical NaN)."""
    v = np.asarray(v, np.float32)
    c = np.clip(v, -fmt.max, fmt.max).astype(fmt.ml_dtype).view(np.uint8)
    return np.where(np.isnan(v), np.uint8(0x7F), c)


def _naive_blocks(x, fmt, bh, bw, p2=True, eps=0.0):
    """codes and the scale of every (bh x bw) block of x [R, C] (scales [R/bh, C/bw])."""
    x32 = np.asarray(x, np.float32)
    inf_value = _inf_value(x.dtype)
    r, c = x32.shape
    nr, nc = -(-r // bh), -(-c // bw)
    codes, scales = np.zeros((r, c), np.uint8), np.zeros((nr, nc), np.float32)
    for i in range(nr):
        for j in range(nc):
            blk = x32[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw]
            finite = [abs(float(v)) for v in blk.ravel() if not np.isnan(v)]
            amax = max(finite, default=0.0)
            s = _scale(amax, fmt, p2, eps, inf_value)
            scales[i, j] = s
            with np.errstate(over="ignore", invalid="ignore"):
                codes[i * bh:(i + 1) * bh, j * bw:(j + 1) * bw] = _code(blk * s, fmt)
    return codes, scales


def naive_quantize(x, fmt, block_dim, p2=True, eps=0.0):
    """(codes, scale_inv, codes_t, scale_inv_t) in FP8BlockTensor's layouts."""
    if block_dim == 2:
        q, s = _naive_blocks(x, fmt, 128, 128, p2, eps)
        return q, 1 / s, q.T, (1 / s).T
    q, s = _naive_blocks(x, fmt, 1, 128, p2, eps)  # s [R, nb]
    qt, st = _naive_blocks(np.ascontiguousarray(x.T), fmt, 1, 128, p2, eps)
    return q, (1 / s).T, qt, (1 / st).T


def _random(rng, shape, dtype=np.float32, spread=4.0):
    """Values over many binades (each row and block its own range), never all zeros."""
    x = rng.standard_normal(shape) * np.exp(rng.uniform(-spread, spread, (shape[0], 1)))
    x *= np.exp(rng.uniform(-1, 1, shape))
    return x.astype(dtype)


def _specials(x):
    """Zero, NaN, inf, -inf, tiny and huge blocks in x [>= 256, >= 384] (in place)."""
    x[0, :128] = 0                 # a zero 1x128 block
    x[:128, 256:384] = 0           # a zero 128x128 tile (and zero columns)
    x[1, 5] = np.nan               # NaN: ignored by the amax, code 0x7F
    x[2, 130] = np.inf             # an inf block: scale 1, inf saturates to max
    x[3, 7] = -np.inf
    x[4, :128] = 1e-30 if x.dtype == np.float32 else 1e-7  # fp8_max / amax past the max
    x[5, 128:256] = x.dtype.type(3e4)  # amax beyond fp8_max: scale < 1
    return x


def _check_equal(got, want):
    for g, w, name in zip(got, want, ("codes", "scale_inv", "codes_t", "scale_inv_t")):
        if w is None:
            assert g is None, name
            continue
        np.testing.assert_array_equal(asnp(g), np.asarray(w), err_msg=name)


# ---- the reference against the element-by-element computation ----------------------------
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES + [np.float64], ids=lambda d: np.dtype(d).name)
def test_reference_block_quantize_matches_naive(rng, block_dim, dtype):
    x = _specials(_random(rng, (264, 400), dtype))
    got = backends.dispatch("block_quantize", x, E4M3, block_dim, True, 0.0, True)
    _check_equal(got, naive_quantize(x, E4M3, block_dim))
    assert got[0][1, 5] == 0x7F and got[0][2, 130] == 0x7E and got[0][3, 7] == 0xFE
    assert (got[0][0, :128] == 0).all()
    s = got[1] if block_dim == 2 else got[1].T  # every scale a power of two
    assert (np.frexp(s)[0] == 0.5).all()


@pytest.mark.parametrize("p2", [True, False])
@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_reference_scales_pow2_epsilon_and_format(rng, p2, fmt):
    x = _random(rng, (136, 264), np.float32)
    for eps in (0.0, 0.5):
        for block_dim in (1, 2):
            got = backends.dispatch("block_quantize", x, fmt, block_dim, p2, eps, True)
            _check_equal(got, naive_quantize(x, fmt, block_dim, p2, eps))


def test_reference_scale_by_hand():
    """A block of ones: scale 448 (E4M3), rounded down to 256; codes of 256 (0x78). With
    float32 scales: 1 * 448 is E4M3's max, 0x7E. A block whose amax is 3e4: 448 / 3e4 =
    0.01493 -> 2**-7. amax_epsilon 4: a block of ones gets 448 / 4 = 112 -> 64."""
    x = np.ones((2, 128), np.float32)
    x[1] = 0.5
    x[1, 0] = 3e4
    q, s, _, _ = backends.dispatch("block_quantize", x, E4M3, 1, True, 0.0, False)
    assert s.shape == (1, 2) and s[0, 0] == 1 / 256 and s[0, 1] == 128
    assert (q[0] == 0x78).all() and q[1, 0] == 0x77  # 3e4 / 128 = 234.4 -> 240
    assert (q[1, 1:] == 0x02).all()  # 0.5 * 2**-7 = 2**-8: the subnormal 2 * 2**-9
    q, s, _, _ = backends.dispatch("block_quantize", x, E4M3, 1, False, 0.0, False)
    assert s[0, 0] == np.float32(1) / np.float32(448) and (q[0] == 0x7E).all()
    _, s, _, _ = backends.dispatch("block_quantize", x[:1], E4M3, 1, True, 4.0, False)
    assert s[0, 0] == 1 / 64


def test_reference_saturation_and_inf_scale():
    """Values past fp8_max * (1 / scale) cannot occur in a block (the scale comes from its
    amax), except through the float32 scale's rounding: they saturate. A tiny amax (fp8_max
    / amax = inf) takes the input dtype's largest finite value as the scale: FLT_MAX (2**127
    with power-of-two scales) for float32, 0x1.FEp127 for bfloat16, 65504 for float16."""
    for dtype, want in ((np.float32, float(np.finfo(np.float32).max)),
                        (tecupy.bfloat16, float.fromhex("0x1.FEp127")),
                        (np.float16, 65504.0)):
        tiny = np.finfo(np.float32).smallest_subnormal if dtype == np.float32 else \
            float(ml_dtypes.finfo(dtype).smallest_subnormal)
        x = np.full((1, 128), tiny, dtype)
        _, s, _, _ = backends.dispatch("block_quantize", x, E4M3, 1, False, 0.0, False)
        with np.errstate(over="ignore"):
            if float(np.float32(448) / np.float32(np.float32(x[0, 0]))) == np.inf:
                assert s[0, 0] == np.float32(1) / np.float32(want), dtype
        _, s2, _, _ = backends.dispatch("block_quantize", x, E4M3, 1, True, 0.0, False)
        assert np.frexp(s2[0, 0])[0] == 0.5
    x = np.full((1, 128), np.float32(448) * np.float32(1.0001), np.float32)
    q, _, _, _ = backends.dispatch("block_quantize", x, E4M3, 1, False, 0.0, False)
    assert (q == 0x7E).all()


def test_dequantize_and_layouts(rng):
    x = _random(rng, (200, 300), np.float32)
    for block_dim in (1, 2):
        q, s, qt, st = backends.dispatch("block_quantize", x, E4M3, block_dim, True, 0.0, True)
        t = FP8BlockTensor(q, E4M3, s, qt, st, block_dim)
        bh = 1 if block_dim == 1 else 128
        s_rc = s.T if block_dim == 1 else s  # [R / bh, nb]
        dec = q.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        each = np.empty_like(dec)  # each element's scale_inv
        for (i, j), _ in np.ndenumerate(dec[::bh, ::128]):
            each[i * bh:(i + 1) * bh, j * 128:(j + 1) * 128] = s_rc[i, j]
        np.testing.assert_array_equal(t.dequantize(), dec * each)
        np.testing.assert_array_equal(tecupy.dequantize(t), dec * each)  # (the public one)
        np.testing.assert_array_equal(t.dequantize(np.float16),
                                      (dec * each).astype(np.float16))
        # round to nearest: half a step, 2**-4 relative for normals, 2**-10 * scale_inv
        # for E4M3's subnormals
        assert (np.abs(t.dequantize() - x) <= np.abs(x) * 2 ** -4 + each * 2 ** -10).all()
        assert np.abs(t.T.dequantize() - x.T).max() <= np.abs(x).max() * 2 ** -4


# ---- the block GEMM --------------------------------------------------------------------------
def test_gemm_of_mixed_scalings_is_refused(rng):
    """A per-tensor FP8Tensor with a block-scaled one: a clear error, not the per-tensor
    GEMM reading the first block's scale as the whole weight's (what tensor parallel's
    sequence gather once fed it under Float8BlockScaling)."""
    from tecupy.fp8 import quantize
    from tecupy.ops.linear import fp8_gemm
    x = _random(rng, (256, 256), np.float32, 2)  # 2 x 2 blocks of 128 x 128
    b = backends.dispatch("block_quantize", x, E4M3, 2, True, 0.0, False)
    tb = FP8BlockTensor(b[0], E4M3, b[1], block_dim=2)
    ta = quantize(x, np.ones(1, np.float32), E4M3)
    for qa, qb in ((ta, tb), (tb, ta)):
        with pytest.raises(TypeError, match="fp8_gemm: qa and qb must be of one scaling"):
            fp8_gemm(qa, qb, np.float32)
    with pytest.raises(ValueError, match="fp8_gemm: b_scale_inv must be one float32 scale"):
        backends.dispatch("fp8_gemm", ta.data, E4M3, ta.scale_inv, tb.data, E4M3, tb.scale_inv,
                          np.float32)  # (the reference: it read the first block's scale)


@pytest.mark.parametrize("dims", [(1, 2), (1, 1), (2, 1)])
def test_reference_block_gemm(rng, dims):
    """The block GEMM equals the float64 matmul of the dequantized operands (to float32's
    accuracy); with its bias and into an accumulator."""
    m, n, k = 48, 144, 400  # 4 K blocks, the last partial
    xa, xb = _random(rng, (m, k), np.float32, 2), _random(rng, (n, k), np.float32, 2)
    a = backends.dispatch("block_quantize", xa, E4M3, dims[0], True, 0.0, False)
    b = backends.dispatch("block_quantize", xb, E5M2, dims[1], True, 0.0, False)
    ta = FP8BlockTensor(a[0], E4M3, a[1], block_dim=dims[0])
    tb = FP8BlockTensor(b[0], E5M2, b[1], block_dim=dims[1])
    want = ta.dequantize(np.float64) @ tb.dequantize(np.float64).T
    bias = rng.standard_normal(n).astype(np.float32)
    y = backends.dispatch("fp8_block_gemm", a[0], E4M3, a[1], b[0], E5M2, b[1], np.float32,
                          bias)
    scale = np.abs(want).max()
    np.testing.assert_allclose(y, want + bias, rtol=1e-5, atol=1e-5 * scale)
    acc = np.ones((m, n), np.float32)
    backends.dispatch("fp8_block_gemm", a[0], E4M3, a[1], b[0], E5M2, b[1], np.float32,
                      out=acc, accumulate=True)
    np.testing.assert_allclose(acc, want + 1, rtol=1e-5, atol=1e-5 * scale)
    with pytest.raises(ValueError, match="K differ"):
        backends.dispatch("fp8_block_gemm", a[0], E4M3, a[1], b[0][:, :256], E5M2,
                          b[1][:, :2], np.float32)
    with pytest.raises(ValueError, match="fits neither"):
        backends.dispatch("fp8_block_gemm", a[0], E4M3, a[1][:, :2], b[0], E5M2, b[1],
                          np.float32)


def test_block_gemm_promotion_order(rng):
    """Per K block: a float32 partial product times sa * sb, added in K-block order."""
    m, n, k = 16, 16, 384
    xa, xb = _random(rng, (m, k)), _random(rng, (n, k))
    a = backends.dispatch("block_quantize", xa, E4M3, 1, False, 0.0, False)
    b = backends.dispatch("block_quantize", xb, E4M3, 2, False, 0.0, False)
    fa = a[0].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    fb = b[0].view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    acc = np.zeros((m, n), np.float32)
    for kb in range(3):
        ks = slice(128 * kb, 128 * kb + 128)
        acc = acc + (fa[:, ks] @ fb[:, ks].T) * (a[1][kb][:, None] * b[1][0, kb])
    y = backends.dispatch("fp8_block_gemm", a[0], E4M3, a[1], b[0], E4M3, b[1], np.float32)
    np.testing.assert_array_equal(y, acc)


# ---- the recipe ------------------------------------------------------------------------------
def test_recipe_defaults_match_transformer_engine():
    r = Float8BlockScaling()
    assert r.fp8_format is Format.E4M3
    assert (r.x_block_scaling_dim, r.w_block_scaling_dim, r.grad_block_scaling_dim) == (1, 2, 1)
    for q in (r.fp8_quant_fwd_inp, r.fp8_quant_fwd_weight, r.fp8_quant_bwd_grad):
        assert q == QParams(power_2_scale=True, amax_epsilon=0.0)
    assert r.fp8_gemm_fprop_split_accumulator and not r.fp8_dpa and not r.fp8_mha
    assert "x_block_scaling_dim=1" in repr(r)
    assert Float8BlockScaling(fp8_format=Format.HYBRID).fp8_format is Format.HYBRID


@pytest.mark.parametrize("kwargs,err,match", [
    (dict(fp8_format=Format.E5M2), ValueError, "pure E5M2"),
    (dict(fp8_format="e4m3"), TypeError, "fp8_format must be"),
    (dict(x_block_scaling_dim=3), ValueError, r"x_block_scaling_dim must be an int in \[1, 2\]"),
    (dict(w_block_scaling_dim=0), ValueError, "w_block_scaling_dim"),
    (dict(grad_block_scaling_dim="1"), TypeError, "grad_block_scaling_dim"),
    (dict(x_block_scaling_dim=2), ValueError, "x_block_scaling_dim and w_block_scaling_dim"),
    (dict(w_block_scaling_dim=1, x_block_scaling_dim=2, grad_block_scaling_dim=2), ValueError,
     "x_block_scaling_dim and grad_block_scaling_dim are both 2"),
    (dict(grad_block_scaling_dim=2), ValueError, "w_block_scaling_dim and grad"),
    (dict(fp8_gemm_wgrad_split_accumulator=False), ValueError, "split accumulation"),
    (dict(fp8_dpa=True), ValueError, "FP8 attention"),
    (dict(fp8_mha="no"), TypeError, "fp8_mha must be True or False"),
    (dict(fp8_quant_fwd_inp=True), TypeError, "must be a tecupy.recipe.QParams"),
])
def test_recipe_errors(kwargs, err, match):
    with pytest.raises(err, match=match):
        Float8BlockScaling(**kwargs)


def test_recipe_fields_checked_on_assignment_and_qparams():
    r = Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1)
    with pytest.raises(ValueError, match="x_block_scaling_dim"):
        r.x_block_scaling_dim = 5
    with pytest.raises(ValueError, match="FP8 attention"):
        r.fp8_mha = True
    assert r.x_block_scaling_dim == 2 and not r.fp8_mha
    for bad, err in ((-1.0, ValueError), (float("nan"), ValueError), ("0", TypeError),
                     (True, TypeError)):
        with pytest.raises(err, match="amax_epsilon"):
            QParams(amax_epsilon=bad)
    with pytest.raises(TypeError, match="power_2_scale"):
        QParams(power_2_scale="yes")
    with pytest.raises(AttributeError, match="immutable"):
        QParams().amax_epsilon = 1.0


# ---- the quantizer and FP8BlockTensor ------------------------------------------------------
def test_block_quantizers(rng):
    st = FP8State()
    r = Float8BlockScaling(fp8_format=Format.HYBRID,
                           fp8_quant_bwd_grad=QParams(power_2_scale=False, amax_epsilon=1e-3))
    with tecupy.fp8_autocast(fp8_recipe=r):
        q = gemm_quantizers(st, 0, np)
    assert st.fwd is None and q.once is None and q.after_backward == ()  # no state
    for quant, fmt, dim in ((q.input, E4M3, 1), (q.weight, E4M3, 2), (q.grad_output, E5M2, 1)):
        assert isinstance(quant, BlockQuantizer) and not quant.fused_ok
        assert quant.fmt is fmt and quant.block_dim == dim and quant.scale is None
    assert not q.grad_output.power_2_scale and q.grad_output.amax_epsilon == np.float32(1e-3)
    with tecupy.fp8_autocast(fp8_recipe=Float8BlockScaling()):
        assert gemm_quantizers(st, 0, np).grad_output.fmt is E4M3  # E4M3 both directions
    x = _random(rng, (32, 160))
    t, db = q.grad_output.quantize(x, transpose=True, dbias_dtype=np.float32)
    _check_equal((t.data, t.scale_inv, t.data_t, t.scale_inv_t),
                 naive_quantize(x, E5M2, 1, False, np.float32(1e-3)))
    np.testing.assert_allclose(db, x.sum(0), rtol=1e-5, atol=1e-5 * np.abs(x).max())
    assert t.gemm_op == "fp8_block_gemm" and isinstance(t, FP8BlockTensor)
    with pytest.raises(TypeError, match="fused_ok is False"):
        q.input.wrap(t.data)
    with pytest.raises(ValueError, match="2-D"):
        q.input.quantize(x.reshape(2, 16, 160))


def test_block_tensor_copies(rng):
    x = _random(rng, (256, 160))
    q1 = BlockQuantizer(E4M3, 1, QParams())
    t = q1.quantize(x, transpose=True)
    c = t.columnwise()
    assert c.data is t.data_t and c.scale_inv is t.scale_inv_t and c.data_t is None
    assert t.T.data is t.data_t and t.T.data_t is t.data and t.T.scale_inv_t is t.scale_inv
    assert t.rowwise().data_t is None and t.rowwise().scale_inv is t.scale_inv
    with pytest.raises(ValueError, match="no column-wise copy"):
        t.rowwise().T
    r = t.rows(16, 48)  # rows of 1x128 blocks: their columns of scale_inv
    np.testing.assert_array_equal(r.dequantize(), t.dequantize()[16:48])
    w = BlockQuantizer(E4M3, 2, QParams()).quantize(x)  # 128x128: transposed exactly
    np.testing.assert_array_equal(w.T.dequantize(), w.dequantize().T)
    np.testing.assert_array_equal(w.rows(128, 256).dequantize(), w.dequantize()[128:])
    with pytest.raises(ValueError, match="block edges"):
        w.rows(16, 48)
    with pytest.raises(ValueError, match="fits neither"):
        FP8BlockTensor(t.data, E4M3, t.scale_inv[:, :7])
    with pytest.raises(ValueError, match="block_dim"):
        FP8BlockTensor(t.data, E4M3, t.scale_inv, block_dim=3)
    with pytest.raises(ValueError, match="not block_dim=2"):
        FP8BlockTensor(t.data, E4M3, t.scale_inv, block_dim=2)


def test_fused_blocks_keep_only_the_column_wise_copy(rng, monkeypatch):
    """A fused block's forward GEMM keeps for its backward only the column-wise copy of its
    input where the cast made one (block scaling: both copies), so the row-wise codes die
    after the forward GEMM (fc2's input: 128 MiB at the quickstart layer); a producer's
    row-wise codes (no copy) are kept as they are. LayerNormMLP under Float8BlockScaling:
    its node keeps no row-wise input codes, and its saved bytes fall by theirs."""
    from tecupy.fp8 import FP8Tensor
    from tecupy.ops import blocks
    from tecupy.tape_memory import saved_bytes
    x = _random(rng, (256, 160))
    w = BlockQuantizer(E4M3, 2, QParams()).quantize(_random(rng, (64, 160)), transpose=True)
    t = BlockQuantizer(E4M3, 1, QParams()).quantize(x, transpose=True)
    kept = blocks.kept_operands(t, w)
    assert kept[0].data is t.data_t and kept[0].data_t is None and kept[2] is True
    first = kept[0]
    assert blocks.released(kept)[0] is first and kept == []  # (taken out of the closure)
    row = FP8Tensor(t.data, E4M3, np.ones(1, np.float32))  # (a producer's: row-wise only)
    kept = blocks.kept_operands(row, w)
    assert kept[0] is row and kept[2] is False
    np.testing.assert_array_equal(blocks.released(kept)[0].data, row.data.T)

    mlp = tecupy.nn.LayerNormMLP(256, 512, device="cpu", seed=0, params_dtype=np.float32)
    xs = _random(rng, (384, 256))
    seen, real = [], blocks.kept_operands
    monkeypatch.setattr(blocks, "kept_operands",
                        lambda qx, qw: seen.append((qx, real(qx, qw))) or seen[-1][1])
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=Float8BlockScaling()):
        mlp(xs)
    assert len(seen) == 2 and all(k[0].data is qx.data_t for qx, k in seen)
    rowwise = sum(qx.data.nbytes + qx.scale_inv.nbytes for qx, _ in seen)
    del seen[:]  # (the spy's references to the row-wise codes)
    monkeypatch.setattr(blocks, "kept_operands", lambda qx, qw: [qx, *real(qx, qw)[1:]])
    with tecupy.Tape() as whole, tecupy.fp8_autocast(fp8_recipe=Float8BlockScaling()):
        mlp(xs)
    assert saved_bytes(whole)[0][0][1] - saved_bytes(tape)[0][0][1] == rowwise


# ---- modules under the recipe, on NumPy ------------------------------------------------------
def _spy(monkeypatch):
    calls = []
    real = backends.dispatch

    def spy(op, *args, **kwargs):
        calls.append(op)
        return real(op, *args, **kwargs)
    monkeypatch.setattr(backends, "dispatch", spy)
    return calls


def _close(got, want, tol):
    s = float(np.abs(asnp(want)).max())
    np.testing.assert_allclose(asnp(got) / s, asnp(want) / s, **tol)


def _module_step(mod, x, dy, recipe):
    with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=recipe is not None,
                                                    fp8_recipe=recipe):
        y = mod(x)
    return y, tape.gradient(y, mod, output_grad=dy)


@pytest.mark.parametrize("which", ["Linear", "LayerNormMLP", "TransformerLayer"])
def test_modules_under_block_scaling_close_to_high_precision(xp, rng, which, monkeypatch):
    """Forward and backward under Float8BlockScaling (E4M3 both ways; K of 192 and 320: a
    partial K block) within the E4M3 tolerance of the high-precision step, relative to each
    tensor's scale, as the per-tensor recipes are tested (test_autocast.py); every GEMM went
    through fp8_block_gemm, every cast through block_quantize (dy's with dbias from the same
    read)."""
    dev = "cpu" if xp is np else "cuda"
    if which == "Linear":
        mod, shape = tecupy.nn.Linear(192, 320, device=dev, seed=3), (4, 16, 192)
        out = (4, 16, 320)
    elif which == "LayerNormMLP":
        mod, shape = tecupy.nn.LayerNormMLP(192, 320, device=dev, seed=5), (64, 192)
        out = shape
    else:
        mod = tecupy.nn.TransformerLayer(192, 320, 4, hidden_dropout=0.0,
                                         attention_dropout=0.0, device=dev, seed=7)
        shape = out = (16, 2, 192)
    x = xp.asarray(rng.standard_normal(shape).astype(np.float32))
    dy = xp.asarray(rng.standard_normal(out).astype(np.float32))
    y_hp, g_hp = _module_step(mod, x, dy, None)
    calls = _spy(monkeypatch)
    y, g = _module_step(mod, x, dy, Float8BlockScaling())
    gemms = {"Linear": 3, "LayerNormMLP": 6, "TransformerLayer": 12}[which]
    assert calls.count("fp8_block_gemm") == gemms and "fp8_gemm" not in calls
    assert "cast_to_fp8" not in calls and "cast_transpose" not in calls
    # (x, w per GEMM; dy with its dbias from the same read, block_quantize_dbias, but fc1's,
    # the activation's backward's in the kernel's read of fc2's dgrad and h; fc2's x in the
    # activation's read of h)
    casts = ("block_quantize", "block_quantize_dbias", "block_quantize_act",
             "block_quantize_dact")
    assert sum(map(calls.count, casts)) == gemms
    mlp = 0 if which == "Linear" else 1
    assert calls.count("block_quantize_act") == calls.count("block_quantize_dact") == mlp
    assert calls.count("block_quantize_dbias") == {"Linear": 1, "LayerNormMLP": 1,
                                                   "TransformerLayer": 3}[which]
    assert "bias_grad" not in calls
    _close(y, y_hp, E4M3_TOL)
    err = np.linalg.norm(asnp(y) - asnp(y_hp)) / np.linalg.norm(asnp(y_hp))
    assert err < 0.1  # (as test_autocast.py asserts of delayed scaling)
    for k in g_hp:  # the gradients' tolerance of the per-tensor tests (test_autocast.py)
        _close(g[k], g_hp[k], dict(rtol=0.25, atol=0.125))
        err = np.linalg.norm(asnp(g[k]) - asnp(g_hp[k])) / np.linalg.norm(asnp(g_hp[k]))
        assert err < 0.1, (k, err)


# ---- the seam ------------------------------------------------------------------------------------
def _names(module):
    tree = ast.parse(inspect.getsource(module))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names} | \
        {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
         and isinstance(n.value, str) and len(n.value) < 40}


def test_block_recipe_touched_no_op_file():
    """Block scaling lives in the recipe, its quantizer and tensor, and its kernels: no op
    module, nor the tape, names any of it (ops call the quantizers and the tensor's
    gemm_op)."""
    import tecupy.ops
    banned = {"Float8BlockScaling", "FP8BlockTensor", "BlockQuantizer", "block_quantize",
              "fp8_block_gemm", "block_dim", "scale_inv_t", "block_scaling", "QParams",
              "x_block_scaling_dim", "power_2_scale"}
    ops_dir = pathlib.Path(tecupy.ops.__file__).parent
    modules = [importlib.import_module(f"tecupy.ops.{p.stem}") for p in ops_dir.glob("*.py")]
    modules.append(importlib.import_module("tecupy.tape"))
    assert len(modules) >= 9
    for module in modules:
        assert not _names(module) & banned, (module.__name__, _names(module) & banned)


# ---- the CUDA kernels against the reference (GPU) ---------------------------------------------
SHAPES = [(256, 384), (48, 400), (136, 264), (8, 8), (1024, 2048), (392, 136)]


def _gpu_quantize(x, fmt, block_dim, p2, eps, transpose):
    import cupy
    from conftest import poison_gpu_pool
    gx = cupy.asarray(x)
    impl = backends.candidates("block_quantize", gx, fmt, block_dim, p2, eps, transpose)[0]
    assert impl.kind == "cuda"
    poison_gpu_pool()
    out = impl.fn(gx, fmt, block_dim, p2, eps, transpose)
    cupy.cuda.runtime.deviceSynchronize()
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("block_dim", [1, 2])
def test_kernel_block_quantize_bit_exact(rng, shape, dtype, block_dim):
    x = _random(rng, shape, dtype)
    if min(shape) >= 256:
        x = _specials(x)
    for fmt, p2, eps, transpose in ((E4M3, True, 0.0, True), (E5M2, True, 0.0, True),
                                    (E4M3, False, 0.0, True), (E4M3, True, 0.25, False)):
        want = backends.dispatch("block_quantize", x, fmt, block_dim, p2, eps, transpose)
        got = _gpu_quantize(x, fmt, block_dim, p2, eps, transpose)
        _check_equal(got, [None if w is None else asnp(w) for w in want])


@pytest.mark.gpu
@pytest.mark.parametrize("shape", SHAPES + [(2056, 264)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_kernel_block_quantize_dbias(rng, shape, dtype):
    """The backward's cast of dy with dbias from the same read: the codes and scales bit
    for bit block_quantize's, dbias the column sums (float32 sums of 128-row tiles, then
    of the tiles) against float64's, in dbias's dtype, on poisoned outputs."""
    import cupy
    from conftest import poison_gpu_pool
    x = _random(rng, shape, dtype)
    gx = cupy.asarray(x)
    for fmt, p2, out in ((E5M2, True, tecupy.bfloat16), (E4M3, False, np.float32)):
        impl = backends.candidates("block_quantize_dbias", gx, fmt, p2, 0.0, out)[0]
        assert impl.kind == "cuda"
        poison_gpu_pool()
        *codes, db = impl.fn(gx, fmt, p2, 0.0, out)
        want = backends.dispatch("block_quantize", x, fmt, 1, p2, 0.0, True)
        _check_equal(codes, want)
        exact = x.astype(np.float64).sum(0)
        tol = 2e-6 * shape[0] ** 0.5 * np.abs(x.astype(np.float64)).sum(0) + (
            np.abs(exact) * (2.0 ** -8 if out is tecupy.bfloat16 else 0))
        assert db.dtype == np.dtype(out) and db.shape == (shape[1],)
        assert np.all(np.abs(asnp(db).astype(np.float64) - exact) <= tol)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 384), (136, 264), (8, 8), (392, 136)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_kernel_block_quantize_act(rng, shape, dtype):
    """The activation's output quantized in the kernel's read of h: bit for bit the GPU's
    two kernels (the activation into h's dtype, then block_quantize), with and without a
    bias, on poisoned outputs; relu against the reference too (exact arithmetic)."""
    import cupy
    from conftest import poison_gpu_pool
    h = cupy.asarray(_random(rng, shape, dtype, spread=1.0))
    bias = cupy.asarray(rng.standard_normal(shape[1]).astype(dtype))
    for name, b, fmt, block_dim in (("gelu", bias, E4M3, 1), ("gelu", None, E4M3, 1),
                                    ("relu", bias, E5M2, 2), ("gelu", bias, E4M3, 2)):
        impl = backends.candidates("block_quantize_act", h, b, name, fmt, block_dim, True,
                                   0.0, True)[0]
        assert impl.kind == "cuda"
        poison_gpu_pool()
        got = impl.fn(h, b, name, fmt, block_dim, True, 0.0, True)
        a = backends.dispatch(f"{name}_fwd", h, b)
        _check_equal(got, [asnp(w) for w in backends.dispatch("block_quantize", a, fmt,
                                                               block_dim, True, 0.0, True)])
        if name == "relu":
            want = backends.dispatch("block_quantize_act", asnp(h), None if b is None
                                     else asnp(b), name, fmt, block_dim, True, 0.0, True)
            _check_equal(got, want)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(256, 384), (136, 264), (8, 8), (2056, 264)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_kernel_block_quantize_dact(rng, shape, dtype):
    """The activation's backward quantized in the kernel's read of dy and h: codes, scales
    and dbias bit for bit the GPU's two kernels (the activation's backward into dy's dtype,
    then block_quantize_dbias: the same tile sums), with and without bias and dbias, on
    poisoned outputs."""
    import cupy
    from conftest import poison_gpu_pool
    h = cupy.asarray(_random(rng, shape, dtype, spread=1.0))
    dy = cupy.asarray(_random(rng, shape, dtype))
    bias = cupy.asarray(rng.standard_normal(shape[1]).astype(dtype))
    for name, b, fmt, db in (("gelu", bias, E4M3, tecupy.bfloat16), ("gelu", None, E5M2, None),
                             ("relu", bias, E4M3, np.float32)):
        impl = backends.candidates("block_quantize_dact", dy, h, b, name, fmt, True, 0.0,
                                   db)[0]
        assert impl.kind == "cuda"
        poison_gpu_pool()
        *got, got_db = impl.fn(dy, h, b, name, fmt, True, 0.0, db)
        dx, _ = backends.dispatch(f"{name}_bwd", dy, h, b)
        if db is None:
            want, want_db = backends.dispatch("block_quantize", dx, fmt, 1, True, 0.0, True), None
        else:
            *want, want_db = backends.dispatch("block_quantize_dbias", dx, fmt, True, 0.0, db)
        _check_equal(got, [asnp(w) for w in want])
        assert (got_db is None) == (want_db is None)
        if db is not None:
            np.testing.assert_array_equal(asnp(got_db), asnp(want_db))


@pytest.mark.gpu
def test_kernel_nan_inf_zero_blocks_and_extremes(rng):
    for dtype in DTYPES:
        x = np.zeros((256, 256), dtype)
        x[:, 128:] = _random(rng, (256, 128), dtype)
        x[3, 200] = np.nan
        x[7, 140] = np.inf
        x[9, 150] = -np.inf
        x[11, 128:] = np.finfo(np.float32).smallest_subnormal if dtype == np.float32 else \
            float(ml_dtypes.finfo(dtype).smallest_subnormal)
        x[13, 128:] = float(ml_dtypes.finfo(dtype).max)
        for block_dim in (1, 2):
            for p2 in (True, False):
                want = backends.dispatch("block_quantize", x, E4M3, block_dim, p2, 0.0, True)
                _check_equal(_gpu_quantize(x, E4M3, block_dim, p2, 0.0, True), want)


@pytest.mark.gpu
def test_kernel_shapes_it_cannot_take_run_on_the_reference(rng):
    import cupy
    for shape in ((12, 256), (256, 20)):
        gx = cupy.asarray(_random(rng, shape))
        assert backends.chosen("block_quantize", gx, E4M3, 1, True, 0.0, True) == "reference"
    gx = cupy.asarray(_random(rng, (64, 256)).astype(np.float64))
    assert backends.chosen("block_quantize", gx, E4M3, 1, True, 0.0, True) == "reference"
    gx = cupy.asarray(_random(rng, (64, 256)))
    assert backends.chosen("block_quantize", gx, E4M3, 1, True, 0.0, True) == "cuda"


def test_launcher_shapes_and_arguments_without_gpu(monkeypatch):
    """The CUDA wrapper's outputs (shapes in FP8BlockTensor's layouts), grid (one block per
    128 x 128 tile) and kernel arguments, with CuPy's allocation and the kernel faked."""
    import cupy
    from tecupy import loader
    from tecupy.kernels import block_scaling as K
    launched = []
    monkeypatch.setattr(cupy, "empty", lambda shape, dtype=np.float32: np.empty(shape, dtype))
    monkeypatch.setattr(loader, "function", lambda file, name: (
        lambda grid, block, args: launched.append((file, name, grid, block, args))))
    x = np.zeros((136, 264), tecupy.bfloat16)
    q, s, qt, st = K.block_quantize(x, E5M2, 1, False, 0.5, True)
    assert (q.shape, s.shape, qt.shape, st.shape) == ((136, 264), (3, 136), (264, 136), (2, 264))
    q2, s2, qt2, st2 = K.block_quantize(x, E4M3, 2, True, 0.0, False)
    assert (s2.shape, qt2, st2) == ((2, 3), None, None)
    (f1, n1, g1, b1, a1), (f2, n2, g2, b2, a2) = launched
    assert n1 == "block_quantize<__nv_bfloat16, __nv_fp8_e5m2, false, false>"
    assert n2 == "block_quantize<__nv_bfloat16, __nv_fp8_e4m3, true, true>"
    assert {n1, n2} <= set(loader.declared()[K.FILE]) and f1 == f2 == K.FILE
    assert g1 == g2 == (3, 2) and b1 == (256,)
    assert a1[0] is x and a1[1] is q and a1[2] is s and a1[3] is qt and a1[4] is st
    assert a2[3] == 0 and a2[4] == 0 and isinstance(a2[3], np.uint64)  # null pointers
    assert [type(v) for v in a1[5:10]] == [np.int32, np.int32] + [np.float32] * 3
    assert a1[5:] == (136, 264, 57344.0, 0.5, float.fromhex("0x1.FEp127"), 0, 0, 0)  # (no
    assert a2[7:] == (448.0, 0.0, float.fromhex("0x1.FEp127"), 0, 0, 0)  # part, bias, h)


def test_block_gemm_kernels_declared_and_fit_in_shared_memory():
    """The block GEMM's ahead-of-time instantiations are in fp8_gemm.cu's list (python -m
    tecupy.build compiles them), one per B layout, output, epilogue and tile, and each tile's
    stages, staging and 1x128 B factors fit in shared memory."""
    from tecupy import loader
    from tecupy.kernels import block_scaling as B
    from tecupy.kernels import fp8_gemm as G
    declared = set(loader.declared("sm_90a")[G.FILE])
    names = list(B._gemm_names())
    assert len(names) == len(set(names)) == 52 and set(names) <= declared
    assert all(n.startswith("tc::fp8_block_gemm_tn<") for n in names)
    residual = list(B._residual_names(True))  # forward GEMMs' residual add: 16-bit D, E4M3
    assert len(residual) == 8 and set(residual) <= declared and all(
        ", 2>" in n and ("4, false" in n or "5, false" in n) for n in residual)
    for config, _ in G.DEFAULTS[True]:
        assert G.smem_bytes(config, True, 1) <= G.SMEM_MAX, config
        assert G.smem_bytes(config, True, 2) == G.smem_bytes(config, True)  # no factors kept
        for scale in (1, 2):
            name = G.kernel_name("e4m3", "e4m3", "__nv_bfloat16", 0, False, config, scale)
            assert name in declared and name.endswith(f", false, {scale}>")
    with pytest.raises(AssertionError):  # block scaling always promotes, never clusters
        G.kernel_name("e4m3", "e4m3", "float", 0, False, (256, 3, False, 1), 2)


def test_block_gemm_on_numpy_runs_the_reference(rng):
    """NumPy operands never reach the kernel's supports() past its first checks."""
    a = backends.dispatch("block_quantize", _random(rng, (64, 256)), E4M3, 1, True, 0.0, False)
    b = backends.dispatch("block_quantize", _random(rng, (72, 256)), E4M3, 2, True, 0.0, False)
    assert backends.chosen("fp8_block_gemm", a[0], E4M3, a[1], b[0], E4M3, b[1],
                           np.float32) == "reference"


def test_block_pipeline_switch_names_and_shared_memory():
    """The pipelined block GEMM (fp8_block_gemm_pipe_tn, fp8_gemm.BLOCK_PIPELINE) is on
    unless TECUPY_BLOCK_PIPELINE=0; its kernels are declared beside fp8_block_gemm_tn's
    (so python -m tecupy.build compiles them), with the same tiles; its shared
    memory adds a stage's A factors and two B-factor tables to the kernel's (CPU: names and
    sizes only)."""
    import os
    import subprocess
    import sys
    from tecupy import loader
    from tecupy.kernels import block_scaling as B
    from tecupy.kernels import fp8_gemm as G
    if os.environ.get("TECUPY_BLOCK_PIPELINE", "1") != "0":
        assert G.BLOCK_PIPELINE is True
    code = "from tecupy.kernels import fp8_gemm as G; print(G.BLOCK_PIPELINE)"
    for env, want in (("0", "False"), ("1", "True")):
        got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "TECUPY_BLOCK_PIPELINE": env}, check=True)
        assert got.stdout.strip() == want
    names = list(B._pipe_names())
    declared = loader.declared().get(G.FILE, ())
    assert names and all(n in declared for n in names)
    assert all(n.startswith("tc::fp8_block_gemm_pipe_tn<") and n.endswith((", 1>", ", 2>"))
               for n in names)
    plain = {n.replace("fp8_block_gemm_tn<", "fp8_block_gemm_pipe_tn<")
             for n in B._gemm_names()}
    assert plain == set(names)  # the same GEMMs, the same tiles
    with pytest.raises(AssertionError):  # (no cluster under block scaling)
        G.kernel_name("e4m3", "e4m3", "float", 0, False, (192, 4, True, 2), 1, True)
    config = (192, 4, True, 1)
    assert (G.smem_bytes(config, True, 2, 4096) - G.smem_bytes(config, True, 2)
            == 4 * 128 * 4 + 2 * 2 * 32 * 4 + 4 * 8)  # (two tables of 2 rows, 4 barriers)
    # 1x128 B: the stages' A factors only (its B factors come with each stage already)
    assert G.smem_bytes(config, True, 1, 4096) - G.smem_bytes(config, True, 1) == 4 * 128 * 4
    assert G.smem_bytes(config, True, 2, 65536) <= G.SMEM_MAX  # K of 64 Ki: 512 k-blocks

"""CUDA LayerNorm / RMSNorm forward and backward against the float64 reference."""
import numpy as np
import pytest

import tecupy
from tecupy.kernels import norm as norm_kernels
from conftest import asnp, assert_within_2x_reference, f64, fp8_step, run

pytestmark = pytest.mark.gpu
DTYPES = [np.float32, np.float16, tecupy.bfloat16]
SHAPES = [(1, 8), (37, 1001), (129, 4096), (3, 5, 768), (7, 16384)]


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zcg", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_norm_forward_and_backward(rng, rms, zcg, dtype, shape):
    hidden = shape[-1]
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    gamma = rng.uniform(-1.5, 1.5, hidden).astype(dtype)
    beta = rng.standard_normal(hidden).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    name = "rmsnorm" if rms else "layernorm"
    fwd_args = [x, gamma, 1e-5, zcg] if rms else [x, gamma, beta, 1e-5, zcg]
    got = run(f"{name}_fwd", fwd_args, True)
    want = run(f"{name}_fwd", f64(fwd_args), False)
    lp = run(f"{name}_fwd", fwd_args, False)
    assert_within_2x_reference(got[0], want[0], lp[0], f"{name} y")
    for g, w, name_s in zip(got[1:], want[1:], ("mu/rsigma", "rsigma")):
        np.testing.assert_allclose(g.get(), w, rtol=2e-6, atol=1e-6, err_msg=name_s)
    saved = [s.get() for s in got[1:]]
    bwd_args = [dy, x, *saved, gamma, zcg]
    gotb = run(f"{name}_bwd", bwd_args, True)
    wantb = run(f"{name}_bwd", f64([dy, x]) + [s.astype(np.float64) for s in saved]
                + f64([gamma]) + [zcg], False)
    lpb = run(f"{name}_bwd", bwd_args, False)
    for g, w, l, n in zip(gotb, wantb, lpb, ("dx", "dgamma", "dbeta")):
        assert_within_2x_reference(g, w, l, f"{name} {n}", atol=1e-5)


def test_layernorm_op_uses_cuda_through_the_tape(rng):
    import cupy
    x = cupy.asarray(rng.standard_normal((64, 256)).astype(np.float32))
    w = cupy.asarray(rng.standard_normal(256).astype(np.float32))
    b = cupy.asarray(rng.standard_normal(256).astype(np.float32))
    with tecupy.Tape() as tape:
        y = tecupy.layernorm(x, w, b)
    dx, dw, db = tape.gradient(y, [x, w, b], output_grad=cupy.ones_like(y))
    ref = tecupy.layernorm(x.get(), w.get(), b.get())
    np.testing.assert_allclose(y.get(), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db.get(), np.full(256, 64.0), rtol=1e-6)


@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(16, 64), (129, 4096), (8, 12288), (33, 1001)], ids=str)
def test_norm_forward_fp8_output(rng, rms, dtype, shape):
    """The fused cast: FP8 codes of y * scale and amax(y). y is computed in float32 by both
    sides in a different order, so a code may differ by one step where y sits on a rounding
    boundary; nothing else may differ."""
    from tecupy.fp8 import E4M3
    hidden = shape[-1]
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    gamma = rng.uniform(-1.5, 1.5, hidden).astype(dtype)
    beta = rng.standard_normal(hidden).astype(dtype)
    scale = np.array([rng.uniform(1, 40)], np.float32)
    name = "rmsnorm" if rms else "layernorm"
    args = ([x, gamma] if rms else [x, gamma, beta]) + [1e-5, False, scale, E4M3]
    got = run(f"{name}_fwd_fp8", args, True)
    want = run(f"{name}_fwd_fp8", args, False)
    table = np.arange(256, dtype=np.uint8).view(E4M3.ml_dtype).astype(np.float32)
    g, w = table[asnp(got[0])], table[asnp(want[0])]
    assert np.all(np.isfinite(g))
    differ = g != w
    assert differ.mean() < 0.01
    assert np.all(np.abs(g - w)[differ] <= fp8_step(w, E4M3)[differ])
    np.testing.assert_allclose(asnp(got[-1]), asnp(want[-1]), rtol=1e-5)
    for a, b in zip(got[1:-1], want[1:-1]):
        np.testing.assert_allclose(asnp(a), asnp(b), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("variant", list(norm_kernels.BWD_VARIANTS))
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(37, 1001), (129, 4096), (3, 5, 768), (300, 8192), (2, 40),
                                   (40001, 64)],
                         ids=str)
def test_norm_bwd_variants(monkeypatch, rng, variant, rms, dtype, shape):
    """Every backward variant (scripts/issue3_device.py), also at shapes beyond SHAPES."""
    monkeypatch.setattr(norm_kernels, "BWD_VARIANT", variant)
    test_norm_forward_and_backward(rng, rms, True, dtype, shape)


@pytest.mark.parametrize("variant", list(norm_kernels.FWD_VARIANTS) + ["stream-float"])
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(2, 40), (300, 8192), (40001, 64), (1000, 3000), (77, 2048)],
                         ids=str)
def test_norm_fwd_variants(monkeypatch, rng, variant, rms, dtype, shape):
    """Every forward variant, the stream kernel on short rows too; (40001, 64) has more rows
    than its rings hold, so each warp's ring wraps around several times (mbarrier phases
    flip)."""
    monkeypatch.setattr(norm_kernels, "FWD_VARIANT", variant.split("-")[0])
    monkeypatch.setattr(norm_kernels, "STREAM_GAMMA", "float" if "float" in variant else "input")
    monkeypatch.setattr(norm_kernels, "STREAM_MIN_ROW_BYTES", 0)
    test_norm_forward_and_backward(rng, rms, True, dtype, shape)
    if dtype != np.float32:
        test_norm_forward_fp8_output(rng, rms, dtype, shape)


@pytest.mark.parametrize("groups_stages", [(1, 4, None), (2, 2, 1), (4, 3, None), (8, 3, 1)],
                         ids=str)
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(2, 40), (5, 24), (37, 1000), (129, 4096), (300, 2048),
                                   (40001, 64)], ids=str)
def test_norm_bwd_grp_groups(monkeypatch, rng, groups_stages, rms, dtype, shape):
    """norm_bwd_grp (Hopper) with up to 1-8 groups per block, 2-4 ring slots, one block or
    as many as fit per SM: rows shared unevenly between the groups, rings that wrap, the
    groups' sums merged."""
    groups, stages, per_sm = groups_stages
    monkeypatch.setattr(norm_kernels, "BWD_VARIANT", "grp")
    monkeypatch.setattr(norm_kernels, "BWD_GROUPS", groups)
    monkeypatch.setattr(norm_kernels, "BWD_BLOCKS_PER_SM", per_sm)
    monkeypatch.setitem(norm_kernels.BWD_VARIANTS, "grp", ("grp", stages, "vec"))
    test_norm_forward_and_backward(rng, rms, True, dtype, shape)

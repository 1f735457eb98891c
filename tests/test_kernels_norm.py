"""CUDA LayerNorm / RMSNorm forward and backward against the float64 reference; which
kernels the wrappers can choose (no GPU needed)."""
import itertools

import numpy as np
import pytest

import tecupy
from tecupy import loader
from tecupy.kernels import norm as norm_kernels
from conftest import asnp, assert_within_2x_reference, f64, fp8_step, run

gpu = pytest.mark.gpu
DTYPES = [np.float32, np.float16, tecupy.bfloat16]
SHAPES = [(1, 8), (37, 1001), (129, 4096), (3, 5, 768), (7, 16384)]


@gpu
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
    for g, w, lp, n in zip(gotb, wantb, lpb, ("dx", "dgamma", "dbeta")):
        assert_within_2x_reference(g, w, lp, f"{name} {n}", atol=1e-5)
    # with the gradient x has from another consumer (the residual's) summed in the pass
    dres = rng.standard_normal(shape).astype(dtype)
    gotr = run(f"{name}_bwd", bwd_args + [dres], True)
    wantr = run(f"{name}_bwd", f64([dy, x]) + [s.astype(np.float64) for s in saved]
                + f64([gamma]) + [zcg, dres.astype(np.float64)], False)
    lpr = run(f"{name}_bwd", bwd_args + [dres], False)
    assert_within_2x_reference(gotr[0], wantr[0], lpr[0], f"{name} dx + dres", atol=1e-5)
    for g, w in zip(gotr[1:], gotb[1:]):
        np.testing.assert_array_equal(asnp(g), asnp(w))


@gpu
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


@gpu
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


@gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("shape", [(0, 4096), (33, 1001), (256, 4096), (7, 24576), (3, 5, 768)],
                         ids=str)
def test_norm_forward_fp8_writes_scale_inv(rng, rms, shape):
    """scale_inv_out: the kernel writes 1 / scale (IEEE, as the casts and the reference:
    no flush to zero above 2^126) over a poisoned value, in every kernel the shapes choose
    (warp, block, stream), and with no rows (no kernel: written apart); the codes and amax
    are those of the call without it."""
    import cupy
    from tecupy import backends
    from tecupy.fp8 import E4M3
    hidden = shape[-1]
    x = cupy.asarray((rng.standard_normal(shape) * 3).astype(tecupy.bfloat16))
    gamma = cupy.asarray(rng.uniform(-1.5, 1.5, hidden).astype(tecupy.bfloat16))
    name = "rmsnorm" if rms else "layernorm"
    args = (x, gamma) if rms else (x, gamma, 0 * gamma)
    for value in (rng.uniform(1, 40), 2.0 ** 127, 3e-39):  # (a subnormal scale: inv is inf)
        scale = cupy.asarray(np.array([value], np.float32))
        inv = cupy.full((1,), np.nan, np.float32)
        got = backends.dispatch(f"{name}_fwd_fp8", *args, 1e-5, False, scale, E4M3,
                                scale_inv_out=inv)
        plain = backends.dispatch(f"{name}_fwd_fp8", *args, 1e-5, False, scale, E4M3)
        want = np.float32(1) / np.float32(value)
        assert inv.get()[0] == want or (np.isinf(want) and np.isinf(inv.get()[0]))
        np.testing.assert_array_equal(asnp(got[0]), asnp(plain[0]))
        np.testing.assert_array_equal(asnp(got[-1]), asnp(plain[-1]))


@gpu
@pytest.mark.parametrize("variant", list(norm_kernels.BWD_VARIANTS))
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(37, 1001), (129, 4096), (3, 5, 768), (300, 8192), (2, 40),
                                   (40001, 64)],
                         ids=str)
def test_norm_bwd_variants(monkeypatch, rng, variant, rms, dtype, shape):
    """Every backward variant (ring4 is what runs off Hopper), also at shapes beyond
    SHAPES."""
    monkeypatch.setattr(norm_kernels, "BWD_VARIANT", variant)
    test_norm_forward_and_backward(rng, rms, True, dtype, shape)


@gpu
@pytest.mark.parametrize("variant", list(norm_kernels.FWD_VARIANTS))
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zcg", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(2, 40), (300, 8192), (40001, 64), (1000, 3000), (77, 2048),
                                   (5001, 2048)], ids=str)
def test_norm_fwd_variants(monkeypatch, rng, variant, rms, zcg, dtype, shape):
    """Every forward variant (warp is what runs off Hopper), gamma kept in the input type or
    (zero-centered) as float by the stream kernel; (5001, 2048) has more rows than the
    stream kernel's rings hold (2112 groups of 2 slots on 132 SMs), so rings wrap around
    (mbarrier phases flip)."""
    monkeypatch.setattr(norm_kernels, "FWD_VARIANT", variant)
    test_norm_forward_and_backward(rng, rms, zcg, dtype, shape)
    if dtype != np.float32:
        test_norm_forward_fp8_output(rng, rms, dtype, shape)


@gpu
@pytest.mark.parametrize("rms", [False, True], ids=["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(2, 40), (5, 24), (37, 1000), (129, 4096), (300, 2048),
                                   (40001, 64)], ids=str)
def test_norm_bwd_grp_groups(rng, rms, dtype, shape):
    """norm_bwd_grp (Hopper) at every instantiation it has: one chunk per thread in 8 groups
    per block ((2, 40), (5, 24), (40001, 64), 1000 wide in bf16) or 4 (1000 wide in float,
    2048 in bf16), two chunks in 2 groups (2048 in float, 4096 in bf16) or 1 (4096 in
    float): rows shared unevenly between the groups, rings that wrap, the groups' sums
    merged."""
    test_norm_forward_and_backward(rng, rms, True, dtype, shape)


def _supported_hidden(dtype):
    """Every hidden size the CUDA kernels take (supported()): all up to 4096, then the
    multiples of 16 bytes."""
    vec = 16 // np.dtype(dtype).itemsize
    top = vec * norm_kernels.CHUNKS[-1] * norm_kernels.MAX_THREADS
    return list(range(1, 4097)) + list(range(4096 + vec, top + 1, vec))


def test_declared_kernels_are_the_ones_that_run(monkeypatch):
    """The kernels that the forward and backward choose for every supported hidden size,
    dtype, output and setting, on Hopper and elsewhere, are declared, and every declared
    kernel is chosen for some: none that runs is missing, none kept only for comparison is
    left (no GPU needed)."""
    fwd, bwd = norm_kernels._fwd_kernel, norm_kernels._bwd_kernel
    chosen = {norm_kernels.FWD_FILE: set(), norm_kernels.BWD_FILE: set()}
    for dtype in map(np.dtype, DTYPES):
        t = norm_kernels.CTYPE[dtype]
        chosen[norm_kernels.BWD_FILE] |= {f"norm_bwd_reduce<{t}>", f"norm_bwd_reduce_vec<{t}>"}
        for hidden, sm90 in itertools.product(_supported_hidden(dtype), (True, False)):
            chosen[norm_kernels.FWD_FILE].update(
                fwd(hidden, dtype, fmt, rms, zcg, sm90)[1] for fmt, rms, zcg in
                itertools.product((None, "e4m3", "e5m2"), (False, True), (False, True)))
            chosen[norm_kernels.BWD_FILE].update(bwd(hidden, dtype, rms, sm90)[1]
                                                 for rms in (False, True))
            if sm90 and hidden % 97 == 0:  # the other settings run what runs off Hopper
                monkeypatch.setattr(norm_kernels, "FWD_VARIANT", "warp")
                monkeypatch.setattr(norm_kernels, "BWD_VARIANT", "ring4")
                assert fwd(hidden, dtype, "e4m3", False, True, True) == \
                    fwd(hidden, dtype, "e4m3", False, True, False)
                assert bwd(hidden, dtype, False, True) == bwd(hidden, dtype, False, False)
                monkeypatch.undo()
    for file, names in chosen.items():
        assert names == set(loader.declared()[file]), file

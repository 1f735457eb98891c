"""CUDA delayed-scaling update: bit for bit the reference, many metas in one launch."""
import numpy as np
import pytest

from tecupy import backends
from tecupy.fp8_state import FP8Meta
from tecupy.fp8 import E4M3, E5M2
from tecupy.reference.fp8 import delayed_scaling_update as ref_update

pytestmark = pytest.mark.gpu


def random_meta(xp, rng, n, length, fmt):
    m = FP8Meta(xp, n, length, fmt)
    h = np.abs(rng.standard_normal((length, n)) * 10.0 ** rng.integers(-3, 4, (length, n)))
    h[rng.random((length, n)) < 0.2] = 0
    h[0, rng.random(n) < 0.3] = 0                    # slots with no amax this step
    special = [np.nan, np.inf, 1e-37, 3e38]
    for k, v in enumerate(special):
        if n > k + 1:
            h[0, k + 1] = v
    if length > 2 and n > 6:
        h[2, 6] = np.nan                              # NaN deeper in the history
    m.amax_history[...] = xp.asarray(h.astype(np.float32))
    m.scale[...] = xp.asarray(rng.uniform(0.5, 100, n).astype(np.float32))
    m.scale_inv[...] = 1 / m.scale
    return m


def to_numpy_meta(m):
    c = FP8Meta(np, m.scale.size, m.amax_history.shape[0], m.fmt)
    for name in ("amax_history", "scale", "scale_inv", "fp8_max"):
        getattr(c, name)[...] = getattr(m, name).get()
    return c


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("length", [1, 3, 1024, 1500])
@pytest.mark.parametrize("margin", [0, 2])
def test_update_matches_reference_bit_for_bit(rng, algo, length, margin):
    import cupy
    metas = [random_meta(cupy, rng, n, length, fmt)
             for n, fmt in ((3, E4M3), (2, E5M2), (9, E4M3), (6, E5M2))]
    host = [to_numpy_meta(m) for m in metas]
    assert backends.chosen("delayed_scaling_update", metas, algo, margin) == "cuda"
    backends.dispatch("delayed_scaling_update", metas, algo, margin)
    ref_update(host, algo, margin)
    for m, h in zip(metas, host):
        for name in ("amax_history", "scale", "scale_inv"):
            np.testing.assert_array_equal(getattr(m, name).get(), getattr(h, name),
                                          err_msg=name)


@pytest.mark.parametrize("margin", [1, 3])
def test_update_tiny_amax_with_margin_is_finite(margin):
    """scale = (fp8_max * 2^-margin) / amax, TE's scaled_max / amax
    (transformer_engine/common/recipe/delayed_scaling.cu): finite for amaxes where
    fp8_max / amax alone overflows float32 (the old (fp8_max / amax) / 2^margin gave
    FLT_MAX there)."""
    import cupy
    flt_max = np.float32(np.finfo(np.float32).max)
    for fmt in (E4M3, E5M2):
        lo = np.float32(fmt.max * 2.0 ** -margin) / flt_max
        hi = np.float32(fmt.max) / flt_max
        amax = np.linspace(lo, hi, 258, dtype=np.float32)[1:-1]
        m = FP8Meta(cupy, amax.size, 2, fmt)
        m.amax_history[0] = cupy.asarray(amax)
        host = to_numpy_meta(m)
        backends.dispatch("delayed_scaling_update", [m], "max", margin)
        ref_update([host], "max", margin)
        want = np.float32(fmt.max) * np.float32(2.0 ** -margin) / amax
        assert np.all(np.isfinite(want)) and np.all(want < flt_max)
        np.testing.assert_array_equal(m.scale.get(), want)
        np.testing.assert_array_equal(host.scale, want)
        np.testing.assert_array_equal(m.scale_inv.get(), host.scale_inv)


def test_scale_inverse_keeps_subnormals(rng):
    """scale_inv = 1 / scale as Transformer Engine's kernels compute it: IEEE float32, no
    flush to zero (CuPy's own kernels run with -ftz=true and give 0 above 2^126)."""
    import cupy
    s = np.concatenate([rng.uniform(0.5, 1e4, 997), [2.0 ** 126 * 3, 3e38, 1.0]])
    s = s.astype(np.float32)
    out = cupy.full(s.size, np.nan, np.float32)
    backends.dispatch("fp8_scale_inv", cupy.asarray(s), out)
    assert backends.chosen("fp8_scale_inv", cupy.asarray(s), out) == "cuda"
    want = np.float32(1) / s
    assert want[-2] > 0  # subnormal, kept
    np.testing.assert_array_equal(out.get(), want)


def test_delayed_quantizer_wrap_keeps_subnormals(rng):
    """A fused producer's FP8 output (norm, activation) gets scale_inv from the
    scale_inverse kernel inside DelayedQuantizer.wrap: IEEE, subnormal kept, a fresh copy."""
    import cupy
    import tecupy
    from tecupy.fp8_state import FP8State
    from tecupy.quantization import gemm_quantizers
    st = FP8State()
    with tecupy.fp8_autocast():
        q = gemm_quantizers(st, 0, cupy)
    codes = cupy.asarray(rng.integers(0, 0x7F, (16, 16), dtype=np.uint8))
    for s in (3.5, 2.0 ** 127 * 1.5, 3e38):
        st.fwd.scale[0] = s
        t = q.input.wrap(codes)
        st.fwd.scale[0] = 1.0
        assert t.scale_inv.get().tobytes() == (np.float32(1) / np.array([s], np.float32)
                                               ).tobytes()


def test_update_copies_its_pointer_table_once(rng, monkeypatch):
    """After the first step the update launches with the device table it made then (no
    host-to-device copy per call: issue 21), and stays exact against the reference."""
    import cupy
    from tecupy.kernels import scaling
    monkeypatch.setattr(scaling, "_tables", {})
    metas = [random_meta(cupy, rng, n, 8, E4M3) for n in (3, 9)]
    for step in range(3):
        want = [to_numpy_meta(m) for m in metas]
        ref_update(want, "max", 0)
        backends.dispatch("delayed_scaling_update", metas, "max", 0)
        for m, w in zip(metas, want):
            np.testing.assert_array_equal(m.scale.get(), w.scale)
            np.testing.assert_array_equal(m.amax_history.get(), w.amax_history)
        for m in metas:  # this step's amax
            m.amax_history[0] = cupy.asarray(rng.uniform(0.1, 10, m.scale.size), np.float32)
    assert len(scaling._tables) == 1  # one table, made at the first step


def test_update_after_the_metas_arrays_are_replaced(rng, monkeypatch):
    """The launch plan kept per list of metas (issue 21) is made again when a meta's arrays
    are replaced (a resized history, new scales): the update writes the new arrays, exactly
    as the reference, and leaves the old ones alone."""
    import cupy
    from tecupy.kernels import scaling
    monkeypatch.setattr(scaling, "_plans", {})
    metas = [random_meta(cupy, rng, n, 8, E4M3) for n in (3, 9)]
    backends.dispatch("delayed_scaling_update", metas, "max", 0)
    old = metas[1].amax_history
    for m in metas:  # new history arrays (TE's adjust_amax_history_length)
        m.resize(cupy, 5)
    metas[1].amax_history[0] = cupy.asarray(rng.uniform(0.1, 10, 9), np.float32)
    metas[0].amax_history[0] = cupy.asarray(rng.uniform(0.1, 10, 3), np.float32)
    metas[0].scale = cupy.asarray(rng.uniform(0.5, 2, 3), np.float32)  # a new scale array
    old_copy = old.copy()
    for _ in range(2):  # the same list of metas: planned again, then that plan kept
        want = [to_numpy_meta(m) for m in metas]
        ref_update(want, "max", 0)
        backends.dispatch("delayed_scaling_update", metas, "max", 0)
        for m, w in zip(metas, want):
            for name in ("amax_history", "scale", "scale_inv"):
                np.testing.assert_array_equal(getattr(m, name).get(), getattr(w, name),
                                              err_msg=name)
        for m in metas:  # the next step's amax
            m.amax_history[0] = cupy.asarray(rng.uniform(0.1, 10, m.scale.size), np.float32)
    np.testing.assert_array_equal(old.get(), old_copy.get())
    assert len(scaling._plans) == 1
    assert backends.chosen("delayed_scaling_update", metas, "max", 0) == "cuda"

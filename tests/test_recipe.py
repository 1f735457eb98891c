"""Delayed scaling: the recipe's fields and the update rule of Transformer Engine's fused
kernel (delayed_scaling.cu), checked against hand computations for zero, tiny, normal, inf
and NaN amax, and the history roll."""
import warnings

import numpy as np
import pytest

import tecupy
from tecupy.autocast import FP8State
from tecupy.recipe import DelayedScaling, Float8CurrentScaling, Format
from conftest import asnp

FLT_MAX = np.finfo(np.float32).max


def make_state(xp, recipe, history, scale):
    """A 1-GEMM state whose forward meta has the given history [L, 3] and scales [3]."""
    st = FP8State(1)
    st.bind(xp, recipe)
    st.fwd.amax_history[...] = xp.asarray(np.asarray(history, np.float32))
    st.fwd.scale[...] = xp.asarray(np.asarray(scale, np.float32))
    st.fwd.scale_inv[...] = 1 / st.fwd.scale
    return st


def test_defaults_match_transformer_engine():
    r = DelayedScaling()
    assert (r.margin, r.fp8_format, r.amax_history_len, r.amax_compute_algo) == \
        (0, Format.HYBRID, 1024, "max")
    assert r.scaling_factor_compute_algo is None and r.reduce_amax is True
    assert Format.HYBRID.fwd is tecupy.fp8.E4M3 and Format.HYBRID.bwd is tecupy.fp8.E5M2
    assert (Format.HYBRID.max_fwd, Format.HYBRID.max_bwd) == (448, 57344)
    assert Format.E4M3.bwd is tecupy.fp8.E4M3
    assert Float8CurrentScaling().fp8_format is Format.HYBRID


def test_recipe_validation_and_interval_warning():
    with pytest.warns(DeprecationWarning, match="interval"):
        DelayedScaling(interval=4)
    with pytest.raises(ValueError, match="E5M2"):
        DelayedScaling(fp8_format=Format.E5M2)
    with pytest.raises(ValueError, match="amax_compute_algo"):
        DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="amax_history_len"):
        DelayedScaling(amax_history_len=0)
    with pytest.raises(TypeError, match="Format"):
        DelayedScaling(fp8_format="HYBRID")


def test_update_cases_max(xp):
    """Slots: normal amax, zero amax (nothing changes), tiny amax (scale -> FLT_MAX)."""
    r = DelayedScaling(amax_history_len=4, margin=1)
    hist = [[2.0, 0.0, 1e-37],  # 1e-37: normal in float32 (CuPy flushes denormals)
            [1.0, 7.0, 0.0],
            [8.0, 9.0, 0.0],
            [3.0, 0.0, 0.0]]
    st = make_state(xp, r, hist, [0.5, 0.25, 2.0])
    st.update_forward()
    h, s = asnp(st.fwd.amax_history), asnp(st.fwd.scale)
    # Slot 0: roll by -1, zero row 0: [0, 8, 3, 2]; amax = max(old) = 8;
    # scale = 448 / 8 / 2**1 = 28.
    np.testing.assert_array_equal(h[:, 0], [0, 8, 3, 2])
    assert s[0] == np.float32(448) / np.float32(8) / np.float32(2)
    # Slot 1: this step's amax is 0: history and scale unchanged.
    np.testing.assert_array_equal(h[:, 1], [0, 7, 9, 0])
    assert s[1] == np.float32(0.25)
    # Slot 2: tiny amax: 448/1e-37 overflows -> FLT_MAX.
    np.testing.assert_array_equal(h[:, 2], [0, 0, 0, np.float32(1e-37)])
    assert s[2] == FLT_MAX
    np.testing.assert_array_equal(asnp(st.fwd.scale_inv), (1 / s.astype(np.float32)))


def test_update_inf_and_nan(xp):
    r = DelayedScaling(amax_history_len=3)
    hist = [[np.inf, np.nan, np.nan],
            [1.0, 2.0, 0.0],
            [4.0, 0.0, 0.0]]
    st = make_state(xp, r, hist, [3.0, 3.0, 3.0])
    st.update_forward()
    h, s = asnp(st.fwd.amax_history), asnp(st.fwd.scale)
    # inf: history rolls, amax = inf is not finite -> the old scale stays.
    np.testing.assert_array_equal(h[:, 0], [0, 4, np.inf])
    assert s[0] == 3.0
    # NaN: the kernel's fmaxf ignores NaN, so amax = max(2, 0) = 2 -> scale 224.
    assert h[0, 1] == 0 and h[1, 1] == 0 and np.isnan(h[2, 1])
    assert s[1] == np.float32(224)
    # NaN with an otherwise empty history: amax = 0 -> the old scale stays.
    assert s[2] == 3.0


def test_update_most_recent(xp):
    r = DelayedScaling(amax_history_len=3, amax_compute_algo="most_recent")
    hist = [[2.0, np.nan, 0.5], [100.0, 1.0, 0.0], [50.0, 1.0, 0.0]]
    st = make_state(xp, r, hist, [1.0, 1.0, 1.0])
    st.update_forward()
    s = asnp(st.fwd.scale)
    assert s[0] == np.float32(224) and s[1] == 1.0 and s[2] == np.float32(896)


def test_history_length_one_and_repeated_steps(xp):
    r = DelayedScaling(amax_history_len=1)
    st = make_state(xp, r, [[4.0, 0.0, 0.0]], [1.0, 1.0, 1.0])
    st.update_forward()
    assert asnp(st.fwd.amax_history)[0, 0] == 0 and asnp(st.fwd.scale)[0] == 112
    # Several steps with a longer history: the scale follows the window's max.
    r = DelayedScaling(amax_history_len=2)
    st = make_state(xp, r, np.zeros((2, 3)), [1.0, 1.0, 1.0])
    scales = []
    for a in (8.0, 2.0, 1.0):
        st.fwd.amax_history[0, 0] = a
        st.update_forward()
        scales.append(float(asnp(st.fwd.scale)[0]))
    assert scales == [56.0, 56.0, 224.0]  # max(8) ; max(8, 2) ; max(2, 1)


def test_callable_algorithms(xp):
    seen = {}

    def amax_algo(history):
        seen["shape"] = history.shape
        return history.mean(axis=0)

    def sf_algo(amax, scale, fp8_max, recipe):
        return fp8_max / (2 * amax)
    r = DelayedScaling(amax_history_len=2, amax_compute_algo=amax_algo,
                       scaling_factor_compute_algo=sf_algo)
    st = make_state(xp, r, [[2.0, 4.0, 1.0], [6.0, 4.0, 1.0]], [1.0, 1.0, 1.0])
    st.update_forward()
    assert seen["shape"] == (2, 3)
    np.testing.assert_allclose(asnp(st.fwd.scale), [448 / 8, 448 / 8, 448 / 2])
    np.testing.assert_array_equal(asnp(st.fwd.amax_history), [[0, 0, 0], [2, 4, 1]])


def test_no_warnings_in_update(xp):
    r = DelayedScaling(amax_history_len=2)
    st = make_state(xp, r, [[1e-37, np.inf, np.nan], [0, 0, 0]], [1.0, 1.0, 1.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st.update_forward()

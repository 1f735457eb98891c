"""Delayed scaling: the recipe's fields and the update rule of Transformer Engine's fused
kernel (delayed_scaling.cu), checked against hand computations for zero, tiny, normal, inf
and NaN amax, and the history roll."""
import warnings

import numpy as np
import pytest

import tecupy
from tecupy.fp8_state import FP8State
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


BAD_RECIPES = [  # (kwargs, exception, message): every message names the field and the value
    (dict(margin=float("nan")), ValueError, r"margin must be an int in \[0, 126\], got nan"),
    (dict(margin=float("inf")), ValueError, r"margin must be an int .*got inf"),
    (dict(margin=-1), ValueError, r"margin must be an int in \[0, 126\], got -1"),
    (dict(margin=127), ValueError, r"margin .*got 127"),
    (dict(margin="2"), TypeError, r"margin must be an int .*got '2' \(str\)"),
    (dict(margin=1.5), ValueError, r"margin must be an int .*got 1.5"),
    (dict(margin=True), TypeError, r"margin .*got True \(bool\)"),
    (dict(margin=None), TypeError, r"margin .*got None"),
    (dict(amax_history_len=2.7), ValueError, r"amax_history_len must be an int >= 1, got 2.7"),
    (dict(amax_history_len="16"), TypeError, r"amax_history_len .*got '16' \(str\)"),
    (dict(amax_history_len=True), TypeError, r"amax_history_len .*got True \(bool\)"),
    (dict(amax_history_len=-4), ValueError, r"amax_history_len must be an int >= 1, got -4"),
    (dict(amax_history_len=np.nan), ValueError, r"amax_history_len .*got nan"),
    (dict(reduce_amax="false"), TypeError, r"reduce_amax must be True or False, got 'false'"),
    (dict(reduce_amax=2), TypeError, r"reduce_amax must be True or False, got 2"),
    (dict(fp8_dpa="yes"), TypeError, r"fp8_dpa must be True or False"),
    (dict(fp8_mha=None), TypeError, r"fp8_mha must be True or False, got None"),
    (dict(amax_compute_algo=["max"]), ValueError, r"amax_compute_algo .*got \['max'\]"),
    (dict(scaling_factor_compute_algo="max"), TypeError, "scaling_factor_compute_algo must be"),
    (dict(fp8_format=Format.E5M2), ValueError, "pure E5M2 training is not supported"),
]


@pytest.mark.parametrize("kwargs, exc, msg", BAD_RECIPES,
                         ids=[next(iter(k)) + "=" + repr(next(iter(k.values())))
                              for k, _, _ in BAD_RECIPES])
def test_bad_recipe_arguments_are_clear_errors(kwargs, exc, msg):
    """Checked when the recipe is made. Transformer Engine types these fields through a
    pydantic dataclass (transformer_engine/common/recipe/__init__.py: margin: int,
    amax_history_len: int, reduce_amax: bool, and `assert fp8_format != Format.E5M2`), which
    rejects nan, inf and 1.5 but coerces "2" -> 2, True -> 1 and "false" -> False; tecupy
    refuses those too, and a negative margin or history length."""
    with pytest.raises(exc, match=msg):
        DelayedScaling(**kwargs)


def test_accepted_recipe_arguments_are_normalised():
    """What TE's pydantic int and bool accept beyond plain values: integral floats, numpy
    integers, 0/1 for bools."""
    r = DelayedScaling(margin=2.0, amax_history_len=np.int64(16), reduce_amax=0, fp8_dpa=np.True_)
    assert (r.margin, r.amax_history_len, r.reduce_amax, r.fp8_dpa) == (2, 16, False, True)
    assert type(r.margin) is int and type(r.amax_history_len) is int
    assert DelayedScaling(margin=126).margin == 126


def test_float8_current_scaling_rejects_e5m2():
    """TE: Float8CurrentScaling.__post_init__ asserts fp8_format != Format.E5M2
    (transformer_engine/common/recipe/__init__.py)."""
    with pytest.raises(ValueError, match="Float8CurrentScaling: fp8_format=Format.E5M2"):
        Float8CurrentScaling(fp8_format=Format.E5M2)
    with pytest.raises(TypeError, match="Float8CurrentScaling: fp8_format must be"):
        Float8CurrentScaling(fp8_format="E4M3")
    assert Float8CurrentScaling(Format.E4M3).fp8_format is Format.E4M3


def test_assigning_a_bad_field_later_is_refused_and_changes_nothing(xp):
    """A field set after construction is checked too, so the update at autocast exit can
    never meet a bad value halfway (the issue: a string margin failed after the history had
    rolled, before the scale changed)."""
    r = DelayedScaling(amax_history_len=2, margin=1)
    with pytest.raises(TypeError, match="margin"):
        r.margin = "1"
    with pytest.raises(ValueError, match="E5M2"):
        r.fp8_format = Format.E5M2
    assert r.margin == 1 and r.fp8_format is Format.HYBRID
    r.margin = 3.0
    assert r.margin == 3 and type(r.margin) is int


def test_failing_callable_leaves_the_state_unchanged(xp):
    """The unfused update (callables) computes amax and scale before it writes anything:
    a callable that raises, or returns the wrong shape, leaves history and scale alone."""
    hist = [[2.0, 1.0, 4.0], [1.0, 7.0, 0.0]]

    def bad_sf(amax, scale, fp8_max, recipe):
        scale[...] = 123  # even writing into what it was given changes nothing
        raise RuntimeError("boom")
    for kw, exc in ((dict(scaling_factor_compute_algo=bad_sf), RuntimeError),
                    (dict(amax_compute_algo=lambda h: h.max()), ValueError)):
        st = make_state(xp, DelayedScaling(amax_history_len=2, **kw), hist, [1.0, 2.0, 3.0])
        with pytest.raises(exc):
            st.update_forward()
        np.testing.assert_array_equal(asnp(st.fwd.amax_history), hist)
        np.testing.assert_array_equal(asnp(st.fwd.scale), [1.0, 2.0, 3.0])


@pytest.mark.parametrize("custom", [False, True], ids=["fused", "unfused"])
def test_margin_scale_is_scaled_max_over_amax(xp, custom):
    """TE's fused update computes scale = scaled_max / amax with scaled_max = fp8_max *
    2^-margin (transformer_engine/common/recipe/delayed_scaling.cu): at margin 1 an amax
    where 448 / amax overflows float32 still gives the finite (448 * 0.5) / amax, not
    FLT_MAX. TE's unfused Python path (pytorch/quantization.py, _default_sf_compute, taken
    for callables) still computes (fp8_max / amax) / 2**margin; tecupy uses the fused
    kernel's formula on both paths, so a scale never depends on whether the algorithm is a
    callable."""
    tiny = np.float32(1e-36)  # 448 / 1e-36 = 4.5e38 > FLT_MAX; 224 / 1e-36 = 2.2e38
    kw = dict(amax_compute_algo=lambda h: h.max(axis=0)) if custom else {}
    r = DelayedScaling(amax_history_len=2, margin=1, **kw)
    st = make_state(xp, r, [[tiny, 8.0, np.float32(7e-37)], [0, 0, 0]], [1.0, 1.0, 1.0])
    st.update_forward()
    s = asnp(st.fwd.scale)
    want = (np.float32(448) * np.float32(0.5)) / np.array([tiny, 8.0, 7e-37], np.float32)
    assert np.all(np.isfinite(s)) and np.all(s < FLT_MAX)
    np.testing.assert_array_equal(s, want.astype(np.float32))
    np.testing.assert_array_equal(asnp(st.fwd.scale_inv), np.float32(1) / s)


def test_margin_scale_over_the_whole_overflow_range():
    """Every float32 amax where fp8_max / amax overflows but (fp8_max / 2) / amax does not
    (the issue counts 8,388,607 of them for E4M3 at margin 1): a sample of 4096 across the
    range, all finite and equal to TE's formula."""
    lo, hi = np.float32(224) / np.float32(FLT_MAX), np.float32(448) / np.float32(FLT_MAX)
    amax = np.linspace(lo, hi, 4096, dtype=np.float32)[1:-1]
    r = DelayedScaling(amax_history_len=1, margin=1)
    st = FP8State(len(amax) // 3 + 1)
    st.bind(np, r)
    st.fwd.amax_history[0, :len(amax)] = amax
    st.update_forward()
    s = st.fwd.scale[:len(amax)]
    with np.errstate(over="ignore"):
        assert np.all(np.isinf(np.float32(448) / amax))  # the old formula's overflow
    np.testing.assert_array_equal(s, np.float32(224) / amax)


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

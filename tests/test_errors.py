"""Errors and guards beyond the bad-input table (tests/test_bad_inputs.py): mixed devices,
FP8 state bound to one device, and what an out-of-range target or seed does where it
cannot be checked on the host."""
import numpy as np
import pytest

import tecupy
from tecupy import backends
from tecupy.reference.dropout import uniform

from conftest import asnp


def f32(*shape):
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


@pytest.mark.gpu
def test_mixed_numpy_and_cupy_is_an_error():
    import cupy
    with pytest.raises(TypeError, match="x is a numpy array but weight is a cupy array"):
        tecupy.linear(f32(4, 8), cupy.asarray(f32(3, 8)))


def test_fp8_state_cannot_change_device():
    st = tecupy.FP8State()
    st.bind(np, tecupy.recipe.DelayedScaling())

    class FakeXP:  # another array module
        pass
    with pytest.raises(TypeError, match="one device"):
        st.bind(FakeXP, tecupy.recipe.DelayedScaling())
    with pytest.raises(IndexError, match="1 GEMMs"):
        st.quantize_fwd(f32(16, 16), 1, "input")


def test_cross_entropy_bad_target_gives_nan_not_another_token(xp):
    """The reference (the implementation on CuPy too) never wraps a target around: a token
    whose target is out of range gets a NaN loss and a NaN gradient row; the others are
    exact. (ops.cross_entropy raises on NumPy before it gets here.)"""
    logits = xp.asarray(f32(4, 6))
    bad = xp.asarray(np.array([0, -5, 6, -100]))
    good = xp.asarray(np.array([0, 1, 1, -100]))
    loss, lse = backends.dispatch("cross_entropy_fwd", logits, bad, -100, 0.0)
    want, _ = backends.dispatch("cross_entropy_fwd", logits, good, -100, 0.0)
    loss, want = asnp(loss), asnp(want)
    assert np.isnan(loss[1]) and np.isnan(loss[2])
    np.testing.assert_array_equal(loss[[0, 3]], want[[0, 3]])
    g = asnp(backends.dispatch("cross_entropy_bwd", xp.ones(4, np.float32), logits, bad, lse,
                               -100, 0.0))
    assert np.all(np.isnan(g[1:3])) and np.all(np.isfinite(g[[0, 3]]))


@pytest.mark.gpu
def test_cross_entropy_on_cupy_bad_target_is_nan_without_a_sync():
    import cupy
    logits = cupy.asarray(f32(4, 6))
    loss = tecupy.cross_entropy(logits, cupy.asarray(np.array([0, 1, -5, 2])))
    assert np.isnan(float(loss))


def test_dropout_seed_range_edges(xp):
    x = xp.asarray(f32(64))
    top = asnp(tecupy.dropout(x, 0.5, seed=2**64 - 1, offset=2**64 - 1))
    assert 0 < np.mean(top == 0) < 1
    with pytest.raises(ValueError, match=r"seed and offset must be ints in \[0, 2\*\*64\)"):
        uniform(xp, 8, seed=2**64, offset=0)  # the reference refuses what would wrap
    with pytest.raises(ValueError, match="seed and offset"):
        uniform(xp, 8, seed=1, offset=-1)


def test_softmax_bool_mask_is_masked_out(xp):
    x = xp.asarray(f32(3, 5))
    mask = np.zeros((1, 5), bool)
    mask[0, 1] = True
    y = asnp(tecupy.softmax(x, mask=xp.asarray(mask)))
    assert np.all(y[:, 1] == 0)
    np.testing.assert_allclose(y.sum(-1), 1, rtol=1e-6)

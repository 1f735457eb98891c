"""Philox4x32-10 against Random123's known-answer vectors, and dropout's statistics."""
import numpy as np

import tecupy
from tecupy.reference.dropout import philox4x32, uniform
from conftest import asnp


def test_philox_known_answers(xp):
    # Random123 kat_vectors: philox4x32 10 rounds.
    c = xp.asarray(np.array([0], np.uint64))
    out = [int(asnp(w)[0]) for w in philox4x32(xp, c, 0, 0)]
    assert out == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    c = xp.asarray(np.array([0xFFFFFFFFFFFFFFFF], np.uint64))
    out = [int(asnp(w)[0]) for w in philox4x32(xp, c, 0xFFFFFFFFFFFFFFFF, 0xFFFFFFFFFFFFFFFF)]
    assert out == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def test_dropout_reproducible_and_unbiased(xp, rng):
    x = xp.asarray(rng.standard_normal((101, 203)).astype(np.float32) + 3)
    y1 = asnp(tecupy.dropout(x, 0.3, seed=123))
    y2 = asnp(tecupy.dropout(x, 0.3, seed=123))
    y3 = asnp(tecupy.dropout(x, 0.3, seed=124))
    np.testing.assert_array_equal(y1, y2)
    assert np.any(y1 != y3)
    kept = y1 != 0
    assert abs(kept.mean() - 0.7) < 0.01
    np.testing.assert_allclose(y1[kept], asnp(x)[kept] / 0.7, rtol=1e-6)
    assert tecupy.dropout(x, 0.3, training=False) is x
    assert np.all(asnp(tecupy.dropout(x, 1.0, seed=1)) == 0)


def test_uniform_range_and_offset(xp):
    u = asnp(uniform(xp, 10001, seed=7, offset=0))
    v = asnp(uniform(xp, 10001, seed=7, offset=1))
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.01
    assert np.mean(u == v) < 0.01


def test_dropout_residual_and_gradients(xp, rng):
    x = xp.asarray(rng.standard_normal((7, 13)))
    r = xp.asarray(rng.standard_normal((7, 13)))
    dy = xp.asarray(rng.standard_normal((7, 13)))
    with tecupy.Tape() as tape:
        y = tecupy.dropout(x, 0.4, seed=9, residual=r)
    dx, dr = tape.gradient(y, [x, r], output_grad=dy)
    plain = asnp(tecupy.dropout(x, 0.4, seed=9))
    np.testing.assert_allclose(asnp(y), plain + asnp(r), rtol=1e-12)
    np.testing.assert_allclose(asnp(dx), (plain != 0) * asnp(dy) / 0.6, rtol=1e-12)
    np.testing.assert_array_equal(asnp(dr), asnp(dy))
    assert np.all(asnp(tecupy.dropout(x, 0.4, training=False, residual=r)) == asnp(x + r))


def test_dropout_residual_shape_must_match(rng):
    import pytest
    with pytest.raises(ValueError, match="residual has shape"):
        tecupy.dropout(np.ones((2, 3)), 0.1, residual=np.ones(3))

"""activation(x, name, bias): the bias is added in the same pass; its gradient is the
row-sum of the input gradient; an FP8 output is the cast of the same values."""
import numpy as np
import pytest

import tecupy
from tecupy import backends
from tecupy.activation_table import TABLE
from tecupy.fp8 import E4M3
from conftest import asnp


@pytest.mark.parametrize("name", list(TABLE))
def test_bias_matches_add_then_activation(xp, rng, name):
    x = xp.asarray(rng.standard_normal((3, 5, 8)) + 0.05)
    b = xp.asarray(rng.standard_normal(8))
    dy_shape = (3, 5, 4) if TABLE[name].gated else (3, 5, 8)
    dy = xp.asarray(rng.standard_normal(dy_shape))
    with tecupy.Tape() as tape:
        y = tecupy.activation(x, name, bias=b)
    dx, db = tape.gradient(y, [x, b], output_grad=dy)
    with tecupy.Tape() as tape:
        y2 = tecupy.activation(tecupy.add(x, b), name)
    dx2, db2 = tape.gradient(y2, [x, b], output_grad=dy)
    for a, c in ((y, y2), (dx, dx2), (db, db2)):
        np.testing.assert_allclose(asnp(a), asnp(c), rtol=1e-12, atol=1e-12)


def test_fp8_output_is_the_cast_of_the_output(rng):
    x = rng.standard_normal((16, 32)).astype(np.float32)
    b = rng.standard_normal(32).astype(np.float32)
    scale = np.array([3.0], np.float32)
    q, amax = backends.dispatch("gelu_fwd", x, b, scale, E4M3)
    y = backends.dispatch("gelu_fwd", x, b)
    want = tecupy.quantize(y, scale, E4M3)
    np.testing.assert_array_equal(q, want.data)
    assert amax[0] == np.abs(y).max()


def test_bias_shape_is_checked():
    with pytest.raises(ValueError, match=r"bias has shape \(3,\), expected \(8\)"):
        tecupy.activation(np.ones((2, 8)), "gelu", bias=np.ones(3))

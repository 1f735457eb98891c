"""CUDA dropout (+ residual): the same mask and values as the reference, bit for bit."""
import numpy as np
import pytest

import tecupy
from tecupy import backends
from conftest import asnp, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(1,), (3, 5), (1001, 77), (64, 4096)], ids=str)
@pytest.mark.parametrize("residual", [False, True])
def test_dropout_matches_reference(rng, dtype, shape, residual):
    x = rng.standard_normal(shape).astype(dtype)
    r = rng.standard_normal(shape).astype(dtype) if residual else None
    p, seed, offset = float(rng.uniform(0.05, 0.9)), int(rng.integers(0, 2**63)), 3
    y, keep = run("dropout_fwd", [x, p, seed, offset, r], True)
    y_ref, keep_ref = run("dropout_fwd", [x, p, seed, offset, r], False)
    np.testing.assert_array_equal(keep.get(), keep_ref)
    np.testing.assert_array_equal(y.get().astype(np.float32), y_ref.astype(np.float32))
    dy = rng.standard_normal(shape).astype(dtype)
    dx = run("dropout_bwd", [dy, keep_ref, p], True)
    np.testing.assert_array_equal(dx.get().astype(np.float32),
                                  run("dropout_bwd", [dy, keep_ref, p], False).astype(np.float32))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("shape", [(7,), (4099, 33), (64, 4096)])
def test_add_matches_reference(rng, dtype, shape):
    """The plain add (residual with no dropout, the tape's sum of gradients): the float32
    sum rounded once, bit for bit as the reference."""
    a = (rng.standard_normal(shape) * 3).astype(dtype)
    b = (rng.standard_normal(shape) * 3).astype(dtype)
    got = run("add_fwd", [a, b], on_gpu=True)
    want = backends.dispatch("add_fwd", a, b)
    np.testing.assert_array_equal(asnp(got).view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("shapes", [((4099, 33), (33,)), ((3, 5, 64), (1, 1, 64)),
                                    ((2, 7, 4096), (4096,)), ((8, 6), (1, 6))], ids=str)
def test_add_of_a_row_matches_reference(rng, dtype, shapes):
    """b a row broadcast over a's rows (a bias added after a tensor-parallel reduction): the
    cuda add (no float32 copies), bit for bit as the reference; through the op, b's
    gradient is the float32 column sums of dy rounded once, on the GPU as on the CPU."""
    import cupy
    a = (rng.standard_normal(shapes[0]) * 3).astype(dtype)
    b = (rng.standard_normal(shapes[1]) * 3).astype(dtype)
    got = run("add_fwd", [a, b], on_gpu=True)
    want = backends.dispatch("add_fwd", a, b)
    np.testing.assert_array_equal(asnp(got).view(np.uint8), want.view(np.uint8))
    r = (rng.standard_normal(shapes[0]) * 3).astype(dtype)  # add_bias's pass: + residual
    got = run("add_fwd", [a, b, r], on_gpu=True)
    want = backends.dispatch("add_fwd", backends.dispatch("add_fwd", a, b), r)
    np.testing.assert_array_equal(asnp(got).view(np.uint8), want.view(np.uint8))
    dy = rng.standard_normal(shapes[0]).astype(dtype)
    grads = []
    for xp in (np, cupy):
        ax, bx = xp.asarray(a), xp.asarray(b)
        with tecupy.Tape() as tape:
            y = tecupy.add(ax, bx)
        grads.append(tape.gradient(y, [ax, bx], output_grad=xp.asarray(dy)))
    want_db = dy.astype(np.float32).reshape(-1, b.size).sum(0, dtype=np.float64)
    for ga, gb in grads:
        np.testing.assert_array_equal(asnp(ga).view(np.uint8), dy.view(np.uint8))
        assert gb.shape == b.shape and gb.dtype == b.dtype
        np.testing.assert_allclose(asnp(gb).astype(np.float64).ravel(), want_db,
                                   rtol=2 ** -7, atol=1e-4 * np.sqrt(dy.size // b.size))

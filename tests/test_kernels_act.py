"""CUDA activations (plain and gated, with and without bias, FP8 output), forward and
backward, against the float64 reference."""
import ml_dtypes
import numpy as np
import pytest

import tecupy
from tecupy.activation_table import TABLE
from tecupy.fp8 import E4M3
from conftest import asnp, assert_within_2x_reference, f64, fp8_step, run

pytestmark = pytest.mark.gpu
NAMES = list(TABLE)
DTYPES = [np.float32, np.float16, tecupy.bfloat16]


def inputs(rng, name, dtype, shape, with_bias):
    x = (rng.standard_normal(shape) * 3).astype(dtype)
    gated = TABLE[name].gated
    out_shape = shape[:-1] + (shape[-1] // 2,) if gated else shape
    bias = rng.standard_normal(shape[-1]).astype(dtype) if with_bias else None
    return x, bias, rng.standard_normal(out_shape).astype(dtype)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(1, 2), (37, 1002), (257, 4096), (3, 5, 7, 18)], ids=str)
@pytest.mark.parametrize("with_bias", [False, True], ids=["", "bias"])
def test_activation(rng, name, dtype, shape, with_bias):
    x, bias, dy = inputs(rng, name, dtype, shape, with_bias)
    # plus one unit of the dtype's rounding: with a handful of elements the low-precision
    # reference can be exact by luck while float32 tanhf and NumPy's tanh round apart. That
    # unit is of the inputs' size, not the output's: far left of 0, gelu(x) = x (1 + t) / 2
    # is tiny while tanhf's error in t (an ulp of 1) times x is not, and a gated
    # activation multiplies it by the other half (a (1, 2) input is one such element)
    ulp = float(ml_dtypes.finfo(dtype).eps)
    got = run(f"{name}_fwd", [x, bias], True)
    want = run(f"{name}_fwd", f64([x, bias]), False)
    size = float(np.abs(asnp(x).astype(np.float64)).max()) + (
        0.0 if bias is None else float(np.abs(asnp(bias).astype(np.float64)).max()))
    size = size ** (2 if TABLE[name].gated else 1)
    atol = ulp * max(1.0, size / max(float(np.abs(want).max()), 1e-30))
    assert_within_2x_reference(got, want, run(f"{name}_fwd", [x, bias], False), f"{name} fwd",
                               atol=atol)
    dx, db = run(f"{name}_bwd", [dy, x, bias], True)
    want = run(f"{name}_bwd", f64([dy, x, bias]), False)
    lp = run(f"{name}_bwd", [dy, x, bias], False)
    assert_within_2x_reference(dx, want[0], lp[0], f"{name} bwd", atol=max(ulp, 1e-5))
    if with_bias:  # summed from the rounded dx: the dtype's own tolerance, the float16
        # rounding of dx elements below its smallest subnormal to 0, and twice the error of
        # the reference in the same precision (gelu's 1 + tanh cancels to 0 in float32 far
        # left of 0, where float64 still has ~1e-10: both elements of a (1, 2) row can be
        # there)
        tol = {np.dtype(np.float32): 1e-5}.get(np.dtype(dtype), 1.6e-2)
        tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal) * (x.size // x.shape[-1])
        lp_err = np.abs(asnp(lp[1]).astype(np.float64) - want[1]).max()
        np.testing.assert_allclose(asnp(db).astype(np.float64), want[1], rtol=tol,
                                   atol=tol * np.abs(want[1]).max() + tiny + 2 * lp_err)
    else:
        assert db is None


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(129, 1024), (37, 1002)], ids=str)  # 1002: scalar path
def test_activation_fp8_output(rng, name, dtype, shape):
    x, bias, _ = inputs(rng, name, dtype, shape, True)
    scale = np.array([rng.uniform(1, 20)], np.float32)
    q, amax = run(f"{name}_fwd", [x, bias, scale, E4M3], True)
    q_ref, amax_ref = run(f"{name}_fwd", [x, bias, scale, E4M3], False)
    table = np.arange(256, dtype=np.uint8).view(E4M3.ml_dtype).astype(np.float32)
    g, w = table[asnp(q)], table[asnp(q_ref)]
    differ = g != w  # float32 activations may land on either side of a rounding boundary
    assert differ.mean() < 0.01
    assert np.all(np.abs(g - w)[differ] <= fp8_step(w, E4M3)[differ])
    np.testing.assert_allclose(asnp(amax), amax_ref, rtol=1e-5)


def test_bias_view_off_16_byte_alignment(rng):
    """A bias that is a view 2 bytes into its buffer (the kernels load bias by 16-byte
    vectors): same results as an aligned copy."""
    import cupy
    bf16 = tecupy.bfloat16
    x = cupy.asarray(rng.standard_normal((33, 2048)).astype(np.float32)).astype(bf16)
    big = cupy.asarray(rng.standard_normal(2049).astype(np.float32)).astype(bf16)
    view, copy = big[1:], big[1:].copy()
    assert view.data.ptr % 16 != 0 and copy.data.ptr % 16 == 0
    d = tecupy.backends.dispatch
    for op, args in (("gelu_fwd", (x,)), ("gelu_bwd", (x, x)), ("geglu_fwd", (x,)),
                     ("geglu_bwd", (x[:, :1024], x))):
        assert tecupy.backends.chosen(op, *args, view) == "cuda"
        got, want = d(op, *args, view), d(op, *args, copy)
        for g, w in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,)):
            assert (asnp(g) == asnp(w)).all(), op


@pytest.mark.parametrize("name", [n for n in NAMES if not TABLE[n].gated])
@pytest.mark.parametrize("dtype", [np.float32, tecupy.bfloat16], ids=lambda d: np.dtype(d).name)
def test_backward_in_place(rng, name, dtype):
    """out=dy (layernorm_mlp's FP8 backward writes dh over da): bit-identical to a new
    array, dbias too, and dy's buffer holds dx."""
    import cupy
    from tecupy import backends
    x, bias, dy = inputs(rng, name, dtype, (257, 1000), True)
    want_dx, want_db = run(f"{name}_bwd", [dy, x, bias], True)
    g = cupy.asarray(dy)
    dx, db = backends.dispatch(f"{name}_bwd", g, cupy.asarray(x), cupy.asarray(bias), out=g)
    assert dx is g
    np.testing.assert_array_equal(asnp(dx), asnp(want_dx))
    np.testing.assert_array_equal(asnp(db), asnp(want_db))

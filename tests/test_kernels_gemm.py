"""cuBLAS high-precision GEMM (the `cuda` gemm) against the float64 reference, within
Transformer Engine's per-dtype tolerances (cuBLAS rounds the product, then the bias is added)."""
import numpy as np
import pytest

import tecupy
from conftest import asnp, f64, run

pytestmark = pytest.mark.gpu
TOL = {np.dtype(np.float32): (1.3e-6, 1e-5), np.dtype(np.float16): (1e-3, 1e-5),
       tecupy.bfloat16: (1.6e-2, 1e-5)}


@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("trans_b", [True, False])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm(rng, dtype, trans_b, with_bias):
    m, k, n = 67, 129, 45
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype) if with_bias else None
    got = run("gemm", [a, b, np.dtype(dtype), bias, trans_b], True)
    want = run("gemm", f64([a, b]) + [np.dtype(np.float64), f64([bias])[0], trans_b], False)
    rtol, atol = TOL[np.dtype(dtype)]
    scale = np.sqrt(k)  # the outputs' magnitude: relative tolerance on that scale
    np.testing.assert_allclose(asnp(got).astype(np.float64) / scale, want / scale,
                               rtol=rtol, atol=max(atol, rtol))


@pytest.mark.parametrize("layout", ["a.T", "b.T", "strided", "k=0", "m=0"])
def test_gemm_layouts(rng, layout):
    """cuBLAS is called directly (kernels/gemm.py): transposed views (dw = dy.T @ x reads
    dy.T in place), sliced operands (copied) and empty sizes against the reference."""
    import cupy
    m, k, n = 40, 72, 24
    if layout == "k=0":
        k = 0
    if layout == "m=0":
        m = 0
    dt = tecupy.bfloat16
    a = rng.standard_normal((k, m) if layout == "a.T" else (m, 2 * k)).astype(dt)
    b = rng.standard_normal((k, n) if layout == "b.T" else (n, k)).astype(dt)
    a_host = a.T if layout == "a.T" else a[:, ::2]
    b_host = b.T if layout == "b.T" else b
    got = run("gemm", [cupy.asarray(a).T if layout == "a.T" else cupy.asarray(a)[:, ::2],
                       cupy.asarray(b).T if layout == "b.T" else cupy.asarray(b), np.dtype(dt),
                       None, True], True)
    want = a_host.astype(np.float64) @ b_host.astype(np.float64).T
    assert got.shape == want.shape
    np.testing.assert_allclose(asnp(got).astype(np.float64) / np.sqrt(max(k, 1)),
                               want / np.sqrt(max(k, 1)), rtol=1.6e-2, atol=1.6e-2)

"""The small kernels around the FP8 linear: the transpose of FP8 codes (wgrad's column-wise
copy when the fused norm or activation made the FP8 tensor) and the bias gradient (float32
column sums of dy, without a float32 copy of dy)."""
import numpy as np
import pytest

import tecupy
from tecupy import backends
from tecupy.fp8 import E4M3, FP8Tensor
from conftest import asnp, run

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape", [(16, 16), (48, 80), (1040, 2064), (4096, 208)])
def test_fp8_transpose_matches_reference(rng, shape):
    data = rng.integers(0, 256, shape, dtype=np.uint8)
    got = run("fp8_transpose", [data], on_gpu=True)
    np.testing.assert_array_equal(asnp(got), data.T)
    # the FP8Tensor's column-wise copy goes through it
    import cupy
    t = FP8Tensor(cupy.asarray(data), E4M3, cupy.ones(1, np.float32))
    np.testing.assert_array_equal(asnp(t.T.data), data.T)


def test_fp8_transpose_declines_what_it_cannot_do():
    import cupy
    for bad in (cupy.zeros((40, 24), np.uint8), cupy.zeros((32, 32), np.int8),
                cupy.zeros(32, np.uint8)):
        assert backends.chosen("fp8_transpose", bad) != "cuda"
    np.testing.assert_array_equal(asnp(backends.dispatch("fp8_transpose", cupy.arange(
        40 * 24, dtype=np.uint8).reshape(40, 24))), np.arange(40 * 24, dtype=np.uint8)
        .reshape(40, 24).T)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("shape", [(1, 8), (300, 33), (4099, 1000)])
def test_bias_grad_matches_float64(rng, dtype, shape):
    dy = (rng.standard_normal(shape) * 4).astype(dtype)
    got = asnp(run("bias_grad", [dy, dtype], on_gpu=True))
    want = dy.astype(np.float64).sum(0)
    ref = asnp(backends.dispatch("bias_grad", dy, dtype))  # float32 sums, same rounding
    assert got.dtype == np.dtype(dtype) and got.shape == (shape[1],)
    err = np.abs(got.astype(np.float64) - want).max()
    err_ref = np.abs(ref.astype(np.float64) - want).max()
    # one unit of the output dtype's rounding (float32 sums in another order may round the
    # other way)
    eps = {np.dtype(np.float32): 1e-6, np.dtype(np.float16): 2.0 ** -10}.get(
        np.dtype(dtype), 2.0 ** -7)
    ulp = np.abs(want).max() * eps
    assert err <= 2 * err_ref + ulp, (err, err_ref)

"""CUDA column sums (cuda/colsum.cu through kernels/colsum.py), the dbias of linear, of the
activations and of cast_transpose_dbias, over split counts from 1 to the cap of 64 with
rows that do not divide evenly. bias_grad against float64 on random data:
test_kernels_linear_glue.py."""
import numpy as np
import pytest

import tecupy
from conftest import asnp

pytestmark = pytest.mark.gpu


# small integers: every float32 partial and total is exact, so any row missed or counted
# twice shows (sums stay below 2^24; bfloat16 holds integers up to 256 exactly)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("shape", [(1, 3), (255, 40), (779, 65), (64 * 256 + 301, 33)],
                         ids=str)
def test_dbias_is_exact_on_integers(rng, dtype, shape):
    import cupy
    from tecupy.kernels import colsum
    x = rng.integers(-8, 9, shape).astype(dtype)
    got = asnp(colsum.dbias(cupy.asarray(x)))
    assert got.dtype == np.float32 and got.shape == (shape[1],)
    np.testing.assert_array_equal(got, x.astype(np.float64).sum(0))


def test_col_sum_of_partials_is_exact_on_integers(rng):
    import cupy
    from tecupy.kernels import colsum
    part = rng.integers(-1000, 1000, (37, 70)).astype(np.float32)
    got = asnp(colsum.col_sum(cupy.asarray(part)))
    np.testing.assert_array_equal(got, part.sum(0))

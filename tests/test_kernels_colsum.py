"""CUDA column sums (cuda/colsum.cu through kernels/colsum.py), the dbias of linear, of the
activations and of cast_transpose_dbias, over split counts from 1 to the cap of 64 with
rows that do not divide evenly. bias_grad against float64 on random data:
test_kernels_linear_glue.py."""
import numpy as np
import pytest

import tecupy
from conftest import asnp, poison_gpu_pool, same_bits

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


# The second stage writes dbias in its own type: the float32 sums rounded once, to nearest
# even. On multiples of 1/8 every float32 partial and total is exact (below 2^21 in eighths),
# so the float64 sums rounded to the type are the answer, bit for bit: the sums of 37 rows
# of up to 6000 pass bf16's and half's integers (rounding, ties) and some half's largest
# (inf, as astype gives).
OUT_DTYPES = [np.float32, np.float64, np.float16, tecupy.bfloat16]


def _eighths(rng, shape, top):
    """float32 multiples of 1/8 in [-top, top]."""
    return (rng.integers(-8 * top, 8 * top + 1, shape) / 8).astype(np.float32)


def _rounded_sums(x, out_dtype):
    """The float64 column sums of x rounded to out_dtype (inf past half's largest)."""
    with np.errstate(over="ignore"):
        return x.astype(np.float64).sum(0).astype(out_dtype)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: np.dtype(d).name)
def test_col_sum_writes_the_rounded_sums_in_its_type(rng, out_dtype):
    import cupy
    from tecupy.kernels import colsum
    part = _eighths(rng, (37, 4099), 6000)
    poison_gpu_pool()
    got = colsum.col_sum(cupy.asarray(part), np.dtype(out_dtype))
    same_bits(got, _rounded_sums(part, out_dtype), "col_sum")


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16],
                         ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(37, 4099), (64 * 256 + 301, 33)], ids=str)
def test_dbias_in_its_type_is_the_float32_dbias_rounded(rng, dtype, out_dtype, shape):
    """dbias(x, T) is dbias(x) (float32) then astype(T), bit for bit, on random data; and on
    eighths (exact sums) the float64 sums rounded to T."""
    import cupy
    from tecupy.kernels import colsum
    x = cupy.asarray(rng.standard_normal(shape).astype(dtype))
    poison_gpu_pool()
    same_bits(colsum.dbias(x, np.dtype(out_dtype)), colsum.dbias(x).astype(out_dtype),
              "dbias")
    exact = _eighths(rng, shape, 8).astype(dtype)  # (exact in half and bf16 too)
    poison_gpu_pool()
    same_bits(colsum.dbias(cupy.asarray(exact), np.dtype(out_dtype)),
              _rounded_sums(exact, out_dtype), "dbias of eighths")


@pytest.mark.parametrize("out_dtype", OUT_DTYPES[1:], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("dtype", [np.float32, tecupy.bfloat16], ids=lambda d: np.dtype(d).name)
def test_cast_transpose_dbias_is_the_float32_dbias_rounded(rng, dtype, out_dtype):
    """cast_transpose_dbias's dbias in T is its float32 dbias then astype(T), bit for bit
    (the same partials, the same float32 sums, one rounding), the codes alike."""
    import cupy
    from tecupy.fp8 import E4M3
    x = cupy.asarray((rng.standard_normal((272, 4099)) * 3).astype(dtype))
    scale = cupy.asarray(np.array([0.5], np.float32))
    outs = []
    for dbias_dtype in (np.dtype(np.float32), np.dtype(out_dtype)):
        poison_gpu_pool()
        outs.append(tecupy.backends.dispatch("cast_transpose_dbias", x, scale, E4M3,
                                             dbias_dtype))
    (q32, qt32, _, db32), (q, qt, _, db) = outs
    same_bits(db, db32.astype(out_dtype), "dbias")
    same_bits(q, q32, "q")
    same_bits(qt, qt32, "qt")

"""Shared fixtures: `xp` runs a test on NumPy and (marked gpu) on CuPy; GPU cases skip
cleanly where CuPy sees no CUDA device; `aot` tests run only when selected."""
import contextlib
import importlib

import ml_dtypes
import numpy as np
import pytest

from tecupy._array import gpu_available

HAVE_GPU = gpu_available()


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without a GPU; the ahead-of-time build of every kernel (`aot`, minutes
    of NVRTC) runs only when selected: `python -m pytest -m aot` (CI does)."""
    skip_gpu = pytest.mark.skip(reason="no CUDA device visible to CuPy")
    skip_aot = pytest.mark.skip(reason="compiles every kernel for an arch (minutes); "
                                       "select it with: python -m pytest -m aot")
    aot_selected = "aot" in (config.option.markexpr or "")
    for item in items:
        if "gpu" in item.keywords and not HAVE_GPU:
            item.add_marker(skip_gpu)
        if "aot" in item.keywords and not aot_selected:
            item.add_marker(skip_aot)


@pytest.fixture(params=["numpy", pytest.param("cupy", marks=pytest.mark.gpu)])
def xp(request):
    if request.param == "numpy":
        return np
    import cupy
    return cupy


@pytest.fixture
def rng():
    """Fresh random data on every run (the seed is printed on failure by pytest's repr)."""
    return np.random.default_rng()


def asnp(a):
    from tecupy._array import to_numpy
    return to_numpy(a)


def bf16_array(xp, rng, *shape, scale=1.0):
    """Standard normal values times scale, as a bfloat16 array of xp."""
    from tecupy import bfloat16
    return xp.asarray((rng.standard_normal(shape) * scale).astype(bfloat16))


def same_bits(a, b, what):
    """a and b have the same dtype, shape and bytes."""
    a, b = np.ascontiguousarray(asnp(a)), np.ascontiguousarray(asnp(b))
    assert a.dtype == b.dtype and a.shape == b.shape, what
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=what)


@contextlib.contextmanager
def count_dispatches(ops, kwarg=None):
    """{op: calls of backends.dispatch} inside; with kwarg, calls[kwarg] counts the calls
    given that keyword (not None). The FP8 linear's kept plan is off inside: it calls its
    kernels past dispatch after its first call (its own bits: test_launch_kept_plan.py)."""
    from tecupy import backends
    linear_op = importlib.import_module("tecupy.ops.linear")
    calls = {op: 0 for op in ops}
    real, kept = backends.dispatch, linear_op.KEPT
    linear_op.KEPT = False

    def dispatch(op, *args, **kwargs):
        if op in calls:
            calls[op] += 1
        if kwarg is not None and kwargs.get(kwarg) is not None:
            calls[kwarg] = calls.get(kwarg, 0) + 1
        return real(op, *args, **kwargs)
    backends.dispatch = dispatch
    try:
        yield calls
    finally:
        backends.dispatch, linear_op.KEPT = real, kept


def poison_gpu_pool(nbytes=1 << 26):
    """Fill a block of CuPy's memory pool with 0xFF bytes (NaN for floats) and free it, so
    the next allocations reuse poisoned memory: an output element a kernel forgets to write
    then shows up as NaN or 0xFF instead of a lucky zero."""
    import cupy
    buf = cupy.empty(nbytes, np.uint8)
    buf.fill(0xFF)
    del buf


def assert_within_2x_reference(got, want64, ref_lp, name="", atol=1e-6):
    """flash-attention's rule: error against the float64 reference is at most twice the
    error of the reference computed in the same low precision, plus a small atol (scaled by
    the data's magnitude). NaN never passes."""
    got, want64, ref_lp = (asnp(a).astype(np.float64) for a in (got, want64, ref_lp))
    assert got.shape == want64.shape, f"{name}: shape {got.shape} != {want64.shape}"
    assert np.all(np.isfinite(got)), f"{name}: non-finite values in the result"
    scale = max(np.abs(want64).max(), 1e-30)
    err, err_ref = np.abs(got - want64).max(), np.abs(ref_lp - want64).max()
    assert err <= 2 * err_ref + atol * scale, \
        f"{name}: max error {err:.3e} > 2 x reference error {err_ref:.3e} + {atol * scale:.1e}"


def run(op, args, on_gpu):
    """The chosen backend's result on CuPy copies of args, or the reference on NumPy."""
    import os
    from tecupy import backends
    if not on_gpu:
        return backends.dispatch(op, *args)
    import cupy
    gpu_args = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in args]
    assert backends.chosen(op, *gpu_args) == "cuda"
    poison_gpu_pool()
    old = os.environ.get("TECUPY_STRICT")
    os.environ["TECUPY_STRICT"] = "1"  # a failing kernel must fail the test, not fall back
    try:
        return backends.dispatch(op, *gpu_args)
    finally:
        os.environ.pop("TECUPY_STRICT") if old is None else os.environ.update(
            TECUPY_STRICT=old)


def f64(args):
    """float64 copies of the floating arrays (bfloat16's numpy kind is 'V', not 'f')."""
    from tecupy._array import FLOAT_DTYPES
    return [a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype in FLOAT_DTYPES
            else a for a in args]


def fp8_step(values, fmt):
    """The spacing of FP8 values around `values` (the subnormal spacing below the smallest
    normal): two casts of nearly equal floats may differ by one step."""
    v = np.maximum(np.abs(values), 2.0 ** (1 - fmt.bias))
    return 2.0 ** (np.floor(np.log2(v)) - fmt.mbits)


# ---- the FP8 GEMMs' split accumulator (test_kernels_fp8_gemm.py, _fp8_block_gemm.py) -----

SPLIT_ROUNDING = 2.0 ** -11  # four roundings at 2^-13 of a k-block's partial sum
MAX_SHARE = 2e-3  # of the largest |want|: the whole-output check of assert_split_gemm_close


def gemm_absdot(a64, b64):
    """(A B^T, |A| |B|^T) of the dequantized FP8 operands a64 [M, K], b64 [N, K] in float64:
    the product and the sum of its absolute terms (which bounds the rounding of the sum in
    any order and precision)."""
    return a64 @ b64.T, np.abs(a64) @ np.abs(b64).T


def assert_split_gemm_close(got, want, ref_lp, absdot, name, roundings=1, atol=0.0):
    """flash-attention's 2x rule against the float32-accumulating reference ref_lp, element
    by element, plus the split accumulator's share: the tensor cores sum each 128 of K with
    fewer bits than float32 (DeepSeek-V3 sec. 3.3), an error bounded by a constant times the
    sum of the absolute products, absdot = |A| |B|^T (gemm_absdot; the usual bound of a
    sum's rounding). The constant: 2^-11 (four roundings at 2^-13 per k-block); measured at
    most 3.3e-4 over 1000 fresh draws of test_block_gemm's shapes (PERFLOG, session 24). The
    bound used before, 5e-4 of the largest |want| for every element, failed on 1 draw in 50
    of one block case and reached 0.97 of itself in a per-tensor one (K = 256). A wrong
    factor (a block's, a row's, a scale) or a lost k-block still shows: its error is a
    partial sum's size, not 2^-11 of it. Then the output's rounding: half its dtype's epsilon
    of the value, `roundings` times (elementwise, the reference's own rounding can be near
    zero where the kernel's is not). An epilogue that scales the sum (gelu's backward) passes
    absdot times that factor's magnitude; atol (scalar or [M, N]) is any error of its own.
    got is float32, float16 or bfloat16 (an FP8 output's step is not an epsilon)."""
    got = asnp(got)
    half_ulp = float(ml_dtypes.finfo(got.dtype).eps) / 2
    got, ref_lp = got.astype(np.float64), asnp(ref_lp).astype(np.float64)
    assert got.shape == want.shape, f"{name}: shape {got.shape} != {want.shape}"
    assert np.all(np.isfinite(got)), f"{name}: non-finite values (unwritten output?)"
    err, err_ref = np.abs(got - want), np.abs(ref_lp - want)
    split = SPLIT_ROUNDING * absdot
    excess = err - (2 * err_ref + split + roundings * half_ulp * (np.abs(want) + split) + atol)
    i = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[i] <= 0, (f"{name}: error {err[i]:.3e} at {i} vs reference {err_ref[i]:.3e}"
                            f" (|A| |B|^T there {absdot[i]:.3e})")
    # and against the output's largest magnitude: |A| |B|^T grows as K while the real error
    # grows far slower, so at K = 4112 the bound above alone would pass a 1% error in the
    # largest column. MAX_SHARE is 4x the old rule's 5e-4 (whose worst draws reached 0.97 and
    # 1.11 of it): a wide margin, and a 0.2% error at the largest values still fails.
    excess = err - (2 * err_ref + MAX_SHARE * np.abs(want).max()
                    + roundings * half_ulp * np.abs(want) + atol)
    i = np.unravel_index(np.argmax(excess), excess.shape)
    assert excess[i] <= 0, (f"{name}: error {err[i]:.3e} at {i} vs reference {err_ref[i]:.3e}"
                            f" (largest |want| {np.abs(want).max():.3e})")

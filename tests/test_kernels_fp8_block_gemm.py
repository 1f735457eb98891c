"""The block-scaled Hopper FP8 GEMM (fp8_block_gemm_tn in cutlass_templates/fp8_gemm.cu,
launched by kernels/block_scaling.fp8_block_gemm) against the float64 product of the
dequantized block operands: B in 1x128 blocks (wgrad's operands) and 128x128 (the weight),
A in 1x128 (and 128x128, spread by the wrapper), M and N that are not multiples of the
tiles, a K tail past the last 128, bias, every output dtype, both tile configurations,
gelu's backward epilogue, accumulation into float32, and Linear under Float8BlockScaling
running through it; the main cases and both tiles also with fp8_gemm.BLOCK_PIPELINE on (the
pipelined kernel, fp8_block_gemm_pipe_tn, for either B where M % 4 == 0; the others fall
back to fp8_block_gemm_tn). Every kernel call runs under TECUPY_STRICT=1 on a poisoned
pool."""
import numpy as np
import pytest

import tecupy
from tecupy import backends
from tecupy.fp8 import E4M3, E5M2
from tecupy.recipe import Float8BlockScaling
from tecupy.reference.block_scaling import row_scales
from tecupy.reference.fp8 import _decode_table
from conftest import HAVE_GPU, asnp, assert_split_gemm_close, gemm_absdot, poison_gpu_pool

pytestmark = pytest.mark.gpu


def _hopper():
    from tecupy.kernels.fp8_gemm import hopper
    return HAVE_GPU and hopper()


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the FP8 GEMM kernel needs sm_90")
PAIRS = [(E4M3, E4M3), (E5M2, E4M3)]  # the recipe's default; HYBRID's dgrad and wgrad
OUTS = [np.float32, np.float16, tecupy.bfloat16]


def _varied(rng, shape):
    """Normal data whose magnitude changes by up to 2^6 between 128-column blocks, 2^3
    between 128-row blocks and 2^2 between rows (never above 1: the products stay in
    float16's range): a factor of the wrong block or row shows as a large error."""
    r, c = shape
    cols = np.repeat(2.0 ** rng.integers(-6, 1, -(-c // 128)), 128)[:c]
    blocks = np.repeat(2.0 ** rng.integers(-3, 1, -(-r // 128)), 128)[:r, None]
    rows = 2.0 ** rng.integers(-2, 1, (r, 1))
    return (rng.standard_normal(shape) * cols * blocks * rows).astype(np.float32)


def _quantized(rng, shape, fmt, block_dim, p2=True):
    """(codes, scale_inv) of fresh data, by the NumPy reference's block cast."""
    q, s, _, _ = backends.dispatch("block_quantize", _varied(rng, shape), fmt, block_dim, p2,
                                   0.0, False)
    return q, s


def _dequant64(q, fmt, s):
    """decode(q) * its block's scale_inv, in float64 (exact)."""
    f = np.repeat(row_scales(q.shape, s).astype(np.float64), 128, axis=1)[:, :q.shape[1]]
    return _decode_table(np, fmt)[q].astype(np.float64) * f


def _gpu(*arrays):
    import cupy
    return [cupy.asarray(x) if isinstance(x, np.ndarray) else x for x in arrays]


def _strict_kernel(monkeypatch, op_args, **kwargs):
    """The cutlass implementation is the one chosen for these (GPU) arguments; a failure
    raises (TECUPY_STRICT=1) and the pool is poisoned before it runs."""
    assert backends.chosen("fp8_block_gemm", *op_args, **kwargs) == "cutlass"
    monkeypatch.setenv("TECUPY_STRICT", "1")
    poison_gpu_pool()
    return backends.dispatch("fp8_block_gemm", *op_args, **kwargs)


def _absdot(a, fa, sa, b, fb, sb):
    """(A . B^T, |A| . |B|^T) of the dequantized operands, in float64."""
    return gemm_absdot(_dequant64(a, fa, sa), _dequant64(b, fb, sb))


def _run_case(monkeypatch, rng, m, n, k, fa, fb, dim_a, dim_b, out_dtype, bias, p2=True):
    a, sa = _quantized(rng, (m, k), fa, dim_a, p2)
    b, sb = _quantized(rng, (n, k), fb, dim_b, p2)
    bvec = (rng.standard_normal(n) * 3).astype(out_dtype) if bias else None
    args = [a, fa, sa, b, fb, sb, out_dtype, bvec]
    got = _strict_kernel(monkeypatch, _gpu(*args))
    assert got.dtype == np.dtype(out_dtype) and got.shape == (m, n)
    want, absdot = _absdot(a, fa, sa, b, fb, sb)
    if bias:
        want = want + bvec.astype(np.float64)
    ref_lp = backends.dispatch("fp8_block_gemm", *args)  # NumPy: float32 accumulation
    assert_split_gemm_close(got, want, ref_lp, absdot, f"{(m, n, k)} B {dim_b}")


def _pipeline(monkeypatch, on):
    """fp8_gemm.BLOCK_PIPELINE set for this test (the plans' key holds it)."""
    from tecupy.kernels import fp8_gemm
    monkeypatch.setattr(fp8_gemm, "BLOCK_PIPELINE", on)


def _pipelined(m, n, k, dim_b):
    """Whether the last plan made for this shape and B's blocks is the pipelined kernel."""
    from tecupy.kernels import block_scaling
    got = [pipe for key, (_, pipe) in block_scaling._gemm_plans.items()
           if key[:3] == (m, n, k) and key[5] == dim_b]
    assert got, "no plan made"
    return got[-1]


@needs_hopper
@pytest.mark.parametrize("pipe", [False, True], ids=["table_off", "table_on"])
@pytest.mark.parametrize("fa,fb", PAIRS, ids=lambda f: f.name)
@pytest.mark.parametrize("out_dtype", OUTS, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("dim_b", [1, 2], ids=["B1x128", "B128x128"])
@pytest.mark.parametrize("mnk,p2", [((200, 272, 1024), True), ((131, 392, 384), False),
                                    ((16, 32, 128), True), ((520, 1288, 1040), False)],
                         ids=str)
def test_block_gemm(monkeypatch, rng, pipe, fa, fb, out_dtype, bias, dim_b, mnk, p2):
    """M odd or past the tile, N not a multiple of 128 (the tile's last 128x128 block of B
    partly past N), K = 1040: a K block of 16; p2 False: scales that are not powers of 2.
    pipe: fp8_gemm.BLOCK_PIPELINE; it runs the pipelined kernel where M % 4 == 0 (M = 131
    falls back to the other)."""
    _pipeline(monkeypatch, pipe)
    _run_case(monkeypatch, rng, *mnk, fa, fb, 1, dim_b, out_dtype, bias, p2)
    assert _pipelined(*mnk, dim_b) == (pipe and mnk[0] % 4 == 0)


@needs_hopper
@pytest.mark.parametrize("pipe", [False, True], ids=["table_off", "table_on"])
@pytest.mark.parametrize("config", [(192, 4, True, 1), (256, 3, True, 1)], ids=str)
@pytest.mark.parametrize("dim_b", [1, 2], ids=["B1x128", "B128x128"])
def test_block_gemm_each_tile(monkeypatch, rng, pipe, config, dim_b):
    """Both split configurations, forced: 192-wide tiles start 64 columns into a 128x128
    block of B every other tile; many tiles per CTA (M x N of 332 x 776 on a grid of 2 CTAs,
    K 2048: the pipelined kernel's per-tile B tables are rewritten between tiles, its A
    factors clipped at M in the last row block)."""
    from tecupy.kernels import block_scaling, fp8_gemm
    monkeypatch.setattr(fp8_gemm, "default_config", lambda *args, **kwargs: config)
    monkeypatch.setattr(fp8_gemm, "sm_count", lambda: 2)
    monkeypatch.setattr(block_scaling, "_gemm_plans", {})
    _pipeline(monkeypatch, pipe)
    _run_case(monkeypatch, rng, 332, 776, 2048, E4M3, E4M3, 1, dim_b, tecupy.bfloat16, True)
    assert _pipelined(332, 776, 2048, dim_b) == pipe


@needs_hopper
@pytest.mark.parametrize("pipe", [False, True], ids=["table_off", "table_on"])
def test_block_gemm_dgelu_and_many_k_blocks(monkeypatch, rng, pipe):
    """The pipelined kernel under gelu's backward epilogue (bit for bit the other kernel's:
    the same factors, sums and order), and K = 9088 (71 k-blocks: a B-factor table of 213
    entries at BN 192, more than its warpgroup's 128 threads load at once)."""
    m, n, k = 264, 520, 768
    a, sa = _quantized(rng, (m, k), E4M3, 1)
    b, sb = _quantized(rng, (n, k), E4M3, 2)
    aux = rng.standard_normal((m, n)).astype(tecupy.bfloat16)
    bvec = rng.standard_normal(n).astype(tecupy.bfloat16)
    args = _gpu(a, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, bvec)
    _pipeline(monkeypatch, pipe)
    got = asnp(_strict_kernel(monkeypatch, args, dgelu_aux=_gpu(aux)[0])).astype(np.float32)
    _pipeline(monkeypatch, False)
    want = asnp(_strict_kernel(monkeypatch, args, dgelu_aux=_gpu(aux)[0])).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # same sums in the same order: bit for bit
    _pipeline(monkeypatch, pipe)
    _run_case(monkeypatch, rng, 256, 1024, 9088, E4M3, E4M3, 1, 2, np.float32, False)
    assert _pipelined(256, 1024, 9088, 2) == pipe


@needs_hopper
@pytest.mark.parametrize("dims", [(2, 1), (1, 1), (1, 2)], ids=str)
def test_block_gemm_a_blocks(monkeypatch, rng, dims):
    """A in 128x128 blocks (grad_ or x_block_scaling_dim 2): the wrapper spreads its
    factors to every row; 1x128 x 1x128 is wgrad's."""
    _run_case(monkeypatch, rng, 300, 264, 640, E4M3, E4M3, *dims, np.float32, False)


@needs_hopper
def test_block_gemm_dgelu_epilogue(monkeypatch, rng):
    """gelu's backward epilogue (LayerNormMLP's fc2 dgrad): D = T(acc) * gelu'(aux + bias),
    within bfloat16's tolerance of the reference's."""
    m, n, k = 264, 520, 768
    a, sa = _quantized(rng, (m, k), E4M3, 1)
    b, sb = _quantized(rng, (n, k), E4M3, 2)
    aux = rng.standard_normal((m, n)).astype(tecupy.bfloat16)
    bvec = rng.standard_normal(n).astype(tecupy.bfloat16)
    args = [a, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, bvec]
    got = _strict_kernel(monkeypatch, _gpu(*args), dgelu_aux=_gpu(aux)[0])
    want = backends.dispatch("fp8_block_gemm", *args, dgelu_aux=aux).astype(np.float32)
    got = asnp(got).astype(np.float32)
    assert np.all(np.isfinite(got))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1.6e-2, atol=1e-3 * scale)


@needs_hopper
def test_block_gemm_accumulates_into_float32(monkeypatch, rng):
    """D += the product (wgrad into a float32 main_grad), 1x128 x 1x128."""
    import cupy
    m, n, k = 264, 136, 1152
    a, sa = _quantized(rng, (m, k), E5M2, 1)
    b, sb = _quantized(rng, (n, k), E4M3, 1)
    start = rng.standard_normal((m, n)).astype(np.float32)
    out = cupy.asarray(start)
    got = _strict_kernel(monkeypatch, _gpu(a, E5M2, sa, b, E4M3, sb, np.float32, None),
                         out=out, accumulate=True)
    assert got is out
    want, absdot = _absdot(a, E5M2, sa, b, E4M3, sb)
    want = want + start
    ref = backends.dispatch("fp8_block_gemm", a, E5M2, sa, b, E4M3, sb, np.float32, None,
                            out=start.copy(), accumulate=True)
    assert_split_gemm_close(out, want, ref, absdot, "accumulate")


@needs_hopper
def test_block_gemm_declines_to_the_reference(rng):
    """What the kernel does not take runs on the reference: an FP8 output, N % 8, K % 16,
    a float64 output, NumPy inputs."""
    a, sa = _quantized(rng, (64, 256), E4M3, 1)
    b, sb = _quantized(rng, (72, 256), E4M3, 2)
    g = _gpu(a, E4M3, sa, b, E4M3, sb)
    assert backends.chosen("fp8_block_gemm", *g, tecupy.bfloat16) == "cutlass"
    assert backends.chosen("fp8_block_gemm", *g, E4M3) == "reference"
    assert backends.chosen("fp8_block_gemm", *g, np.float64) == "reference"
    assert backends.chosen("fp8_block_gemm", a, E4M3, sa, b, E4M3, sb,
                           tecupy.bfloat16) == "reference"
    b2, sb2 = _quantized(rng, (68, 256), E4M3, 2)  # N % 8 != 0
    assert backends.chosen("fp8_block_gemm", *g[:3], *_gpu(b2, E4M3, sb2),
                           tecupy.bfloat16) == "reference"
    a3, sa3 = _quantized(rng, (64, 136), E4M3, 1)  # K % 16 != 0
    b3, sb3 = _quantized(rng, (72, 136), E4M3, 2)
    assert backends.chosen("fp8_block_gemm", *_gpu(a3, E4M3, sa3, b3, E4M3, sb3),
                           tecupy.bfloat16) == "reference"


@needs_hopper
def test_linear_under_block_scaling_runs_the_kernel(monkeypatch, rng):
    """Linear's three GEMMs under Float8BlockScaling all run the kernel (none falls back:
    TECUPY_STRICT=1), and agree with the same step on NumPy (the block casts are bit-exact
    there: only the GEMMs' summation order differs)."""
    import cupy
    x = rng.standard_normal((4, 64, 256)).astype(np.float32)
    dy = rng.standard_normal((4, 64, 384)).astype(np.float32)
    results, kinds = {}, []
    for dev, xp in (("cpu", np), ("cuda", cupy)):
        if dev == "cuda":
            kinds = _spy_kinds(monkeypatch)
        mod = tecupy.nn.Linear(256, 384, device=dev, seed=11)
        with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=True,
                                                        fp8_recipe=Float8BlockScaling()):
            y = mod(xp.asarray(x))
        g = tape.gradient(y, mod, output_grad=xp.asarray(dy))
        results[dev] = (y, g)
    assert kinds == ["cutlass"] * 3  # fprop, wgrad, dgrad
    (y0, g0), (y1, g1) = results["cpu"], results["cuda"]
    for name, want, got in [("y", y0, y1)] + [(k, g0[k], g1[k]) for k in g0]:
        want, got = asnp(want).astype(np.float64), asnp(got).astype(np.float64)
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=1e-2, atol=2e-3 * scale, err_msg=name)


def _spy_kinds(monkeypatch):
    """From now on: the kind chosen for each fp8_block_gemm, failures raised."""
    monkeypatch.setenv("TECUPY_STRICT", "1")
    kinds, real = [], backends.dispatch

    def spy(op, *args, **kwargs):
        if op == "fp8_block_gemm":
            kinds.append(backends.chosen(op, *args, **kwargs))
        return real(op, *args, **kwargs)
    monkeypatch.setattr(backends, "dispatch", spy)
    return kinds


@needs_hopper
@pytest.mark.parametrize("k", [256, 640, 2048])
def test_pipelined_b_tables_over_many_tiles_per_cta(monkeypatch, rng, k):
    """The pipelined kernel's B-factor tables (two buffers, copied by the producer per tile)
    on a grid of 2 CTAs, so that each runs 7-8 tiles (both buffers, both phases of their
    barriers): K = 256 (2 k-blocks, fewer than the stages: the producer waits for a buffer),
    640 (5 k-blocks: rows padded to 8 floats by a copy) and 2048; bit for bit the other
    kernel's output and within the reference's bounds; B's factors also as an unaligned,
    strided view (copied by the wrapper)."""
    import cupy
    from tecupy.kernels import block_scaling, fp8_gemm
    monkeypatch.setattr(fp8_gemm, "sm_count", lambda: 2)
    monkeypatch.setattr(block_scaling, "_gemm_plans", {})
    m, n = 332, 776
    a, sa = _quantized(rng, (m, k), E4M3, 1)
    b, sb = _quantized(rng, (n, k), E4M3, 2)
    wide = cupy.zeros((sb.shape[0], sb.shape[1] + 3), np.float32)
    wide[:, 1:-2] = cupy.asarray(sb)
    args = _gpu(a, E4M3, sa, b, E4M3, sb, tecupy.bfloat16, None)
    got = {}
    for pipe, view in ((True, False), (True, True), (False, False)):
        _pipeline(monkeypatch, pipe)
        call = args[:5] + [wide[:, 1:-2]] + args[6:] if view else args
        got[pipe, view] = asnp(_strict_kernel(monkeypatch, call)).astype(np.float32)
        assert _pipelined(m, n, k, 2) == pipe
    np.testing.assert_array_equal(got[True, False], got[False, False])
    np.testing.assert_array_equal(got[True, True], got[False, False])
    _pipeline(monkeypatch, True)
    _run_case(monkeypatch, rng, m, n, k, E4M3, E4M3, 1, 2, tecupy.bfloat16, False)


@needs_hopper
def test_pipelined_plans_of_one_kernel_with_different_k(monkeypatch, rng):
    """The pipelined kernel's shared bytes grow with K: a plan made for a small K after one
    for a large K must not lower the kernel's shared-memory limit under the first's (the
    layer's dgrad at K = 16384 failed to launch once fc1's K = 4096 was planned)."""
    from tecupy.kernels import block_scaling
    monkeypatch.setattr(block_scaling, "_gemm_plans", {})
    _pipeline(monkeypatch, True)
    for k in (9088, 1024, 9088):
        _run_case(monkeypatch, rng, 256, 1024, k, E4M3, E4M3, 1, 2, tecupy.bfloat16, False)
        assert _pipelined(256, 1024, k, 2)

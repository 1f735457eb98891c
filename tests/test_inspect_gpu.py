"""FP8Inspector on CuPy (marked gpu: skipped without a CUDA device). Its counts (flushed and
saturated fractions, amax) equal an independent NumPy computation exactly, on fresh random
data of odd sizes with the boundary values of test_inspect.known_input, under delayed and
current scaling; its round-trip error equals a float64 computation (to float32's rounding
of the dequantized values); the fused activation-backward cast (fp8.dact_cast) is counted
from its codes, or exactly with exact=True; a CUDA graph being recorded with an inspector
active is a clear error, on the real stream."""
import numpy as np
import pytest

import tecupy
from tecupy import fp8, recipe
from tecupy._array import to_numpy
from tecupy.inspect import FIELDS, FP8Inspector
from tecupy.quantization import _current
from test_inspect import code_stats, known_input, numpy_stats, quantizer

pytestmark = pytest.mark.gpu

SHAPES = [(100003,), (37, 91), (129, 77)]  # no multiple of a block or a tile


def _odd_input(rng, fmt, scale, shape, dtype):
    """known_input's boundaries in fresh random data of `shape`, as `dtype`, and its float32
    values (what the cast reads)."""
    x, _, _ = known_input(rng, fmt, scale, n=int(np.prod(shape)))
    x = x.reshape(shape).astype(dtype)
    return x, x.astype(np.float32)


def _check(r, x32, fmt, scale):
    under, over, rel = numpy_stats(x32.reshape(-1), fmt, scale)
    assert under > 0 and over > 0  # the boundary values survived the dtype
    assert r["underflow"][0] == under and r["overflow"][0] == over
    assert r["amax"][0] == np.max(np.abs(x32[~np.isnan(x32)]))
    assert r["numel"][0] == x32.size
    # the inspector dequantizes in float32 (one rounding per value), the reference in float64
    np.testing.assert_allclose(r["rel_error"][0], rel, rtol=1e-5)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, tecupy.bfloat16])
@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
def test_delayed_scaling_counts_equal_numpy(rng, shape, dtype, fmt):
    import cupy
    scale = np.float32(2.0 ** rng.uniform(-3, 3))  # not a power of two
    x, x32 = _odd_input(rng, fmt, scale, shape, dtype)
    q = quantizer(cupy, fmt, scale)
    with FP8Inspector(exact=True) as ins:
        q.quantize(cupy.asarray(x), transpose=len(shape) == 2)
    r = ins.to_dict()["state0.gemm0.input"]
    assert r["scale"][0] == scale
    _check(r, x32, fmt, scale)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, tecupy.bfloat16])
@pytest.mark.parametrize("which", ["input", "grad_output"])  # HYBRID: E4M3, E5M2
def test_current_scaling_counts_equal_numpy(rng, shape, dtype, which):
    import cupy
    q = getattr(_current(recipe.Float8CurrentScaling(), None, 0, cupy), which)
    x, x32 = _odd_input(rng, q.fmt, 1.0, shape, dtype)
    x[np.isinf(x32)] = 0  # (an infinite amax makes the scale 1)
    x32 = x.astype(np.float32)
    with FP8Inspector(exact=True) as ins:
        q.quantize(cupy.asarray(x))
    r = ins.to_dict()[f"current0.{which}"]
    amax = np.float32(np.max(np.abs(x32[~np.isnan(x32)])))
    scale = np.float32(q.fmt.max) / amax  # fp8.current_scale, in float32
    assert r["scale"][0] == scale and r["amax"][0] == amax
    under, over, rel = numpy_stats(x32.reshape(-1), q.fmt, scale)
    assert under > 0  # known_input's boundaries, a little lower: flushed
    assert r["underflow"][0] == under and r["overflow"][0] == over
    np.testing.assert_allclose(r["rel_error"][0], rel, rtol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, tecupy.bfloat16])
def test_cupy_path_equals_numpy_path(rng, dtype):
    import cupy
    x = (rng.standard_normal((256, 128)) * 30).astype(np.float32)
    x[::7, ::5] = 1e-6
    x = x.astype(dtype)
    out = []
    for xp in (np, cupy):
        with FP8Inspector(sample=1000) as ins:
            quantizer(xp, fp8.E4M3, 8.0).quantize(xp.asarray(x), transpose=True)
        out.append(ins.to_dict()["state0.gemm0.input"])
    for f in FIELDS:
        np.testing.assert_allclose(out[1][f], out[0][f], rtol=1e-12, err_msg=f)


@pytest.mark.parametrize("exact", [False, True])
def test_dact_cast_counts_equal_numpy(rng, exact):
    """The fused dGELU cast (rows % 16, cols % 8, not multiples of its 128 x 64 tile): from
    its codes; with exact=True from dx recomputed by gelu_bwd, which must be the dx the
    fused kernel cast (its codes are ml_dtypes' cast of that dx)."""
    import cupy
    rows, cols = 208, 72
    dy = rng.standard_normal((rows, cols)) * 10.0 ** rng.integers(-9, 6, (rows, cols))
    h, b = rng.standard_normal((rows, cols)) * 3, rng.standard_normal(cols)
    dy, h, b = (cupy.asarray(a.astype(tecupy.bfloat16)) for a in (dy, h, b))
    q = quantizer(cupy, fp8.E5M2, np.float32(2.0 ** rng.uniform(-2, 2)), "grad_output")
    scale = float(to_numpy(q.scale)[0])
    assert tecupy.backends.chosen("dact_cast_transpose", dy, h, b, "gelu", q.scale, q.fmt) \
        == "cuda"
    with FP8Inspector(exact=exact) as ins:
        t, _ = fp8.dact_cast(dy, h, b, "gelu", q.scale, q.fmt, q.amax_out, np.float32)
    r = ins.to_dict()["state0.gemm0.grad_output"]
    dx = to_numpy(tecupy.backends.dispatch("gelu_bwd", dy, h, b)[0]).astype(np.float32)
    codes = to_numpy(t.data)
    assert r["amax"][0] == np.abs(dx).max() and r["scale"][0] == scale
    if exact:
        want = np.clip(dx * np.float32(scale), -fp8.E5M2.max, fp8.E5M2.max)
        np.testing.assert_array_equal(codes, want.astype(fp8.E5M2.ml_dtype).view(np.uint8))
        _check(r, dx, fp8.E5M2, scale)
    else:
        assert (r["underflow"][0], r["overflow"][0]) == code_stats(codes, fp8.E5M2)
        assert np.isnan(r["rel_error"][0])


def test_transformer_layer_steps(rng):
    """The main job's layer (bf16, small), two inspected FP8 steps: every cast recorded,
    quantizers' casts with finite numbers, producer-fused ones from their codes."""
    from tecupy.__main__ import build, step
    layer, x, dy = build((256, 1024, 4, 64, 2), "cuda")
    rec = recipe.DelayedScaling()
    with FP8Inspector(layer) as ins:
        for _ in range(2):
            step(layer, x, dy, rec)
            ins.step()
    d = ins.to_dict()
    assert ins.steps == 2 and len(d) >= 12
    for label, r in d.items():
        fields = ("amax", "scale", "underflow", "overflow") + (
            ("rel_error",) if ins.counted_from[label] == "input" else ())
        for f in fields:
            assert np.isfinite(r[f]).all(), (label, f, r[f])
    # fc1's dy: the one-pass dGELU cast (from its codes) unless the GEMM's epilogue makes dh
    from tecupy.ops.blocks import DGELU_EPILOGUE
    want = "input" if tecupy.bfloat16 in DGELU_EPILOGUE else "codes"
    assert ins.counted_from["layernorm_mlp.gemm0.grad_output"] == want


def test_graph_recording_is_a_clear_error(rng):
    """make_graphed_step under an inspector: RuntimeError naming the problem; a stream
    recording a graph by hand is seen as one (cudaStreamIsCapturing). A graph made outside
    replays inside an inspector without error (and unseen)."""
    import cupy
    x = cupy.asarray(rng.standard_normal((64, 32)).astype(tecupy.bfloat16))
    w = cupy.asarray(rng.standard_normal((32, 32)).astype(tecupy.bfloat16))
    state = tecupy.FP8State()

    def fwd(x):
        with tecupy.fp8_autocast(fp8_recipe=recipe.DelayedScaling()):
            return tecupy.linear(x, w, fp8_state=state)
    with FP8Inspector() as ins:
        with pytest.raises(RuntimeError, match="FP8 cast inside a CUDA graph"):
            tecupy.make_graphed_step(fwd, (x,))
    assert ins.steps == 1  # the eager warm-up step was recorded
    stream = cupy.cuda.Stream(non_blocking=True)
    assert not tecupy.inspect._in_graph(cupy)
    with stream:
        stream.begin_capture()
        try:
            recording = tecupy.inspect._in_graph(cupy)
            with pytest.raises(RuntimeError, match="FP8 cast inside a CUDA graph"):
                tecupy.inspect._refuse_graph(cupy)
        finally:
            stream.end_capture()
    assert recording and not tecupy.inspect._in_graph(cupy)
    graphed = tecupy.make_graphed_step(fwd, (x,))
    with FP8Inspector() as ins:
        graphed(x)
    assert ins.labels == []


# ---- cuda/inspect.cu against its reference (tecupy/reference/inspect.py) -------------------
def _on_gpu(a, offset):
    """A CuPy copy of `a` starting `offset` elements into its allocation (offset 1: x no
    longer 16-byte aligned, the kernel's element-by-element path)."""
    import cupy
    flat = cupy.empty(a.size + offset, a.dtype)[offset:]
    flat[...] = cupy.asarray(a.reshape(-1))
    return flat.reshape(a.shape)


def _accumulators(xp):
    """[3, 8] int64, row 1 zero (the record), rows 0 and 2 a pattern that must stay."""
    acc = xp.full((3, 8), 777, np.int64)
    acc[1] = 0
    return acc


def _same_record(got, want):
    """got (CuPy, from the kernel) == want (NumPy, from the reference): rows 0 and 2 kept,
    amax, scale and counts exactly, the sums to 1e-9."""
    from tecupy.inspect import _decode
    got = to_numpy(got)
    assert (got[[0, 2]] == 777).all(), "the kernel wrote outside its row"
    g, w = _decode(got[1:2])[0], _decode(want[1:2])[0]
    np.testing.assert_array_equal(g[:6], w[:6])
    np.testing.assert_allclose(g[6:], w[6:], rtol=1e-9, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("shape", [(1,), (7,), (100003,), (37, 91), (2_000_003,)], ids=str)
def test_inspect_cast_kernel_equals_reference(rng, dtype, fmt, shape):
    """Fresh data with NaN, inf, zeros, flushed and saturated values; the codes of the real
    cast kernel; sampling strides from every element to only element 0; x and codes at
    offsets that break the 16-byte vector loads; sizes that leave a tail."""
    import cupy
    from test_kernels_inspect import special_input
    from tecupy import backends
    from tecupy.kernels import inspect as cuda_impl
    from tecupy.reference import inspect as ref_impl
    n = int(np.prod(shape))
    scale = np.float32(2.0 ** rng.uniform(-3, 3))
    x = special_input(rng, fmt, scale, n, dtype).reshape(shape)
    t = fp8.quantize(cupy.asarray(x), scale, fmt)
    codes, inv = to_numpy(t.data), to_numpy(t.scale_inv)
    s_np = np.array([scale], np.float32)
    assert backends.chosen("inspect_cast", cupy.asarray(x), t.data, fmt, cupy.asarray(s_np),
                           t.scale_inv, _accumulators(cupy), 1, 1) == "cuda"
    strides = (1, 3, 64, -(-n // 65536), n + 5) if n < 10 ** 6 else (1, 7, -(-n // 65536))
    offsets = ((0, 0), (1, 0), (0, 3)) if n < 10 ** 6 else ((0, 0), (1, 3))
    for stride in strides:
        want = _accumulators(np)
        ref_impl.inspect_cast(x, codes, fmt, s_np, inv, want, 1, stride)
        for x_off, q_off in offsets:
            got = _accumulators(cupy)
            cuda_impl.inspect_cast(_on_gpu(x, x_off), _on_gpu(codes, q_off), fmt,
                                   cupy.asarray(s_np), t.scale_inv, got, 1, stride)
            _same_record(got, want)


def test_inspect_cast_kernel_adds_into_its_row(rng):
    """Two casts into one row: counts and sums add, amax is the max of both, the scale the
    last one's: as the reference."""
    import cupy
    from test_kernels_inspect import special_input
    from tecupy.kernels import inspect as cuda_impl
    from tecupy.reference import inspect as ref_impl
    got, want = _accumulators(cupy), _accumulators(np)
    for scale, n in ((4.0, 70001), (0.25, 333)):
        s = np.array([scale], np.float32)
        x = special_input(rng, fp8.E4M3, scale, n, tecupy.bfloat16)
        t = fp8.quantize(cupy.asarray(x), scale, fp8.E4M3)
        cuda_impl.inspect_cast(cupy.asarray(x), t.data, fp8.E4M3, cupy.asarray(s),
                               t.scale_inv, got, 1, 5)
        ref_impl.inspect_cast(x, to_numpy(t.data), fp8.E4M3, s, to_numpy(t.scale_inv), want,
                              1, 5)
    _same_record(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, tecupy.bfloat16])
@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("shape", [(1, 5), (37, 91), (129, 384), (300, 1030)], ids=str)
def test_inspect_block_cast_kernel_equals_reference(rng, dtype, fmt, dim, shape):
    """The block cast's kernel (one pass, each element's scale_inv read in place through
    the layout's strides) against the reference's array ops: fresh data with NaN, inf,
    zeros and values spanning 2^40 (flushed in their blocks); the real block quantize's
    codes; strides and offsets as above; the scales as a transposed view too (1x128: the
    [cols/128, rows] layout from a [rows, cols/128] array); rows outside the record kept."""
    import cupy
    from test_kernels_inspect import special_input
    from tecupy import backends
    from tecupy.kernels import inspect as cuda_impl
    from tecupy.quantization import BlockQuantizer
    from tecupy.reference import inspect as ref_impl
    n = int(np.prod(shape))
    x = special_input(rng, fmt, 1.0, n, np.float32).reshape(shape)
    x *= (2.0 ** rng.integers(-20, 20, shape)).astype(np.float32)
    x = x.astype(dtype)
    q = BlockQuantizer(fmt, dim, tecupy.recipe.QParams(power_2_scale=False))
    t = q.quantize(cupy.asarray(x))
    codes, inv = to_numpy(t.data), to_numpy(t.scale_inv)
    views = [t.scale_inv]
    if dim == 1:
        views.append(cupy.ascontiguousarray(t.scale_inv.T).T)
    assert backends.chosen("inspect_block_cast", cupy.asarray(x), t.data, fmt, t.scale_inv,
                           _accumulators(cupy), 1, 1) == "cuda"
    for stride in (1, 3, -(-n // 700), n + 5):
        want = _accumulators(np)
        ref_impl.inspect_block_cast(x, codes, fmt, inv, want, 1, stride)
        for (x_off, q_off), sinv in zip(((0, 0), (1, 3)), views + views[:1]):
            got = _accumulators(cupy)
            cuda_impl.inspect_block_cast(_on_gpu(x, x_off), _on_gpu(codes, q_off), fmt, sinv,
                                         got, 1, stride)
            _same_record(got, want)


@pytest.mark.parametrize("fmt", [fp8.E4M3, fp8.E5M2])
@pytest.mark.parametrize("n", [1, 15, 16, 17, 4099, 1_000_003])
@pytest.mark.parametrize("offset", [0, 5])
@pytest.mark.parametrize("with_amax", [False, True])
def test_inspect_codes_kernel_equals_reference(rng, fmt, n, offset, with_amax):
    import cupy
    from tecupy.kernels import inspect as cuda_impl
    from tecupy.reference import inspect as ref_impl
    codes = rng.integers(0, 256, n, dtype=np.uint8)
    scale = np.array([2.0 ** rng.uniform(-3, 3)], np.float32)
    amax = np.array([rng.uniform(0, 100)], np.float32) if with_amax else None
    want = _accumulators(np)
    ref_impl.inspect_codes(codes, fmt, scale, amax, want, 1)
    got = _accumulators(cupy)
    cuda_impl.inspect_codes(_on_gpu(codes, offset), fmt, cupy.asarray(scale),
                            None if amax is None else cupy.asarray(amax), got, 1)
    from tecupy.inspect import _decode
    g, w = _decode(to_numpy(got)[1:2])[0], _decode(want[1:2])[0]
    assert (to_numpy(got)[[0, 2]] == 777).all()
    np.testing.assert_array_equal(g, w)  # (NaN where NaN: sums, and amax without a slot)


def test_float64_input_runs_the_reference_on_the_gpu(rng):
    """No kernel for float64 x: the reference op runs on CuPy arrays, with the NumPy path's
    numbers."""
    import cupy
    from tecupy import backends
    x = rng.standard_normal(5000) * 100
    x[::13] = 1e-9
    acc = cupy.zeros((1, 8), np.int64)
    one = cupy.ones(1, np.float32)
    assert backends.chosen("inspect_cast", cupy.asarray(x), cupy.zeros(5000, np.uint8),
                           fp8.E4M3, one, one, acc, 0, 1) == "reference"
    out = []
    for xp in (np, cupy):
        with FP8Inspector(sample=700) as ins:
            quantizer(xp, fp8.E4M3, 8.0).quantize(xp.asarray(x))
        out.append(ins.to_dict()["state0.gemm0.input"])
    for f in FIELDS:
        np.testing.assert_allclose(out[1][f], out[0][f], rtol=1e-12, err_msg=f)


def test_one_host_read_per_step(monkeypatch, rng):
    """The layer's inspected step adds into one accumulator on the device; step() reads it
    with one copy."""
    import tecupy.inspect as inspect_mod
    from tecupy.__main__ import build, step
    reads = []
    real = inspect_mod.to_numpy
    monkeypatch.setattr(inspect_mod, "to_numpy", lambda a: reads.append(a.shape) or real(a))
    layer, x, dy = build((256, 1024, 4, 64, 2), "cuda")
    with FP8Inspector(layer) as ins:
        step(layer, x, dy, recipe.DelayedScaling())
        ins.step()
    # (one row per cast: at least one per tensor seen)
    assert len(reads) == 1 and reads[0][1] == 8 and reads[0][0] >= len(ins.labels) >= 12

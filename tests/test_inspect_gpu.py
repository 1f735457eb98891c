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

"""The launch machinery of the memory-bound kernels on the GPU: amax without a zeroing
memset (grid_amax and its pool of slots, kernels/pools.py) or maxed into a given amax_out,
the ring kernels' row counters (RowTaker), programmatic dependent launch (launch.launch)
and the launch plans kept per shape and setting: results equal plain launches, in streams
and in CUDA graphs."""
import numpy as np
import pytest

import tecupy
from tecupy.fp8 import E4M3
from tecupy.kernels import launch, pools, ring
from tecupy.kernels import norm as norm_kernels
from tecupy.reference import fp8 as ref

pytestmark = pytest.mark.gpu
d = tecupy.backends.dispatch


def _amax_ops(cupy, rng, rows, cols, big):
    """(name, fn() -> amax, expected amax) of every kernel that writes a fresh amax."""
    x = (rng.standard_normal((rows, cols)) * big).astype(np.float32)
    g = np.ones(cols, np.float32)
    xd, gd, one = cupy.asarray(x), cupy.asarray(g), cupy.ones((1,), np.float32)
    c = x - x.mean(-1, keepdims=True)
    ln = c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5)
    rms = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)
    gelu = 0.5 * x * (1 + np.tanh(0.7978845608 * (x + 0.044715 * x ** 3)))
    return [
        ("cast_to_fp8", lambda: d("cast_to_fp8", xd, one, E4M3)[1], np.abs(x).max()),
        ("cast_transpose", lambda: d("cast_transpose", xd, one, E4M3)[2], np.abs(x).max()),
        ("layernorm_fwd_fp8", lambda: d("layernorm_fwd_fp8", xd, gd, 0 * gd, 1e-5, False, one,
                                        E4M3)[-1], np.abs(ln).max()),
        ("rmsnorm_fwd_fp8", lambda: d("rmsnorm_fwd_fp8", xd, gd, 1e-5, False, one, E4M3)[-1],
         np.abs(rms).max()),
        ("gelu_fwd fp8", lambda: d("gelu_fwd", xd, None, one, E4M3)[1], np.abs(gelu).max()),
    ]


@pytest.mark.parametrize("shape", [(333, 4096), (4099, 48), (7, 24)], ids=str)
def test_amax_correct_call_after_call(monkeypatch, rng, shape):
    """Each call's amax is its own input's, through a pool of 3 slots wrapping many times
    (a slot left non-zero by a kernel would carry its max or its count into a later call)."""
    import cupy
    monkeypatch.setattr(pools, "AMAX_SLOTS", 3)
    monkeypatch.setattr(pools, "_pools", {})
    for i in range(4):
        big = 1000.0 if i % 2 == 0 else 0.001
        for name, fn, want in _amax_ops(cupy, rng, *shape, big):
            got = float(fn()[0])
            assert np.isclose(got, want, rtol=2e-3), f"{name} call {i}: amax {got}, want {want}"
    buf = pools._pools["amax", cupy.cuda.runtime.getDevice()][0]
    assert int(abs(buf).max()) == 0, "a slot was not left at zero"


@pytest.mark.parametrize("shape", [(333, 4096), (4099, 48), (7, 24), (0, 64)], ids=str)
def test_amax_out_is_maxed_into(rng, shape):
    """With amax_out (an amax history row: here a view into a 2-D array), every FP8-output
    kernel (casts, norms, activations with bias, gated ones) maxes its amax into it
    (atomicMax, no slot) and returns it: above and below what it held, its neighbours
    untouched, the codes those of the fresh-amax call."""
    import cupy
    rows, cols = shape
    x = cupy.asarray((rng.standard_normal((rows, cols)) * 3).astype(np.float32))
    g, one = cupy.ones(cols, np.float32), cupy.ones((1,), np.float32)
    ops = {"cast_to_fp8": (x, one, E4M3), "cast_transpose": (x, one, E4M3),
           "cast_transpose_dbias": (x, one, E4M3, np.dtype(np.float32)),
           "layernorm_fwd_fp8": (x, g, 0 * g, 1e-5, False, one, E4M3),
           "rmsnorm_fwd_fp8": (x, g, 1e-5, False, one, E4M3),
           "gelu_fwd": (x, g, one, E4M3), "swiglu_fwd": (x, None, one, E4M3)}
    amax_pos = {"cast_transpose_dbias": 2}
    for name, args in ops.items():
        fresh = d(name, *args)
        want = float(fresh[amax_pos.get(name, -1)][0])
        for held in (0.0, want / 2, want * 2, float("inf")):
            history = cupy.full((2, 3), -7.0, np.float32)
            history[0, 1] = held
            out = d(name, *args, amax_out=history[0, 1:2])
            assert out[amax_pos.get(name, -1)].data.ptr == history[0, 1:2].data.ptr, name
            got = float(history[0, 1])
            assert got == max(held, want), f"{name}: held {held}, amax {want}, got {got}"
            h = cupy.asnumpy(history)
            h[0, 1] = -7
            assert (h == -7).all(), f"{name} wrote outside amax_out"
            for a, b in zip(fresh, out):
                if a.size > 1:
                    np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b), name)
    with pytest.raises(TypeError, match="amax_out must be a float32 CuPy array"):
        d("cast_to_fp8", x, one, E4M3, amax_out=cupy.zeros(2, np.float32))


def test_amax_of_zeros_is_zero_after_a_large_one(rng):
    import cupy
    one = cupy.ones((1,), np.float32)
    d("cast_to_fp8", cupy.asarray(rng.standard_normal(5000).astype(np.float32) * 1e4), one,
      E4M3)
    for _ in range(3):
        assert float(d("cast_to_fp8", cupy.zeros(5000, np.float32), one, E4M3)[1][0]) == 0.0


def test_captured_cast_keeps_its_slot(rng):
    """A cast captured in a CUDA graph: each replay's amax is that of the input's current
    contents, eager casts in between stay right, and the slot is never handed out again."""
    import cupy
    x = cupy.asarray(rng.standard_normal((256, 512)).astype(np.float32))
    one = cupy.ones((1,), np.float32)
    d("cast_to_fp8", x, one, E4M3)  # the pool exists before the capture
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        q, amax = d("cast_to_fp8", x, one, E4M3)
        graph = stream.end_capture()
    kept = set(pools._pools["amax", cupy.cuda.runtime.getDevice()][2])
    assert kept, "the captured call did not keep its slot"
    for big in (3.0, 0.5, 70.0):
        host = (rng.standard_normal((256, 512)) * big).astype(np.float32)
        x.set(host)
        graph.launch(stream)
        stream.synchronize()
        y = cupy.asarray(rng.standard_normal(999).astype(np.float32) * 9)
        assert float(d("cast_to_fp8", y, one, E4M3)[1][0]) == float(abs(y).max())
        assert float(amax[0]) == float(np.abs(host).max())
        np.testing.assert_array_equal(cupy.asnumpy(q), ref.cast_to_fp8(host, np.ones(1,
                                      np.float32), E4M3)[0])
    assert kept <= pools._pools["amax", cupy.cuda.runtime.getDevice()][2]


def _ln(x):
    c = x - x.mean(-1, keepdims=True)
    return c / np.sqrt((c * c).mean(-1, keepdims=True) + 1e-5)


@pytest.mark.parametrize("counted", [False, True], ids=["fixed_split", "counters"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16_out", "fp8_out"])
def test_norm_stream_call_after_call(monkeypatch, rng, fp8, counted):
    """norm_fwd_stream, bf16 and FP8 out, through pools of 3 amax slots and 3 sets of row
    counters (RowTaker, cuda/bulk.cuh: a launch must leave its counters at zero): calls of
    many sizes (fewer rows than ring groups, a few rows per group, many) each write every
    row once and right, eagerly and replayed from a graph that keeps its slots, with eager
    calls in between."""
    import cupy
    if not launch.hopper():
        pytest.skip("norm_fwd_stream runs on Hopper")
    monkeypatch.setattr(pools, "AMAX_SLOTS", 3)
    monkeypatch.setattr(pools, "RING_SLOTS", 3)
    monkeypatch.setattr(pools, "_pools", {})
    monkeypatch.setattr(ring, "RING_DYNAMIC_ROWS", 0 if counted else 1 << 40)
    if fp8:  # (FP8 outputs keep the fixed split by default: test the counters too)
        monkeypatch.setattr(norm_kernels, "ring_launch", lambda *a, **kw: ring.ring_launch(
            *a, **{**kw, "dynamic": counted}))
    one = cupy.ones((1,), np.float32)

    def ln(x):
        g = cupy.ones(x.shape[-1], tecupy.bfloat16)
        if fp8:
            return d("layernorm_fwd_fp8", x, g, 0 * g, 1e-5, False, one, E4M3)[0]
        return d("layernorm_fwd", x, g, 0 * g, 1e-5, False)[0]

    def check(y, host):  # (an unwritten row would hold cupy.empty's leftovers)
        y = cupy.asnumpy(y)
        if fp8:
            y = ref.fp8_dequantize(y, E4M3, np.ones(1, np.float32), np.float32)
        np.testing.assert_allclose(y.astype(np.float32), _ln(host), rtol=0.07, atol=0.02)

    for rows in (1, 7, 300, 4099, 20000, 3, 1000):
        host = rng.standard_normal((rows, 4096)).astype(np.float32)
        x = cupy.asarray(host).astype(tecupy.bfloat16)
        check(ln(x), x.astype(np.float32).get())
    x = cupy.asarray(rng.standard_normal((5000, 4096)).astype(np.float32)).astype(
        tecupy.bfloat16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        ln(x)
        stream.begin_capture()
        y = ln(x)
        graph = stream.end_capture()
        for _ in range(3):
            x[...] = cupy.asarray(rng.standard_normal((5000, 4096)).astype(np.float32))
            graph.launch(stream)
            stream.synchronize()
            check(y, x.astype(np.float32).get())
            check(ln(x[:77]), x[:77].astype(np.float32).get())
    cupy.cuda.Device().synchronize()
    for kind in ("amax",) * fp8 + ("ring",) * counted:
        buf = pools._pools[kind, cupy.cuda.runtime.getDevice()][0]
        assert int(abs(buf).max()) == 0, f"a slot of the {kind} pool was not left at zero"


def test_launch_plans_follow_the_settings(monkeypatch, rng):
    """The norm and softmax forwards keep their launch plans per call shape and setting
    (choosing one costs more Python than the launch): the same call gets the same plan, a
    setting changed between calls (as tests and tuning scripts change them) a plan of its
    own, and every call gives the right rows."""
    import cupy
    from tecupy.kernels import softmax as softmax_kernels
    host = rng.standard_normal((300, 4096)).astype(np.float32)
    x = cupy.asarray(host).astype(tecupy.bfloat16)
    g = cupy.ones(4096, tecupy.bfloat16)
    host = x.astype(np.float32).get()
    e = np.exp(0.5 * (host - host.max(-1, keepdims=True)))
    for variant in ("stream", "warp", "stream"):
        monkeypatch.setattr(norm_kernels, "FWD_VARIANT", variant)
        monkeypatch.setattr(softmax_kernels, "FWD_VARIANT", variant if variant == "stream"
                            else "block4")
        plan = norm_kernels._fwd_launch(300, 4096, x.dtype, None, False, False)
        assert norm_kernels._fwd_launch(300, 4096, x.dtype, None, False, False) is plan
        warp = getattr(plan[0], "args", [None])[0]
        assert ("norm_fwd_warp" in getattr(warp, "name", "")) == (
            variant == "warp" or not launch.hopper())
        stream = softmax_kernels._stream_plan(x.dtype, 4096, 300, False, False, 0.5)
        assert (stream is not None) == (variant == "stream" and launch.hopper())
        y = d("layernorm_fwd", x, g, 0 * g, 1e-5, False)[0]
        np.testing.assert_allclose(y.astype(np.float32).get(), _ln(host), rtol=0.02,
                                   atol=0.02)
        p = d("softmax_fwd", x, 0.5, None, False)
        np.testing.assert_allclose(p.astype(np.float32).get(), e / e.sum(-1, keepdims=True),
                                   rtol=0.02, atol=1e-6)


def _chain(x, g, one):
    """Kernels that each read the one before: the ops PDL launches, back to back."""
    y = d("gelu_fwd", x)
    y, _, _ = d("layernorm_fwd", y, g, g, 1e-5, False)
    y = d("softmax_fwd", y, 0.5, None, False)
    y, _ = d("rmsnorm_fwd", y, g, 1e-5, False)
    q, amax = d("cast_to_fp8", y, one, E4M3)
    q2, qt, amax2 = d("cast_transpose", y, one, E4M3)
    q3, _, _, amax3 = d("layernorm_fwd_fp8", y, g, g, 1e-5, False, one, E4M3)
    return [y, q, amax, q2, qt, amax2, q3, amax3]


@pytest.mark.parametrize("graph", [False, True], ids=["stream", "graph"])
def test_pdl_chain_matches_plain_launches(monkeypatch, rng, graph):
    """Each kernel of a dependent chain sees its input complete (PDL_WAIT), eagerly and in a
    captured graph: bit for bit what plain launches give, over many repetitions."""
    import cupy
    x = cupy.asarray(rng.standard_normal((2048, 4096)).astype(np.float32)).astype(
        tecupy.bfloat16)
    g = cupy.asarray(rng.uniform(0.5, 2, 4096).astype(np.float32)).astype(tecupy.bfloat16)
    one = cupy.ones((1,), np.float32)
    monkeypatch.setattr(launch, "PDL", False)
    want = [cupy.asnumpy(a) for a in _chain(x, g, one)]
    monkeypatch.setattr(launch, "PDL", True)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        if graph:
            _chain(x, g, one)
            stream.begin_capture()
            outs = _chain(x, g, one)
            cuda_graph = stream.end_capture()
        for _ in range(5):
            if graph:
                cuda_graph.launch(stream)
            else:
                outs = _chain(x, g, one)
            stream.synchronize()
            for i, (a, w) in enumerate(zip(outs, want)):
                np.testing.assert_array_equal(cupy.asnumpy(a).view(np.uint8),
                                              w.view(np.uint8), err_msg=f"output {i}")


def test_launch_rejects_python_scalars():
    import cupy
    if not launch.hopper():
        pytest.skip("PDL launches only on Hopper")
    from tecupy import loader
    k = loader.function("cast.cu", "cast_to_fp8<float, __nv_fp8_e4m3, 1>")
    x = cupy.ones(4, np.float32)
    with pytest.raises(TypeError, match="NumPy int32/int64/float32/uint32/uint64"):
        launch.launch(k, (1,), (256,), (x, x, x, x, x, 4))


def test_pdl_turned_off_after_the_plans_were_made(monkeypatch, rng):
    """launch.PDL off after a plan was made (an A/B in one process): the kept Launchers go
    on without the attribute, through cuLaunchKernelEx (the FP8 GEMM's TMA descriptors are
    bytes, which CuPy's launch refused: a TypeError), with the same results."""
    import cupy
    if not launch.hopper():
        pytest.skip("PDL launches only on Hopper")
    x = cupy.asarray(rng.standard_normal((256, 512)).astype(np.float32)).astype(
        tecupy.bfloat16)
    w = cupy.asarray(rng.standard_normal((384, 512)).astype(np.float32)).astype(
        tecupy.bfloat16)
    one = cupy.ones((1,), np.float32)

    def run():
        qx, _, _ = d("cast_transpose", x, one, E4M3)
        qw, _, _ = d("cast_transpose", w, one, E4M3)
        return cupy.asnumpy(d("fp8_gemm", qx, E4M3, one, qw, E4M3, one, tecupy.bfloat16,
                              None)).view(np.uint16)
    want = run()  # (the plans are made with PDL on)
    monkeypatch.setattr(launch, "PDL", False)
    np.testing.assert_array_equal(run(), want)
    monkeypatch.setattr(launch, "PDL", True)
    np.testing.assert_array_equal(run(), want)

"""The FP8 linear's kept plan (ops/linear.py, issue 21) on the GPU: training steps with the
plan off, on, on with x and the weight cast by one launch (KEPT_PAIR) and on with scale_inv
carved out of the transposed codes' allocation give the same bits (outputs, gradients, FP8
state); the pair kernel casts what two casts do on odd whole-tile shapes. CPU tests of its
launches: test_host_path.py."""
import importlib

import numpy as np
import pytest

import tecupy
from tecupy.kernels import cast as cast_kernels
from tecupy.recipe import DelayedScaling

linear_op = importlib.import_module("tecupy.ops.linear")


def _steps(monkeypatch, kept, carve, fp8_weights, steps=3, pair=False):
    """y, the gradients and the FP8 state after `steps` steps of a bf16 FP8 nn.Linear (the
    same seed and inputs each time), as NumPy arrays."""
    import cupy
    monkeypatch.setattr(linear_op, "KEPT", kept)
    monkeypatch.setattr(linear_op, "KEPT_PAIR", pair)
    monkeypatch.setattr(linear_op, "_kept", {})
    monkeypatch.setattr(cast_kernels, "CARVE_SCALE_INV", carve)
    r = DelayedScaling(amax_history_len=4)
    with tecupy.quantized_model_init(enabled=fp8_weights, recipe=r):
        lin = tecupy.nn.Linear(512, 256, params_dtype=tecupy.bfloat16, seed=0, device="cuda")
    rng = np.random.default_rng(1)
    out = []
    for _ in range(steps):
        x = cupy.asarray(rng.standard_normal((256, 512)).astype(tecupy.bfloat16))
        dy = cupy.asarray(rng.standard_normal((256, 256)).astype(tecupy.bfloat16))
        with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=r):
            y = lin(x)
            y2 = lin(x)  # a second forward under the same autocast: the plan's call
        grads = tape.gradient([y, y2], [x] + lin.parameters(), output_grad=[dy, dy])
        out += [y, y2] + grads
    state = lin.fp8_state
    out += [state.fwd.scale, state.fwd.amax_history, state.bwd.scale, state.bwd.amax_history]
    assert (len(linear_op._kept) > 0) == kept
    paired = any(p and p[4] is not None for p in linear_op._kept.values())
    assert paired == (pair and not carve and not fp8_weights)
    return [cupy.asnumpy(a) for a in out]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_weights", [False, True])
def test_kept_plan_gives_the_same_bits(monkeypatch, fp8_weights):
    want = _steps(monkeypatch, False, False, fp8_weights)
    for carve, pair in ((False, False), (True, False), (False, True)):
        got = _steps(monkeypatch, True, carve, fp8_weights, pair=pair)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["E4M3", "E5M2"])
def test_pair_cast_is_two_casts(fmt):
    """cast_transpose_pair (kernels/cast.py _ct_pair_bind) on whole-tile shapes that are not
    whole 128 x 64 tiles, outputs from a poisoned pool: codes, transposed codes, scale_inv
    and amax the bits of two bound casts (_ct_bind)."""
    import cupy
    from conftest import poison_gpu_pool
    from tecupy import fp8
    f = getattr(fp8, fmt)
    rng = np.random.default_rng(7)
    shapes = ((272, 776), (48, 1032))
    xs = [cupy.asarray((rng.standard_normal(s) * 3).astype(tecupy.bfloat16)) for s in shapes]
    scales = [cupy.asarray(np.array([v], np.float32)) for v in (7.5, 0.3)]

    def amaxes():
        return [cupy.asarray(np.array([0.25], np.float32)) for _ in shapes]
    poison_gpu_pool()
    got_amax = amaxes()
    got = cast_kernels._ct_pair_bind(*shapes, xs[0].dtype, f)(
        xs[0], scales[0], got_amax[0], xs[1], scales[1], got_amax[1])
    poison_gpu_pool()
    want_amax = amaxes()
    want = [cast_kernels._ct_bind(*s, x.dtype, f)(x, sc, a)
            for s, x, sc, a in zip(shapes, xs, scales, want_amax)]
    for g, w in zip(list(got) + [got_amax], want + [want_amax]):
        for u, v in zip(g, w):
            assert u.shape == v.shape and np.array_equal(cupy.asnumpy(u).view(np.uint8),
                                                         cupy.asnumpy(v).view(np.uint8))
    assert float(got_amax[0][0]) == float(abs(xs[0].astype(np.float32)).max())
    assert cast_kernels._ct_pair_bind((270, 776), (48, 1032), xs[0].dtype, f) is None

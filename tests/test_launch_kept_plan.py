"""The FP8 linear's kept plan (ops/linear.py, issue 21) on the GPU: training steps with the
plan off, on, and on with scale_inv carved out of the transposed codes' allocation give the
same bits (outputs, gradients, FP8 state). CPU tests of its launches: test_host_path.py."""
import importlib

import numpy as np
import pytest

import tecupy
from tecupy.kernels import cast as cast_kernels
from tecupy.recipe import DelayedScaling

linear_op = importlib.import_module("tecupy.ops.linear")


def _steps(monkeypatch, kept, carve, fp8_weights, steps=3):
    """y, the gradients and the FP8 state after `steps` steps of a bf16 FP8 nn.Linear (the
    same seed and inputs each time), as NumPy arrays."""
    import cupy
    monkeypatch.setattr(linear_op, "KEPT", kept)
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
    return [cupy.asnumpy(a) for a in out]


@pytest.mark.gpu
@pytest.mark.parametrize("fp8_weights", [False, True])
def test_kept_plan_gives_the_same_bits(monkeypatch, fp8_weights):
    want = _steps(monkeypatch, False, False, fp8_weights)
    for carve in (False, True):
        got = _steps(monkeypatch, True, carve, fp8_weights)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8))

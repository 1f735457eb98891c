"""What the fused FP8 blocks keep through their backward (issue 22): fc2's input codes and
weight codes (layernorm_mlp) and the norm's output codes (layernorm_linear) are released as
soon as the backward's GEMMs have read them, before the activation's or norm's backward
allocates; gradients are unchanged (test_gradients checks them)."""
import gc
import weakref

import numpy as np

import tecupy
from tecupy import backends
from tecupy.recipe import DelayedScaling


def _watch(monkeypatch, producer, consumer):
    """Weakrefs to the codes `producer` returns; at `consumer`'s call, which are alive."""
    refs, alive = [], []
    real = backends.dispatch

    def dispatch(op, *args, **kwargs):
        if op == consumer:
            gc.collect()
            alive.append(sum(r() is not None for r in refs))
        out = real(op, *args, **kwargs)
        if op == producer:
            refs.append(weakref.ref(out[0]))
        return out
    monkeypatch.setattr(backends, "dispatch", dispatch)
    return refs, alive


def _step(fn, *arrays):
    state = tecupy.FP8State(num_gemms=2)
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=DelayedScaling()):
        y = fn(*arrays, fp8_state=state)
    return tape.gradient(y, [a for a in arrays if a is not None], output_grad=np.ones_like(y))


def test_mlp_releases_fc2_input_codes_before_the_activation_backward(monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 48)).astype(np.float32)
    g, b = np.ones(48, np.float32), np.zeros(48, np.float32)
    w1 = rng.standard_normal((64, 48)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((48, 64)).astype(np.float32) * 0.1
    refs, alive = _watch(monkeypatch, "gelu_fwd", "gelu_bwd")
    _step(lambda *a, fp8_state: tecupy.layernorm_mlp(*a, fp8_state=fp8_state), x, g, b, w1,
          None, w2, None)
    assert len(refs) == 1 and alive == [0]


def test_norm_linear_releases_its_codes_before_the_norm_backward(monkeypatch):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 48)).astype(np.float32)
    g, b = np.ones(48, np.float32), np.zeros(48, np.float32)
    w = rng.standard_normal((64, 48)).astype(np.float32) * 0.1
    refs, alive = _watch(monkeypatch, "layernorm_fwd_fp8", "layernorm_bwd")
    _step(lambda *a, fp8_state: tecupy.layernorm_linear(*a, fp8_state=fp8_state), x, g, b, w)
    assert len(refs) == 1 and alive == [0]

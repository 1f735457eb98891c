"""is_first_microbatch: FP8 weights kept across the microbatches of a minibatch (Transformer
Engine's weight caching) on nn.Linear, LayerNormLinear, LayerNormMLP, and passed through
MultiheadAttention and TransformerLayer.

TE's semantics, read in NVIDIA/TransformerEngine at d0067d0d (transformer_engine/pytorch/):
  module/linear.py 1958-1960: cache_name = None if is_first_microbatch is None else
      "weight", the workspace looked up in the module's _fp8_workspaces; 2068-2071: a
      workspace made by this call is kept there;
  module/linear.py 479-487 (_Linear.forward): update_ws = is_first_microbatch is None or
      is_first_microbatch, passed to quantize_weight as update_workspace;
  module/base.py 861-872 (quantize_weight, "Cache hit"): a kept workspace is re-cast only
      where update_workspace; else returned as it is: no cast, so no amax of the weight;
  common/recipe/delayed_scaling.cu 182-199 (kernel_bulk): the history rolls only where the
      newest amax is not 0; 226-228: an amax of 0 keeps the previous scale. So under
      delayed scaling the weight's slot (history and scale) does not change over the False
      microbatches, and the kept codes keep the scale_inv they were cast with.
Unlike TE (which then casts silently), False with nothing valid kept is an error here.
"""
import importlib

import numpy as np
import pytest

import tecupy
from tecupy import nn
from tecupy.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

from conftest import bf16_array, count_dispatches, same_bits

linear_op = importlib.import_module("tecupy.ops.linear")
HIDDEN, OUT, FFN, M = 32, 48, 64, 32  # FP8 GEMM dims: multiples of 16
RECIPES = {"delayed": lambda: DelayedScaling(amax_history_len=4),
           "current": Float8CurrentScaling}
CASTS = ("cast_transpose", "cast_to_fp8")


def _make(kind, xp, seed=0):
    dev = "cuda" if xp.__name__ == "cupy" else "cpu"
    kw = dict(params_dtype=tecupy.bfloat16, seed=seed, device=dev)
    if kind == "Linear":
        return nn.Linear(HIDDEN, OUT, **kw)
    if kind == "LayerNormLinear":
        return nn.LayerNormLinear(HIDDEN, OUT, **kw)
    return nn.LayerNormMLP(HIDDEN, FFN, **kw)


WEIGHTS = {"Linear": [("weight", 0)], "LayerNormLinear": [("weight", 0)],
           "LayerNormMLP": [("fc1_weight", 0), ("fc2_weight", 1)]}


def _step(mod, x, dy, recipe, first):
    """y and the gradients of x and every parameter, one forward under the recipe."""
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(fp8_recipe=recipe):
            y = mod(x, is_first_microbatch=first)
        grads = tape.gradient(y, [x] + mod.parameters(), output_grad=dy)
    return y, grads


def _metas(state):
    return [] if state.fwd is None else [state.fwd, state.bwd]


def _copy_state(dst, src):
    """dst's FP8 arrays := src's (both used: bound to the same recipe)."""
    for d, s in zip(_metas(dst), _metas(src)):
        for name in ("scale", "scale_inv", "amax_history"):
            getattr(d, name)[...] = getattr(s, name)


def _weight_slots(state, kind):
    return [state.slot(g, "weight")[1] for _, g in WEIGHTS[kind]]


@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_microbatches_bit_identical(xp, rng, kind, recipe):
    """True, False, False, then an optimizer-free change of the weights and True again:
    outputs and gradients bit-identical to a twin module run with None (the weight cast
    each call) from the same FP8 state, its weight slots' scales those the kept codes were
    cast with; the weight slots' amax history and scale untouched by the False calls (TE:
    no cast, no amax; the update leaves a zero-amax slot alone), the other slots as the
    twin's."""
    r = RECIPES[recipe]()
    a, b = _make(kind, xp), _make(kind, xp)
    slots = _weight_slots(a.fp8_state, kind)
    kept_scale = None
    for k, first in enumerate([True, False, False, "change", True]):
        if first == "change":  # in place: the same arrays, new values
            for name, _ in WEIGHTS[kind]:
                w = bf16_array(xp, rng, *getattr(a, name).shape, scale=0.3)
                getattr(a, name)[...] = w
                getattr(b, name)[...] = w
            continue
        delayed = recipe == "delayed" and a.fp8_state.fwd is not None
        if first:  # the scales the kept codes are cast with (1 before the first update)
            kept_scale = a.fp8_state.fwd.scale[slots].copy() if delayed else 1.0
        if delayed:
            _copy_state(b.fp8_state, a.fp8_state)
            b.fp8_state.fwd.scale[slots] = kept_scale
            before = a.fp8_state.fwd.amax_history.copy()
            scale_before = a.fp8_state.fwd.scale.copy()
        x = bf16_array(xp, rng, M, HIDDEN)
        dy = bf16_array(xp, rng, M, HIDDEN if kind == "LayerNormMLP" else OUT)
        ya, ga = _step(a, x, dy, r, first)
        yb, gb = _step(b, x, dy, r, None)
        same_bits(ya, yb, f"y, microbatch {k}")
        for i, (p, q) in enumerate(zip(ga, gb)):
            same_bits(p, q, f"gradient {i}, microbatch {k}")
        if first is False and delayed:
            fwd = a.fp8_state.fwd
            same_bits(fwd.amax_history[:, slots], before[:, slots], "weight amax history")
            same_bits(fwd.scale[slots], scale_before[slots], "weight scale")
        if a.fp8_state.fwd is not None and recipe == "delayed":
            others = [i for i in range(a.fp8_state.fwd.scale.size) if i not in slots]
            for m, n in zip(_metas(a.fp8_state), _metas(b.fp8_state)):
                cols = others if m is a.fp8_state.fwd else slice(None)
                same_bits(m.amax_history[:, cols], n.amax_history[:, cols], "other histories")
                same_bits(m.scale[cols], n.scale[cols], "other scales")
            if first:
                same_bits(a.fp8_state.fwd.amax_history, b.fp8_state.fwd.amax_history, "histories")


@pytest.mark.parametrize("kind", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_false_dispatches_no_weight_cast(xp, rng, kind):
    """Forward dispatches of the cast ops: True and None as many, False one fewer per
    weight; the kept tensors are the module's until a None call drops them."""
    r = DelayedScaling(amax_history_len=4)
    mod = _make(kind, xp)
    x = bf16_array(xp, rng, M, HIDDEN)
    counts = {}
    for first in (None, True, False, False):
        with count_dispatches(CASTS) as calls, tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
            mod(x, is_first_microbatch=first)
        counts.setdefault(first, []).append(sum(calls.values()))
    n = len(WEIGHTS[kind])
    assert counts[True] == counts[None] and counts[False] == [counts[None][0] - n] * 2, counts
    assert set(mod._fp8_workspaces) == {name for name, _ in WEIGHTS[kind]}
    t = mod._fp8_workspaces[WEIGHTS[kind][0][0]][0]
    assert t.data.dtype == np.uint8 and t.data_t is not None and t.scale_inv.shape == (1,)
    with tecupy.fp8_autocast(fp8_recipe=r):
        mod(x)
    assert not mod._fp8_workspaces


def test_none_unchanged(xp, rng):
    """None is today's path: the module's forward and gradients are the op's bits."""
    r = DelayedScaling(amax_history_len=4)
    lin = _make("Linear", xp)
    st = tecupy.FP8State()
    for _ in range(3):
        x, dy = bf16_array(xp, rng, M, HIDDEN), bf16_array(xp, rng, M, OUT)
        y, g = _step(lin, x, dy, r, None)
        with tecupy.Tape() as tape:
            with tecupy.fp8_autocast(fp8_recipe=r):
                want = tecupy.linear(x, lin.weight, lin.bias, fp8_state=st)
            gw = tape.gradient(want, [x, lin.weight, lin.bias], output_grad=dy)
        same_bits(y, want, "y")
        for p, q in zip(g, gw):
            same_bits(p, q, "gradient")
    same_bits(lin.fp8_state.fwd.amax_history, st.fwd.amax_history, "history")


def _fails(mod, x, recipe, first, exc, *words):
    with tecupy.fp8_autocast(fp8_recipe=recipe):
        with pytest.raises(exc) as e:
            mod(x, is_first_microbatch=first)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_errors(rng):
    x = bf16_array(np, rng, M, HIDDEN)
    d = DelayedScaling(amax_history_len=4)
    for kind in WEIGHTS:
        mod = _make(kind, np)
        _fails(mod, x, d, False, ValueError, "is_first_microbatch=False", "none is kept",
               "is_first_microbatch=True")
        for bad in (1, 0, "yes", 1.0):
            _fails(mod, x, d, bad, TypeError, "is_first_microbatch")
        with tecupy.fp8_autocast(fp8_recipe=d):
            mod(x, is_first_microbatch=True)
            mod(x, is_first_microbatch=False)
            mod(x)  # None drops what was kept
        _fails(mod, x, d, False, ValueError, "none is kept")
    lin = _make("Linear", np)
    with tecupy.fp8_autocast(fp8_recipe=d):
        lin(x, is_first_microbatch=True)
    _fails(lin, x, Float8CurrentScaling(), False, ValueError, "DelayedScaling",
           "Float8CurrentScaling", "is_first_microbatch=True")
    _fails(lin, x, Float8BlockScaling(), False, ValueError, "DelayedScaling (E4M3)",
           "Float8BlockScaling (E4M3, 128x128 blocks)")
    lin.weight = lin.weight.copy()
    _fails(lin, x, Float8CurrentScaling(), False, ValueError, "another array")


def test_changes_nothing_outside_fp8_and_for_fp8_weights(rng):
    """Outside fp8_autocast and for FP8 weights (already codes) True and False change
    nothing: no error with nothing kept, the None path's bits."""
    x, dy = bf16_array(np, rng, M, HIDDEN), bf16_array(np, rng, M, OUT)
    lin = _make("Linear", np)
    for first in (False, True, None):
        with tecupy.Tape() as tape:
            y = lin(x, is_first_microbatch=first)
        g = tape.gradient(y, [x] + lin.parameters(), output_grad=dy)
        if first is False:
            want = (y, g)
        else:
            same_bits(y, want[0], "y")
            for p, q in zip(g, want[1]):
                same_bits(p, q, "gradient")
    assert not lin.__dict__.get("_fp8_workspaces")
    r = DelayedScaling(amax_history_len=4)
    outs = []
    for first in (False, True, None):
        with tecupy.quantized_model_init(recipe=r):
            lin8 = _make("Linear", np)
        with tecupy.fp8_autocast(fp8_recipe=r):
            outs.append(lin8(x, is_first_microbatch=first))
    for y in outs[1:]:
        same_bits(y, outs[0], "FP8 weights")


def test_transformer_layer_passes_it_through(xp, rng):
    """TransformerLayer (and its MultiheadAttention) pass is_first_microbatch to the QKV,
    proj, fc1 and fc2 GEMMs: False casts 4 weights fewer than None, with the None run's bits
    (current scaling: no state, so the twin needs no copied scales)."""
    dev = "cuda" if xp.__name__ == "cupy" else "cpu"

    def layer():
        return nn.TransformerLayer(HIDDEN, FFN, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                   params_dtype=tecupy.bfloat16, seed=0, device=dev)
    a, b = layer(), layer()
    r = Float8CurrentScaling()
    for first in (True, False):
        x, dy = bf16_array(xp, rng, 16, 2, HIDDEN), bf16_array(xp, rng, 16, 2, HIDDEN)
        counts, outs = [], []
        for mod, f in ((a, first), (b, None)):
            with count_dispatches(CASTS) as calls, tecupy.Tape() as tape:
                with tecupy.fp8_autocast(fp8_recipe=r):
                    y = mod(x, is_first_microbatch=f)
                g = tape.gradient(y, [x] + mod.parameters(), output_grad=dy)
            counts.append(sum(calls.values()))
            outs.append([y] + g)
        for i, (p, q) in enumerate(zip(*outs)):
            same_bits(p, q, f"output {i}")
        assert counts[0] == counts[1] - (4 if first is False else 0), counts
    kept = [n for n, m in a.named_modules() if m.__dict__.get("_fp8_workspaces")]
    assert kept == ["self_attention.layernorm_qkv.", "self_attention.proj.",
                    "layernorm_mlp."], kept
    with pytest.raises(TypeError, match="is_first_microbatch"):
        a(x, is_first_microbatch="no")

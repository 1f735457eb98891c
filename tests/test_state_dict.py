"""Module.state_dict / load_state_dict with FP8 state and RNG state, pickle and deepcopy.

Transformer Engine saves a module's FP8 meta (scale, amax_history of forward and backward)
with its parameters as `_extra_state` (transformer_engine/pytorch/module/base.py:
get_extra_state / set_extra_state), so training resumes where it stopped; tecupy's dict also
carries each module's numpy Generator state, from which the dropout seeds come.
"""
import copy
import pickle

import numpy as np
import pytest

import tecupy
from tecupy.recipe import DelayedScaling, Format
from conftest import asnp

RECIPE = DelayedScaling(amax_history_len=4)


def make_layer(seed, device="cpu"):
    return tecupy.nn.TransformerLayer(32, 64, 2, device=device, seed=seed)


def train_step(layer, x, dy, recipe=RECIPE, lr=0.05):
    """One FP8 delayed-scaling step with dropout on: forward under Tape and fp8_autocast,
    gradients of every parameter, SGD in place. Returns (output, gradients) as numpy."""
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
        y = layer(x)
    grads = tape.gradient(y, layer, output_grad=dy)
    params = layer.named_parameters()
    for name, g in grads.items():
        params[name] -= (lr * g).astype(params[name].dtype)
    return asnp(y), {k: asnp(v) for k, v in grads.items()}


def fp8_arrays(layer):
    return {f"{p}{d}.{k}": asnp(getattr(getattr(st, d), k)).copy()
            for p, st in layer._fp8_states() for d in ("fwd", "bwd")
            for k in ("scale", "scale_inv", "amax_history")}


def assert_same_run(a, b):
    """Bit-identical outputs, gradients, parameters and FP8 state."""
    (ya, ga), (yb, gb) = a, b
    np.testing.assert_array_equal(ya, yb)
    assert ga.keys() == gb.keys()
    for k in ga:
        np.testing.assert_array_equal(ga[k], gb[k], err_msg=k)


def data(rng, xp=np):
    x = rng.standard_normal((8, 2, 32)).astype(np.float32)
    dy = rng.standard_normal((8, 2, 32)).astype(np.float32)
    return xp.asarray(x), xp.asarray(dy)


def assert_same_state(la, lb):
    sa, sb = la.state_dict(), lb.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if isinstance(sa[k], np.ndarray):
            np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
        else:
            assert sa[k] == sb[k], k


def test_round_trip_continues_bit_identically(rng):
    x, dy = data(rng)
    layer = make_layer(0)
    for _ in range(2):
        train_step(layer, x, dy)
    sd = layer.state_dict()
    fresh = make_layer(123).load_state_dict(sd)  # other seed: other weights until loaded
    assert_same_state(layer, fresh)
    for _ in range(2):
        assert_same_run(train_step(layer, x, dy), train_step(fresh, x, dy))
    assert_same_state(layer, fresh)
    fp8 = fp8_arrays(layer)
    assert fp8["layernorm_mlp.fp8_state.bwd.amax_history"].any()  # real FP8 state compared
    for k, v in fp8_arrays(fresh).items():
        np.testing.assert_array_equal(v, fp8[k], err_msg=k)


def test_state_dict_is_plain_and_documented(rng):
    x, dy = data(rng)
    layer = make_layer(1)
    train_step(layer, x, dy)
    sd = layer.state_dict()
    assert set(layer.named_parameters()) <= set(sd)
    for k, v in sd.items():
        assert isinstance(v, (np.ndarray, dict, str, int)), (k, type(v))
    p = "self_attention.layernorm_qkv.fp8_state."
    assert sd[p + "fp8_format"] == "HYBRID" and sd[p + "amax_history_len"] == 4
    assert sd[p + "fwd.amax_history"].shape == (4, 3) and sd[p + "bwd.scale"].dtype == np.float32
    assert sd["layernorm_mlp.fp8_state.fwd.scale"].shape == (6,)  # 2 GEMMs
    assert sd["rng_state"]["bit_generator"] == "PCG64"
    assert "self_attention.core_attention.rng_state" in sd
    sd["self_attention.proj.weight"][...] = 0  # a copy: the module is untouched
    assert np.any(layer.self_attention.proj.weight != 0)
    pickle.loads(pickle.dumps(sd))


def test_dropout_seeds_follow_the_rng_state(rng):
    """Same weights but another RNG state: another dropout mask, another output."""
    x, dy = data(rng)
    a, b = make_layer(2), make_layer(2)
    train_step(a, x, dy)
    b.load_state_dict(a.state_dict())
    a.rng.integers(0, 10)  # a's generator moves on; b's does not
    assert not np.array_equal(train_step(a, x, dy)[0], train_step(b, x, dy)[0])


def test_pickle_and_deepcopy_after_fp8_steps(rng):
    """FP8State keeps its device as a name, not the array module, so modules pickle; the
    copies continue exactly as the original."""
    x, dy = data(rng)
    layer = make_layer(3)
    for _ in range(2):
        train_step(layer, x, dy)
    copies = [pickle.loads(pickle.dumps(layer)), copy.deepcopy(layer)]
    for c in copies:
        assert c.layernorm_mlp.fp8_state.device == "numpy"
        assert c.layernorm_mlp.fp8_state.fwd.fmt is tecupy.fp8.E4M3
        assert c.layernorm_mlp.fp8_state.fp8_format is Format.HYBRID
    runs = [train_step(m, x, dy) for m in [layer] + copies]
    for r in runs[1:]:
        assert_same_run(runs[0], r)


def bad_dicts():
    """(name, edit of a trained layer's state dict, message)."""
    p = "self_attention.proj."
    f = p + "fp8_state."

    def drop(k):
        return lambda sd: sd.pop(k)

    def put(k, v):
        return lambda sd: sd.__setitem__(k, v)

    def cast(k, dt):
        return lambda sd: sd.__setitem__(k, sd[k].astype(dt))
    return [
        ("missing", drop(p + "weight"), rf"key '{p}weight': got missing"),
        ("unexpected", put("extra.weight", np.zeros(2)), "key 'extra.weight': got an unexpected"),
        ("shape", put(p + "weight", np.zeros((32, 16), np.float32)),
         rf"'{p}weight': got shape \(32, 16\), expected shape \(32, 32\)"),
        ("dtype", cast(p + "bias", np.float64), "got dtype float64, expected dtype float32"),
        ("not an array", put(p + "bias", [0.0] * 32), "got list, expected an array"),
        ("format", put(f + "fp8_format", "E4M3"),
         rf"'{f}fp8_format': got 'E4M3', expected 'HYBRID'"),
        ("bad format", put(f + "fp8_format", "E5M2"), "expected 'E4M3', 'HYBRID' or None"),
        ("history length", put(f + "amax_history_len", 8),
         rf"'{f}amax_history_len': got 8, expected 4"),
        ("fp8 array", put(f + "fwd.scale", np.ones(6, np.float32)),
         rf"'{f}fwd.scale': got shape \(6,\), expected shape \(3,\)"),
        ("fp8 missing", drop(f + "bwd.amax_history"), rf"'{f}bwd.amax_history': got missing"),
        ("rng", put("rng_state", {"bit_generator": "MT19937"}), "'rng_state': got .*MT19937"),
    ]


@pytest.mark.parametrize("name, edit, msg", bad_dicts(), ids=[b[0] for b in bad_dicts()])
def test_mismatched_state_is_a_clear_error_and_loads_nothing(rng, name, edit, msg):
    x, dy = data(rng)
    src, dst = make_layer(4), make_layer(5)
    for m in (src, dst):
        train_step(m, x, dy)
    sd = src.state_dict()
    edit(sd)
    before = dst.state_dict()
    with pytest.raises(ValueError, match=msg):
        dst.load_state_dict(sd)
    after = dst.state_dict()
    for k, v in before.items():
        assert np.array_equal(v, after[k]) if isinstance(v, np.ndarray) else v == after[k], k


def test_unused_fp8_state_takes_the_saved_recipe_and_reset(rng):
    """A module whose FP8 state was never used takes the saved format and length (E4M3,
    16 here); loading a dict saved before any FP8 step makes the states unused again."""
    x, dy = data(rng)
    r = DelayedScaling(amax_history_len=16, fp8_format=Format.E4M3)
    src = make_layer(6)
    snapshot = src.state_dict()  # before FP8: every fp8_format is None
    assert snapshot["layernorm_mlp.fp8_state.fp8_format"] is None
    train_step(src, x, dy, recipe=r)
    dst = make_layer(7).load_state_dict(src.state_dict())
    assert dst.layernorm_mlp.fp8_state.fp8_format is Format.E4M3
    assert dst.layernorm_mlp.fp8_state.bwd.fmt is tecupy.fp8.E4M3
    assert_same_run(train_step(src, x, dy, recipe=r), train_step(dst, x, dy, recipe=r))
    src.load_state_dict(snapshot)
    assert src.layernorm_mlp.fp8_state.fwd is None
    assert_same_state(src, make_layer(6))


@pytest.mark.gpu
def test_round_trip_on_the_gpu_and_across_devices(rng):
    """A dict holds numpy arrays whatever the device; loading puts them on the module's.
    (LayerNormMLP: the GPU attention backward sums dQ with atomics, so a whole layer's
    gradients are not bit-reproducible on the GPU; this module's are.)"""
    import cupy

    def mlp(seed, device="cuda"):
        return tecupy.nn.LayerNormMLP(32, 64, device=device, seed=seed)
    x = cupy.asarray(rng.standard_normal((16, 32)).astype(np.float32))
    dy = cupy.asarray(rng.standard_normal((16, 32)).astype(np.float32))
    gpu = mlp(8)
    for _ in range(2):
        train_step(gpu, x, dy)
    sd = gpu.state_dict()
    assert all(not isinstance(v, cupy.ndarray) for v in sd.values())
    fresh = mlp(9).load_state_dict(sd)
    assert isinstance(fresh.fp8_state.fwd.scale, cupy.ndarray)
    assert isinstance(fresh.fc1_weight, cupy.ndarray)
    for _ in range(2):
        assert_same_run(train_step(gpu, x, dy), train_step(fresh, x, dy))
    assert_same_state(gpu, fresh)
    cpu = mlp(10, "cpu").load_state_dict(sd)  # onto a CPU module: numpy arrays
    assert isinstance(cpu.fp8_state.fwd.scale, np.ndarray) and cpu.fp8_state.device == "numpy"
    back = pickle.loads(pickle.dumps(gpu))
    assert isinstance(back.fp8_state.fwd.amax_history, cupy.ndarray)
    assert back.fp8_state.device == "cupy"

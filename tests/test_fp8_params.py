"""FP8 weights (quantized_model_init, issue 22): the modules' GEMM weights as FP8 codes, the
first step equal bit for bit to casting high-precision weights, the optimizer's master
copies cast into the codes in place, state_dict round trips, clear errors; under delayed,
current and block scaling (Float8BlockScaling: 128x128 weight blocks)."""
import numpy as np
import pytest

import tecupy
from tecupy import FP8Weight, quantized_model_init
from tecupy.fp8 import cast, current_scale, amax
from tecupy.quantization import BlockQuantizer
from tecupy.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling
from conftest import asnp

RECIPES = [DelayedScaling, Float8CurrentScaling, Float8BlockScaling]
GEMM_WEIGHTS = ["self_attention.layernorm_qkv.weight", "self_attention.proj.weight",
                "layernorm_mlp.fc1_weight", "layernorm_mlp.fc2_weight"]


def _layer(xp, dtype, quantized, recipe=None, preserve=False):
    make = lambda: tecupy.nn.TransformerLayer(  # noqa: E731
        32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0, params_dtype=dtype,
        device="cuda" if xp.__name__ == "cupy" else "cpu", seed=3)
    if not quantized:
        return make()
    with quantized_model_init(recipe=recipe, preserve_high_precision_init_val=preserve):
        return make()


def _step(layer, x, dy, recipe):
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(fp8_recipe=recipe):
            y = layer(x)
    return y, tape.gradient(y, layer, output_grad=dy)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__)
def test_first_step_equals_casting_high_precision_weights(xp, rng, recipe):
    """Made under quantized_model_init, the layer's GEMM weights are FP8Weights (one byte
    per element in each layout); its first FP8 step gives the outputs and gradients of the
    same layer with high-precision weights cast at the forward, bit for bit (the first cast
    has the same scale: the state's initial 1 under delayed scaling, the tensor's amax
    under current scaling, each 128x128 block's amax under block scaling)."""
    dtype = tecupy.bfloat16 if xp.__name__ == "cupy" else np.float32
    fp8, plain = _layer(xp, dtype, True, recipe()), _layer(xp, dtype, False)
    params = fp8.named_parameters()
    assert sorted(k for k, p in params.items() if isinstance(p, FP8Weight)) == sorted(
        GEMM_WEIGHTS)
    for k in GEMM_WEIGHTS:
        w = params[k]
        assert w.dtype == dtype and w.shape == plain.named_parameters()[k].shape
        assert w.data.dtype == np.uint8 and w.nbytes == 2 * w.size
    x = xp.asarray(rng.standard_normal((16, 2, 32)).astype(dtype))
    dy = xp.asarray(rng.standard_normal((16, 2, 32)).astype(dtype))
    (y1, g1), (y2, g2) = _step(fp8, x, dy, recipe()), _step(plain, x, dy, recipe())
    np.testing.assert_array_equal(asnp(y1), asnp(y2))
    for k in g2:
        assert g1[k].dtype == g2[k].dtype, k
        np.testing.assert_array_equal(asnp(g1[k]), asnp(g2[k]), err_msg=k)
    for mod, ref in ((fp8, plain), ):  # the delayed-scaling states agree too
        for (_, s1), (_, s2) in zip(mod._fp8_states(), ref._fp8_states()):
            if s1.fwd is not None:
                np.testing.assert_array_equal(asnp(s1.fwd.scale), asnp(s2.fwd.scale))
                np.testing.assert_array_equal(asnp(s1.fwd.amax_history),
                                              asnp(s2.fwd.amax_history))


def test_outside_fp8_autocast_the_weight_is_dequantized(rng):
    with quantized_model_init(recipe=Float8CurrentScaling()):
        lin = tecupy.nn.Linear(32, 16, device="cpu", seed=1)
    x = rng.standard_normal((4, 32)).astype(np.float32)
    w = lin.weight.dequantize()
    np.testing.assert_allclose(lin(x), x @ w.T + lin.bias, rtol=1e-6, atol=1e-6)
    with tecupy.Tape() as tape:
        y = lin(x)
    gw = tape.gradient(y, lin.weight)  # the FP8 weight's gradient, in its dtype
    assert gw.dtype == np.float32 and gw.shape == (16, 32)
    np.testing.assert_allclose(gw, np.ones((4, 16)).T @ x, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__)
@pytest.mark.parametrize("preserve", [False, True], ids=["from_fp8", "preserved"])
def test_optimizer_casts_its_masters_into_the_codes(xp, rng, recipe, preserve):
    """AdamW keeps a float32 master of each FP8 weight (the preserved initial value, or the
    FP8 value), updates it from the weight's gradient and casts it into the weight's codes in
    place (same arrays: a captured graph reads them); the codes are the recipe's cast of the
    master, with the delayed-scaling weight slot's scale or the master's own amax."""
    dtype = tecupy.bfloat16 if xp.__name__ == "cupy" else np.float32
    layer = _layer(xp, dtype, True, recipe(), preserve)
    w = layer.self_attention.proj.weight
    init = w.get_high_precision_init_val()
    assert (init is not None) == preserve
    opt = tecupy.optim.AdamW(layer.named_parameters(), lr=1e-2)
    master = opt.params[opt.names.index("self_attention.proj.weight")]
    want0 = init.astype(np.float32) if preserve else asnp(w.dequantize(np.float32))
    np.testing.assert_array_equal(asnp(master), want0)
    addresses = (w.data.data.ptr, w.data_t.data.ptr) if xp.__name__ == "cupy" else None
    x = xp.asarray(rng.standard_normal((16, 2, 32)).astype(dtype))
    for _ in range(2):
        _, grads = _step(layer, x, xp.ones_like(x), recipe())
        opt.step(grads)
    if recipe is DelayedScaling:
        meta, i = layer.self_attention.proj.fp8_state.slot(0, "weight")
        want = cast(master, meta.scale[i:i + 1].copy(), w.fmt, transpose=True)
    elif recipe is Float8CurrentScaling:
        want = cast(master, current_scale(amax(master), w.fmt), w.fmt, transpose=True)
    else:  # each 128x128 block's own scale, both copies
        want = BlockQuantizer(w.fmt, 2, recipe().fp8_quant_fwd_weight).quantize(master, True)
        np.testing.assert_array_equal(asnp(w.scale_inv_t), asnp(want.scale_inv_t))
        np.testing.assert_array_equal(asnp(w.scale_inv_t), asnp(w.scale_inv).T)
    np.testing.assert_array_equal(asnp(w.data), asnp(want.data))
    np.testing.assert_array_equal(asnp(w.data_t), asnp(want.data_t))
    np.testing.assert_array_equal(asnp(w.scale_inv), asnp(want.scale_inv))
    if addresses is not None:
        assert (w.data.data.ptr, w.data_t.data.ptr) == addresses


@pytest.mark.parametrize("recipe", [DelayedScaling, Float8BlockScaling],
                         ids=lambda r: r.__name__)
def test_state_dicts_resume_bit_identically(xp, rng, tmp_path, recipe):
    """Saved after 2 steps and loaded into a fresh twin, 2 more steps agree bit for bit;
    an FP8 weight saves its codes and scale_inv (one per tensor, or per 128x128 block of
    the [64, 32] fc1 weight: [1, 1]), its transposed copy is rebuilt from them."""
    dtype = tecupy.bfloat16 if xp.__name__ == "cupy" else np.float32
    x = xp.asarray(rng.standard_normal((16, 2, 32)).astype(dtype))

    def run(layer, opt, steps):
        for _ in range(steps):
            _, grads = _step(layer, x, xp.ones_like(x), recipe())
            opt.step(grads)
    layer = _layer(xp, dtype, True, recipe())
    opt = tecupy.optim.AdamW(layer.named_parameters(), lr=1e-2)
    run(layer, opt, 2)
    sd = layer.state_dict()
    assert sd["layernorm_mlp.fc1_weight"].dtype == np.uint8
    w = layer.layernorm_mlp.fc1_weight
    assert not np.shares_memory(sd["layernorm_mlp.fc1_weight"], asnp(w.data))  # a copy
    want = (1,) if recipe is DelayedScaling else (1, 1)
    assert sd["layernorm_mlp.fc1_weight.scale_inv"].shape == want
    path = tmp_path / "ckpt.npz"
    tecupy.save(path, layer, opt)
    run(layer, opt, 2)
    other = _layer(xp, dtype, True, recipe())
    opt2 = tecupy.optim.AdamW(other.named_parameters(), lr=1e-2)
    tecupy.load(path, other, opt2)
    run(other, opt2, 2)
    for k, v in layer.state_dict().items():
        if isinstance(v, np.ndarray):
            np.testing.assert_array_equal(v, other.state_dict()[k], err_msg=k)
    bad = dict(sd)
    bad["layernorm_mlp.fc1_weight"] = sd["layernorm_mlp.fc1_weight"].astype(np.float32)
    with pytest.raises(ValueError, match="fc1_weight"):
        other.load_state_dict(bad)


def test_bad_arguments_are_clear():
    with pytest.raises(TypeError, match="quantized_model_init: recipe"):
        quantized_model_init(recipe="delayed")
    with pytest.raises(TypeError, match="enabled"):
        quantized_model_init(enabled="yes")
    with quantized_model_init(enabled=False):
        lin = tecupy.nn.Linear(16, 16, device="cpu")
    assert isinstance(lin.weight, np.ndarray)
    with quantized_model_init():
        norm = tecupy.nn.LayerNorm(16, device="cpu")  # no GEMM weight: nothing changes
    assert isinstance(norm.weight, np.ndarray)
    ctx = quantized_model_init()
    with ctx:
        with quantized_model_init(enabled=False):
            with ctx:  # the same object entered again, nested
                assert isinstance(tecupy.nn.Linear(16, 16, device="cpu").weight, FP8Weight)
            assert isinstance(tecupy.nn.Linear(16, 16, device="cpu").weight, np.ndarray)
        assert isinstance(tecupy.nn.Linear(16, 16, device="cpu").weight, FP8Weight)
    assert isinstance(tecupy.nn.Linear(16, 16, device="cpu").weight, np.ndarray)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.__name__)
def test_graphed_step_with_fp8_weights_equals_eager(recipe):
    """forward, backward and AdamW (casting its masters into the FP8 weights) captured in one
    CUDA graph: 1 warm-up step, the capture and 4 replays equal 5 eager steps on a twin, bit
    for bit (outputs, parameters, FP8 states, optimizer state). An MLP block (attention's
    backward sums dQ with atomics)."""
    import cupy
    bf16 = tecupy.bfloat16
    r = np.random.default_rng(1)
    data = [tuple(cupy.asarray((r.standard_normal((32, 2, 128)) * s).astype(bf16))
                  for s in (1.0, 1e-2)) for _ in range(5)]

    def make_step():
        with quantized_model_init(recipe=recipe()):
            layer = tecupy.nn.LayerNormMLP(128, 512, params_dtype=bf16, device="cuda", seed=0)
        opt = tecupy.optim.AdamW(layer.named_parameters(), lr=1e-3)
        rec = recipe()

        def fn(x, dy):
            with tecupy.Tape() as tape:
                with tecupy.fp8_autocast(fp8_recipe=rec):
                    y = layer(x)
            opt.step(tape.gradient(y, layer, output_grad=dy))
            return (y,)
        return fn, layer, opt
    fn_e, layer_e, opt_e = make_step()
    want = [fn_e(x, dy)[0].get() for x, dy in data]
    fn_t, layer_t, opt_t = make_step()
    step = tecupy.make_graphed_step(fn_t, (cupy.array(data[0][0]), cupy.array(data[0][1])))
    for n, (x, dy) in enumerate(data[1:], 1):
        assert step(x, dy)[0].get().tobytes() == want[n].tobytes(), f"step {n + 1} differs"
    sd_e, sd_t = opt_e.state_dict(), opt_t.state_dict()
    sd_e.update(layer_e.state_dict())
    sd_t.update(layer_t.state_dict())
    assert sd_e.keys() == sd_t.keys()
    for k, v in sd_e.items():
        same = v.tobytes() == sd_t[k].tobytes() if isinstance(v, np.ndarray) else v == sd_t[k]
        assert same, k


def test_fp8_weights_under_another_scaling_are_a_clear_error(rng):
    """FP8 weights run under a recipe whose GEMMs read other scales (per tensor against
    per block, or other blocks) are refused by name before any GEMM, not a scale-shape
    error inside one; quantized_model_init refuses 1x128 weight blocks (their column-wise
    copy has blocks of its own: the codes' transpose is not it)."""
    with quantized_model_init(recipe=DelayedScaling()):
        per_tensor = tecupy.nn.Linear(128, 128, device="cpu", seed=0)
    with quantized_model_init(recipe=Float8BlockScaling()):
        per_block = tecupy.nn.Linear(128, 128, device="cpu", seed=0)
    x = rng.standard_normal((128, 128)).astype(np.float32)
    cases = [(per_tensor, Float8BlockScaling(), "one scale per tensor.*scales 128x128"),
             (per_block, DelayedScaling(), "one scale per 128x128 block.*scales per tensor"),
             (per_block, Float8CurrentScaling(), "128x128 block.*scales per tensor"),
             (per_block, Float8BlockScaling(x_block_scaling_dim=2, w_block_scaling_dim=1),
              "128x128 block.*scales 1x128 blocks")]
    for lin, recipe, match in cases:
        with pytest.raises(TypeError, match=match):
            with tecupy.fp8_autocast(fp8_recipe=recipe):
                lin(x)
    with pytest.raises(ValueError, match="w_block_scaling_dim.*2.*got 1"):
        quantized_model_init(recipe=Float8BlockScaling(x_block_scaling_dim=2,
                                                       w_block_scaling_dim=1))


def test_checkpoint_with_fp8_weights_is_bit_identical(xp, rng):
    """tecupy.checkpoint around a layer with FP8 weights: outputs, gradients (the FP8
    weights' included) and FP8 state equal the plain step's, bit for bit."""
    dtype = tecupy.bfloat16 if xp.__name__ == "cupy" else np.float32
    x = xp.asarray(rng.standard_normal((16, 2, 32)).astype(dtype))
    dy = xp.asarray(rng.standard_normal((16, 2, 32)).astype(dtype))
    runs = []
    for ckpt in (True, False):
        layer = _layer(xp, dtype, True, DelayedScaling())
        with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=DelayedScaling()):
            y = tecupy.checkpoint(layer, x) if ckpt else layer(x)
        g = tape.gradient(y, layer, output_grad=dy)
        runs.append([asnp(y)] + [asnp(g[k]) for k in sorted(g)]
                    + [v for _, v in sorted(layer.state_dict().items())
                       if isinstance(v, np.ndarray)])
    for a, b in zip(*runs):
        assert a.tobytes() == b.tobytes()

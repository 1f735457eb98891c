"""fp8_autocast: when FP8 state is written and updated, and FP8 results against high
precision within Transformer Engine's E4M3 tolerances."""
import numpy as np
import pytest

import tecupy
from tecupy.activation_table import TABLE
from tecupy.recipe import DelayedScaling, Float8CurrentScaling, Format
from conftest import asnp

E4M3_TOL = dict(rtol=0.125, atol=0.0675)


def data(xp, rng, *shape, dtype=np.float32):
    return xp.asarray(rng.standard_normal(shape).astype(dtype))


def test_forward_state_updates_at_outermost_exit(xp, rng):
    lin = tecupy.nn.Linear(32, 16, device="cpu" if xp is np else "cuda", seed=1)
    x = data(xp, rng, 16, 32)
    r = DelayedScaling(amax_history_len=4)
    with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
        with tecupy.fp8_autocast(fp8_recipe=r):
            lin(x)
        st = lin.fp8_state
        # amax recorded in row 0, scales not yet updated inside the outer context
        np.testing.assert_allclose(asnp(st.fwd.amax_history)[0, :2],
                                   [float(abs(asnp(x)).max()), float(abs(asnp(lin.weight)).max())],
                                   rtol=1e-6)
        assert np.all(asnp(st.fwd.scale) == 1)
    hist, scale = asnp(st.fwd.amax_history), asnp(st.fwd.scale)
    assert np.all(hist[0] == 0)
    np.testing.assert_allclose(scale[:2], 448 / hist[-1, :2], rtol=1e-6)
    assert scale[2] == 1  # the output slot is unused: amax 0 leaves it alone
    assert np.all(asnp(st.bwd.scale) == 1)  # backward slots wait for backward


def test_backward_state_updates_after_gradient(xp, rng):
    dev = "cpu" if xp is np else "cuda"
    lin = tecupy.nn.Linear(32, 16, device=dev, seed=2)
    x, dy = data(xp, rng, 2, 8, 32), data(xp, rng, 2, 8, 16) * 100
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=8)):
            lin(x)
            y = lin(x)  # called twice: row 0 keeps the max, as the kernel's atomicMax
        assert np.all(asnp(lin.fp8_state.bwd.amax_history) == 0)
        tape.gradient(y, lin, output_grad=dy)
    bwd = lin.fp8_state.bwd
    amax_dy = float(abs(asnp(dy)).max())
    np.testing.assert_allclose(asnp(bwd.amax_history)[-1, 0], amax_dy, rtol=1e-6)
    np.testing.assert_allclose(asnp(bwd.scale)[0], 57344 / amax_dy, rtol=1e-6)  # E5M2


def test_disabled_inner_autocast_runs_high_precision(rng):
    x, w = data(np, rng, 16, 32), data(np, rng, 16, 32)
    with tecupy.fp8_autocast():
        with tecupy.fp8_autocast(enabled=False):
            y = tecupy.linear(x, w)
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("recipe", [None, DelayedScaling(), Float8CurrentScaling(),
                                    DelayedScaling(fp8_format=Format.E4M3)],
                         ids=["default", "delayed", "current", "e4m3"])
def test_fp8_linear_close_to_high_precision(xp, rng, recipe):
    dev = "cpu" if xp is np else "cuda"
    lin = tecupy.nn.Linear(64, 48, device=dev, seed=3)
    x, dy = data(xp, rng, 4, 8, 64), data(xp, rng, 4, 8, 48)
    with tecupy.Tape() as tape:
        y_hp = lin(x)
    g_hp = tape.gradient(y_hp, [x, lin.weight, lin.bias], output_grad=dy)
    for step in range(3):  # the first step runs with scale 1, later ones with real scales
        with tecupy.Tape() as tape:
            with tecupy.fp8_autocast(fp8_recipe=recipe):
                y = lin(x)
        g = tape.gradient(y, [x, lin.weight, lin.bias], output_grad=dy)
        np.testing.assert_allclose(asnp(y), asnp(y_hp), **E4M3_TOL)
        for a, b in zip(g, g_hp):
            # E5M2 gradients: TE's E5M2 tolerance, relative to the gradient's scale
            s = float(abs(asnp(b)).max())
            np.testing.assert_allclose(asnp(a) / s, asnp(b) / s, rtol=0.25, atol=0.125)


def test_fp8_matches_emulation_exactly(rng):
    """The FP8 forward equals the cast-then-matmul emulation with the state's scales."""
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=4)
    x = data(np, rng, 16, 32)
    r = DelayedScaling(amax_history_len=2)
    with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
        lin(x)
    sx, sw = lin.fp8_state.fwd.scale[:2].copy()  # the scales the second step casts with
    assert sx != 1 and sw != 1
    with tecupy.fp8_autocast(fp8_recipe=r):
        y = lin(x)
    qx = tecupy.quantize(x, np.float32(sx), "e4m3").dequantize()
    qw = tecupy.quantize(lin.weight, np.float32(sw), "e4m3").dequantize()
    np.testing.assert_allclose(y, qx @ qw.T + lin.bias, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", list(TABLE))
def test_fp8_layernorm_mlp_close_to_high_precision(xp, rng, activation):
    dev = "cpu" if xp is np else "cuda"
    mlp = tecupy.nn.LayerNormMLP(64, 96, activation=activation, device=dev, seed=5)
    x = data(xp, rng, 32, 64)
    y_hp = mlp(x)
    r = DelayedScaling(amax_history_len=4)
    for _ in range(2):
        with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
            y = mlp(x)
    assert mlp.fp8_state.num_gemms == 2
    assert np.all(asnp(mlp.fp8_state.fwd.scale)[[0, 1, 3, 4]] != 1)
    np.testing.assert_allclose(asnp(y), asnp(y_hp), **E4M3_TOL)
    err = np.linalg.norm(asnp(y) - asnp(y_hp)) / np.linalg.norm(asnp(y_hp))
    assert err < 0.1


def test_explicit_state_for_functional_calls(rng):
    x, w = data(np, rng, 16, 32), data(np, rng, 16, 32)
    st = tecupy.FP8State(num_gemms=1)
    with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3)):
        tecupy.linear(x, w, fp8_state=st)
    assert st.fwd.amax_history.shape == (3, 3)
    np.testing.assert_allclose(st.fwd.scale[0], 448 / np.abs(x).max(), rtol=1e-6)


def test_fp8_shape_rule_is_a_clear_error(rng):
    x, w = data(np, rng, 12, 32), data(np, rng, 16, 32)
    with tecupy.fp8_autocast():
        with pytest.raises(ValueError, match="multiples of 16.*M=12, N=16, K=32"):
            tecupy.linear(x, w)
        with pytest.raises(ValueError, match="K=24"):
            tecupy.linear(data(np, rng, 16, 24), data(np, rng, 16, 24))


def test_bad_recipe_type():
    with pytest.raises(TypeError, match="DelayedScaling, Float8CurrentScaling or "
                       "Float8BlockScaling"):
        with tecupy.fp8_autocast(fp8_recipe="hybrid"):
            pass


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_fused_norm_fp8_matches_unfused(xp, rng, normalization):
    """Under delayed scaling the norm casts its output to FP8 in its own pass; results and
    state equal those of norm, then linear."""
    x, dy = data(xp, rng, 2, 16, 64), data(xp, rng, 2, 16, 48)
    w, b = data(xp, rng, 48, 64) * 0.1, data(xp, rng, 48)
    g, beta = data(xp, rng, 64), (data(xp, rng, 64) if normalization == "LayerNorm" else None)
    r = DelayedScaling(amax_history_len=3)
    states, results = [tecupy.FP8State(), tecupy.FP8State()], []
    for fused, st in zip((True, False), states):
        for _ in range(2):  # the second step runs with scales from the first
            with tecupy.Tape() as tape:
                with tecupy.fp8_autocast(fp8_recipe=r):
                    if fused:
                        y = tecupy.layernorm_linear(x, g, beta, w, b, normalization=normalization,
                                                    fp8_state=st)
                    else:
                        ln = tecupy.ops.normalize(x, g, beta, 1e-5, False, normalization)
                        y = tecupy.linear(ln, w, b, fp8_state=st)
            grads = tape.gradient(y, [t for t in (x, g, beta, w, b) if t is not None],
                                  output_grad=dy)
        results.append([asnp(y)] + [asnp(t) for t in grads])
    for a, c in zip(*results):
        np.testing.assert_allclose(a, c, rtol=2e-5, atol=2e-5)
    for name in ("scale", "amax_history"):
        np.testing.assert_allclose(asnp(getattr(states[0].fwd, name)),
                                   asnp(getattr(states[1].fwd, name)), rtol=1e-6)


@pytest.mark.parametrize("activation", list(TABLE))
def test_fused_mlp_fp8_matches_unfused(xp, rng, activation):
    """layernorm_mlp under delayed scaling (norm and activation casting their outputs to
    FP8 in their own passes) equals the composition of the separate ops."""
    hid, ffn = 32, 48
    f1 = ffn * (2 if TABLE[activation].gated else 1)
    x, dy = data(xp, rng, 32, hid), data(xp, rng, 32, hid)
    g, beta = data(xp, rng, hid), data(xp, rng, hid)
    w1, b1 = data(xp, rng, f1, hid) * 0.2, data(xp, rng, f1)
    w2, b2 = data(xp, rng, hid, ffn) * 0.2, data(xp, rng, hid)
    params = [x, g, beta, w1, b1, w2, b2]
    r = DelayedScaling(amax_history_len=2)
    out = []
    for fused in (True, False):
        st = tecupy.FP8State(num_gemms=2)
        for _ in range(2):
            with tecupy.Tape() as tape:
                with tecupy.fp8_autocast(fp8_recipe=r):
                    if fused:
                        y = tecupy.layernorm_mlp(x, g, beta, w1, b1, w2, b2,
                                                 activation=activation, fp8_state=st)
                    else:
                        ln = tecupy.layernorm(x, g, beta)
                        h = tecupy.linear(ln, w1, b1, fp8_state=st, gemm_index=0)
                        y = tecupy.linear(tecupy.activation(h, activation), w2, b2,
                                          fp8_state=st, gemm_index=1)
            grads = tape.gradient(y, params, output_grad=dy)
        out.append([asnp(y)] + [asnp(t) for t in grads] + [asnp(st.fwd.scale)])
    for a, c in zip(*out):
        np.testing.assert_allclose(a, c, rtol=1e-4, atol=1e-4)


def test_backward_uses_the_scales_of_its_forward(rng):
    """The forward update at autocast exit changes the state's scales before backward runs;
    gradients must still dequantize with the scales the forward cast used."""
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=6)
    x, dy = data(np, rng, 16, 32), data(np, rng, 16, 16)
    r = DelayedScaling(amax_history_len=1)
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(fp8_recipe=r):
            y = lin(x)  # first call: scale 1
    assert np.all(lin.fp8_state.fwd.scale[:2] != 1)  # updated at exit, before backward
    dx = tape.gradient(y, x, output_grad=dy)
    qw = tecupy.quantize(lin.weight, 1.0, "e4m3").dequantize()
    qdy = tecupy.quantize(dy, 1.0, "e5m2").dequantize()
    np.testing.assert_allclose(dx, qdy @ qw, rtol=1e-5, atol=1e-6)


def test_forward_state_updates_only_while_a_tape_records(xp, rng):
    """Transformer Engine updates forward FP8 meta at the outermost autocast exit only when
    gradients are enabled (transformer_engine/pytorch/quantization.py, autocast_exit:
    `torch.is_grad_enabled()`); the amax an inference pass writes into row 0 stays there and
    the next training step's update takes it in."""
    dev = "cpu" if xp is np else "cuda"
    lin = tecupy.nn.Linear(32, 16, device=dev, seed=7)
    r = DelayedScaling(amax_history_len=4)
    x_big, x = data(xp, rng, 16, 32) * 8, data(xp, rng, 16, 32)
    lin.eval()
    with tecupy.fp8_autocast(fp8_recipe=r):  # no Tape: inference
        lin(x_big)
    st = lin.fp8_state
    hist = asnp(st.fwd.amax_history)
    assert np.all(asnp(st.fwd.scale) == 1) and np.all(hist[1:] == 0)
    assert hist[0, 0] == np.float32(np.abs(asnp(x_big)).max())  # kept, not rolled
    lin.train()
    with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
        lin(x)
    hist = asnp(st.fwd.amax_history)
    assert np.all(hist[0] == 0)
    assert hist[-1, 0] == np.float32(np.abs(asnp(x_big)).max())  # the inference amax counts
    assert asnp(st.fwd.scale)[0] == np.float32(448) / hist[-1, 0]


def test_tape_opened_inside_the_autocast_counts(rng):
    """Whether a state is updated is decided when it is used (a Tape recording then), so a
    Tape opened inside the autocast and closed before its exit still updates."""
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=8)
    with tecupy.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=2)):
        with tecupy.Tape():
            lin(data(np, rng, 16, 32))
    assert np.all(lin.fp8_state.fwd.scale[:2] != 1)


def test_disabled_outermost_autocast_does_not_update(rng):
    """TE's autocast_exit updates only when the exiting outermost autocast is enabled."""
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=9)
    r = DelayedScaling(amax_history_len=2)
    with tecupy.Tape(), tecupy.fp8_autocast(enabled=False):
        with tecupy.fp8_autocast(fp8_recipe=r):
            lin(data(np, rng, 16, 32))
    assert np.all(lin.fp8_state.fwd.scale == 1) and np.all(lin.fp8_state.fwd.amax_history[0, :2])


def test_nested_autocast_with_another_format_keeps_history(rng):
    """A recipe with another fp8_format keeps the module's scales and amax history and only
    changes the format and fp8_max (transformer_engine/pytorch/module/base.py: set_meta_tensor
    returns early for an existing delayed-scaling state, adjusting the history length;
    init_fp8_metadata sets fp8_max_fwd/bwd from the new recipe)."""
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=10)
    x = data(np, rng, 16, 32)
    hybrid = DelayedScaling(amax_history_len=4)
    e4m3 = DelayedScaling(amax_history_len=4, fp8_format=Format.E4M3)
    with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=hybrid):
        lin(x)
    st = lin.fp8_state
    fwd_meta, hist, scale = st.fwd, st.fwd.amax_history.copy(), st.fwd.scale.copy()
    with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=hybrid):
        with tecupy.fp8_autocast(fp8_recipe=e4m3):
            assert st.fwd is fwd_meta  # not re-created
            y = lin(x)
            np.testing.assert_array_equal(st.fwd.amax_history[1:], hist[1:])
            np.testing.assert_array_equal(st.fwd.scale, scale)  # this step cast with them
            assert st.bwd.fmt is tecupy.fp8.E4M3 and np.all(st.bwd.fp8_max == 448)
    np.testing.assert_array_equal(st.fwd.amax_history[1:-1], hist[2:])  # rolled on, kept
    assert st.fp8_format is Format.E4M3 and st.recipe is e4m3
    qx = tecupy.quantize(x, np.float32(scale[0]), "e4m3").dequantize()
    qw = tecupy.quantize(lin.weight, np.float32(scale[1]), "e4m3").dequantize()
    np.testing.assert_allclose(y, qx @ qw.T + lin.bias, rtol=1e-5, atol=1e-6)
    with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=hybrid):  # and back
        lin(x)
    assert st.bwd.fmt is tecupy.fp8.E5M2 and np.all(st.bwd.fp8_max == 57344)


def test_history_length_change_keeps_first_rows(rng):
    """TE's adjust_amax_history_length (module/base.py): shorter keeps the first rows,
    longer pads zeros at the end."""
    st = tecupy.FP8State()
    st.bind(np, DelayedScaling(amax_history_len=3))
    st.fwd.amax_history[...] = np.arange(9, dtype=np.float32).reshape(3, 3)
    st.bind(np, DelayedScaling(amax_history_len=2))
    np.testing.assert_array_equal(st.fwd.amax_history, [[0, 1, 2], [3, 4, 5]])
    st.bind(np, DelayedScaling(amax_history_len=4))
    np.testing.assert_array_equal(st.fwd.amax_history, [[0, 1, 2], [3, 4, 5], [0] * 3, [0] * 3])


@pytest.mark.parametrize("enabled", ["False", None, 2])
def test_enabled_must_be_a_bool(enabled):
    with pytest.raises(TypeError, match="fp8_autocast: enabled must be True or False"):
        with tecupy.fp8_autocast(enabled=enabled):
            pass
    from tecupy.autocast import active_recipe
    assert active_recipe() is None


def test_arguments_checked_when_called_and_nothing_pushed():
    """A bad recipe fails at the call, before any `with`, and leaves no autocast open; the
    TE 2.x spelling names its own argument."""
    from tecupy.autocast import active_recipe
    with pytest.raises(TypeError, match="autocast: recipe must be None, a tecupy.recipe"):
        tecupy.autocast(recipe="x")
    with pytest.raises(TypeError, match="fp8_autocast: fp8_recipe must be None"):
        tecupy.fp8_autocast(fp8_recipe=DelayedScaling)  # the class, not a recipe
    assert active_recipe() is None
    with tecupy.autocast(recipe=DelayedScaling(margin=1)):
        assert active_recipe().margin == 1


def test_autocast_works_as_a_decorator():
    from tecupy.autocast import active_recipe
    recipe = DelayedScaling()

    @tecupy.fp8_autocast(fp8_recipe=recipe)
    def inside():
        return active_recipe()
    assert inside() is recipe and inside() is recipe and active_recipe() is None


def test_fp8_state_takes_numpy_ints():
    st = tecupy.FP8State(np.int64(2))
    assert st.num_gemms == 2 and type(st.num_gemms) is int

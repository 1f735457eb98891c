"""The residual add in the FP8 GEMM's epilogue (issue 21): linear(x, residual=r) and
layernorm_mlp(x, residual=...) give the bits of linear then add (forward, gradients, the FP8
state after two steps), in high precision and FP8 (delayed, current and block scaling), with and
without bias; the FP8 forward launches no add where the epilogue took the residual. On NumPy
(the reference's two roundings) and, where a GPU is present, CuPy (the kernel's)."""
import contextlib
import importlib

import numpy as np
import pytest

import tecupy
from tecupy import nn
from tecupy.recipe import DelayedScaling, Float8BlockScaling, Float8CurrentScaling

from conftest import bf16_array, count_dispatches, same_bits

linear_op = importlib.import_module("tecupy.ops.linear")


@pytest.fixture(autouse=True)
def _block_epilogue(monkeypatch):
    """Block scaling's GEMM takes the residual too, though off by default (slower than the
    add on an H100): its epilogue is held to the same bits here."""
    from tecupy.quantization import BlockQuantizer
    monkeypatch.setattr(BlockQuantizer, "residual_epilogue", True)
RECIPES = {"hp": None, "delayed": DelayedScaling, "current": Float8CurrentScaling,
           "block": Float8BlockScaling}
M, K, N, FFN = 32, 48, 64, 96  # FP8 GEMM dims: multiples of 16


def _autocast(recipe):
    if RECIPES[recipe] is None:
        return contextlib.nullcontext()
    return tecupy.fp8_autocast(fp8_recipe=RECIPES[recipe]())


def _steps(fn, arrays, recipe, dy, steps=2):
    """Run fn(*arrays, state) forward and backward `steps` times under `recipe` -> outputs
    and gradients of every step, and the add/residual calls of the forwards."""
    state = tecupy.FP8State(num_gemms=2)
    got = []
    with count_dispatches(("add_fwd",), "residual") as calls:
        for _ in range(steps):
            with tecupy.Tape() as tape:
                with _autocast(recipe):
                    y = fn(*arrays, state)
                counted = dict(calls)
                got.append((y, tape.gradient(y, [a for a in arrays if a is not None],
                                             output_grad=dy)))
    return got, counted


def _compare(fused, plain):
    for step, ((yf, gf), (yp, gp)) in enumerate(zip(fused, plain)):
        same_bits(yf, yp, f"step {step}: y")
        for i, (a, b) in enumerate(zip(gf, gp)):
            same_bits(a, b, f"step {step}: gradient {i}")


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_linear_residual_is_linear_then_add(xp, rng, recipe, bias):
    x, w = bf16_array(xp, rng, 2, M // 2, K), bf16_array(xp, rng, N, K, scale=0.2)
    r = bf16_array(xp, rng, 2, M // 2, N)
    b = bf16_array(xp, rng, N) if bias else None
    dy = bf16_array(xp, rng, 2, M // 2, N)

    def fused(x, w, r, b, st):
        return tecupy.linear(x, w, b, fp8_state=st, residual=r)

    def plain(x, w, r, b, st):
        return tecupy.add(tecupy.linear(x, w, b, fp8_state=st), r)
    got, calls = _steps(fused, (x, w, r, b), recipe, dy)
    want, _ = _steps(plain, (x, w, r, b), recipe, dy)
    _compare(got, want)
    if recipe == "hp":  # high precision: linear, then add
        assert calls["add_fwd"] == 2 and "residual" not in calls
    else:  # FP8: the GEMM's epilogue adds (no add kernel in the forward)
        assert calls["add_fwd"] == 0 and calls["residual"] == 2


@pytest.mark.parametrize("own", [True, False], ids=["x", "other"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_layernorm_mlp_residual_is_mlp_then_add(xp, rng, recipe, bias, own):
    """residual x (the pre-norm block's: its dy joins x's gradient in the norm's pass) or
    another array; delayed scaling runs the one-node block, current scaling the composed
    one (fc2 as act_then_linear's node)."""
    x, g, beta = bf16_array(xp, rng, M, K), bf16_array(xp, rng, K), bf16_array(xp, rng, K)
    w1, w2 = bf16_array(xp, rng, FFN, K, scale=0.2), bf16_array(xp, rng, K, FFN, scale=0.2)
    b1, b2 = (bf16_array(xp, rng, FFN), bf16_array(xp, rng, K)) if bias else (None, None)
    r = x if own else bf16_array(xp, rng, M, K)
    dy = bf16_array(xp, rng, M, K)

    def mlp(x, st, residual):
        return tecupy.layernorm_mlp(x, g, beta, w1, b1, w2, b2, fp8_state=st,
                                    residual=residual)

    if own:
        def fused(x, st):
            return mlp(x, st, x)

        def plain(x, st):
            return tecupy.add(mlp(x, st, None), x)
    else:
        def fused(x, r, st):
            return mlp(x, st, r)

        def plain(x, r, st):
            return tecupy.add(mlp(x, st, None), r)
    arrays = (x,) if own else (x, r)
    got, calls = _steps(fused, arrays, recipe, dy)
    want, _ = _steps(plain, arrays, recipe, dy)
    _compare(got, want)
    assert calls["add_fwd"] == (2 if recipe == "hp" else 0)


def test_switch_off_runs_linear_then_add(rng, monkeypatch):
    monkeypatch.setattr(linear_op, "RESIDUAL_EPILOGUE", False)
    x, w = bf16_array(np, rng, M, K), bf16_array(np, rng, N, K, scale=0.2)
    r = bf16_array(np, rng, M, N)
    with count_dispatches(("add_fwd",), "residual") as calls, _autocast("delayed"):
        y = tecupy.linear(x, w, fp8_state=tecupy.FP8State(), residual=r)
    assert calls["add_fwd"] == 1 and "residual" not in calls
    monkeypatch.setattr(linear_op, "RESIDUAL_EPILOGUE", True)
    with _autocast("delayed"):
        same_bits(tecupy.linear(x, w, fp8_state=tecupy.FP8State(), residual=r), y, "y")


def test_other_residuals_are_added_after(rng):
    """A broadcast or non-contiguous residual: linear, then the add op."""
    x, w = bf16_array(np, rng, M, K), bf16_array(np, rng, N, K, scale=0.2)
    for r in (bf16_array(np, rng, N), bf16_array(np, rng, N, M).T):
        with count_dispatches(("add_fwd",), "residual") as calls, _autocast("delayed"):
            y = tecupy.linear(x, w, fp8_state=tecupy.FP8State(), residual=r)
        with _autocast("delayed"):
            want = tecupy.add(tecupy.linear(x, w, fp8_state=tecupy.FP8State()), r)
        assert calls["add_fwd"] == 1 and "residual" not in calls
        same_bits(y, want, "y")


def test_reference_gemm_residual_rounds_twice(rng):
    """The reference epilogue: out_dtype(out_dtype(acc + bias) + residual), as the GEMM then
    the add op (one rounding would differ: checked to be exercised)."""
    from tecupy.fp8 import E4M3
    from tecupy.reference.elementwise import add_fwd
    from tecupy.reference.fp8 import cast_to_fp8, fp8_gemm
    one = np.ones(1, np.float32)
    a = cast_to_fp8(rng.standard_normal((M, K)).astype(np.float32), one, E4M3)[0]
    b = cast_to_fp8(rng.standard_normal((N, K)).astype(np.float32), one, E4M3)[0]
    for out in (tecupy.bfloat16, np.float16):
        bias = rng.standard_normal(N).astype(out)
        r = (rng.standard_normal((M, N)) * 100).astype(out)
        got = fp8_gemm(a, E4M3, one, b, E4M3, one, out, bias, residual=r)
        want = add_fwd(fp8_gemm(a, E4M3, one, b, E4M3, one, out, bias), r)
        same_bits(got, want, str(out))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_modules_take_a_residual(xp, rng, recipe):
    """nn.Linear and nn.LayerNormMLP: forward(x, residual) is forward(x) + residual; two
    modules of one seed (same parameters), one fused, one not."""
    dev = "cpu" if xp is np else "cuda"
    seed = int(rng.integers(0, 2**62))
    x, dy = bf16_array(xp, rng, M, K), bf16_array(xp, rng, M, K)
    outs = []
    for fused in (True, False):
        lin = nn.Linear(K, K, params_dtype=tecupy.bfloat16, device=dev, seed=seed)
        mlp = nn.LayerNormMLP(K, FFN, params_dtype=tecupy.bfloat16, device=dev, seed=seed)
        for p in list(lin.named_parameters().values()) + list(
                mlp.named_parameters().values()):
            p[...] = xp.asarray(rng.standard_normal(p.shape).astype(p.dtype) * 0.2) \
                if fused else p
        if fused:
            params = [p.copy() for p in list(lin.named_parameters().values())
                      + list(mlp.named_parameters().values())]
        else:
            for p, q in zip(list(lin.named_parameters().values())
                            + list(mlp.named_parameters().values()), params):
                p[...] = q
        with tecupy.Tape() as tape:
            with _autocast(recipe):
                if fused:
                    h = lin(x, residual=x)
                    y = mlp(h, residual=h)
                else:
                    h = tecupy.add(lin(x), x)
                    y = tecupy.add(mlp(h), h)
            outs.append((y, tape.gradient(y, [x], output_grad=dy)))
    _compare([outs[0]], [outs[1]])


def _linear_steps(monkeypatch, kept, fuse, steps=3):
    """y, the gradients and the FP8 state after `steps` steps of a bf16 FP8 nn.Linear with a
    residual (two forwards per autocast: the second one by the kept plan where on)."""
    import cupy
    monkeypatch.setattr(linear_op, "KEPT", kept)
    monkeypatch.setattr(linear_op, "_kept", {})
    monkeypatch.setattr(linear_op, "RESIDUAL_EPILOGUE", fuse)
    r = DelayedScaling(amax_history_len=4)
    lin = nn.Linear(512, 256, params_dtype=tecupy.bfloat16, seed=0, device="cuda")
    rng = np.random.default_rng(1)
    out = []
    for _ in range(steps):
        x, res, dy = (cupy.asarray(rng.standard_normal(s).astype(tecupy.bfloat16))
                      for s in ((256, 512), (256, 256), (256, 256)))
        with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=r):
            y = lin(x, residual=res)
            y2 = lin(x, residual=res)
        grads = tape.gradient([y, y2], [x, res] + lin.parameters(), output_grad=[dy, dy])
        out += [y, y2] + grads
    state = lin.fp8_state
    out += [state.fwd.scale, state.fwd.amax_history, state.bwd.scale, state.bwd.amax_history]
    assert (len(linear_op._kept) > 0) == kept
    if kept:
        assert all(p for p in linear_op._kept.values()), "the plan with a residual is kept"
    return [cupy.asnumpy(a) for a in out]


@pytest.mark.gpu
def test_kept_plan_with_a_residual_gives_the_same_bits(monkeypatch):
    """The FP8 linear with a residual: kept plan off/on, epilogue off/on: the same bits."""
    want = _linear_steps(monkeypatch, False, False)
    for kept, fuse in ((False, True), (True, True), (True, False)):
        got = _linear_steps(monkeypatch, kept, fuse)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and np.array_equal(g.view(np.uint8), w.view(np.uint8))


def _fake_launches(monkeypatch, kept, steps=3):
    """The launches of the last of `steps` forwards of an FP8 nn.Linear with a residual on
    faked CuPy (test_host_path's recorder), addresses numbered."""
    from test_host_path import fake_launches, numbered
    r = DelayedScaling(amax_history_len=4)
    with fake_launches(monkeypatch, kept) as (host, cupy, launched):
        lin, x = host.make(cupy, True)
        res = cupy.asarray(np.ones((host.M, host.N), tecupy.bfloat16))
        for _ in range(steps):
            del launched[:]
            with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
                y = lin(x, residual=res)
            assert (y.shape, y.dtype) == ((host.M, host.N), tecupy.bfloat16)
    return numbered(launched)


def test_kept_plan_with_a_residual_launches_the_epilogue(monkeypatch):
    """Faked CuPy: the FP8 linear with a residual launches 2 casts and the GEMM with the
    residual epilogue (EPI 5: bias + residual), no add, then the update; the kept plan
    launches the same."""
    general = _fake_launches(monkeypatch, False)
    kept = _fake_launches(monkeypatch, True)
    assert [k[0].split("<")[0] for k in kept] == ["cast_transpose_tiled"] * 2 + [
        "tc::fp8_gemm_tn", "delayed_scaling_update"]
    assert ", 5, false, false>" in kept[2][0] and len(linear_op._kept) == 1
    assert kept[2][4][6] != kept[2][4][5]  # aux: the residual, not D
    from tecupy.kernels import fp8_gemm as gemm_kernels
    monkeypatch.setattr(gemm_kernels, "RESIDUAL_PREFETCH", False)  # EPI 7: no L2 prefetch
    assert ", 7, false, false>" in _fake_launches(monkeypatch, True)[2][0]
    assert all(linear_op._kept.values()) and kept == general


# ---- the TransformerLayer (nn/transformer.py, nn/attention.py) ---------------------------

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_transformer_layer_residual_epilogue_gives_the_adds_bits(xp, rng, monkeypatch,
                                                                 recipe, bias):
    """Two training steps of a TransformerLayer (no hidden dropout) with the residual adds
    in the GEMM epilogues (RESIDUAL_EPILOGUE) and as add ops: outputs, input and parameter
    gradients equal bit for bit; under FP8 the fused forward launches no add."""
    dev = "cpu" if xp is np else "cuda"
    seed = int(rng.integers(0, 2**62))
    x, dy = bf16_array(xp, rng, 16, 2, K), bf16_array(xp, rng, 16, 2, K)
    runs = []
    for fused in (True, False):
        monkeypatch.setattr(linear_op, "RESIDUAL_EPILOGUE", fused)
        tl = nn.TransformerLayer(K, FFN, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                 bias=bias, params_dtype=tecupy.bfloat16, device=dev,
                                 seed=seed)
        got = []
        with count_dispatches(("add_fwd",), "residual") as calls:
            for _ in range(2):
                with tecupy.Tape() as tape:
                    with _autocast(recipe):
                        y = tl(x)
                    adds = calls["add_fwd"]
                    grads = tape.gradient(y, {"x": x, **tl.named_parameters()},
                                          output_grad=dy)
                got.append((y, [grads[k] for k in sorted(grads)]))
        if fused and recipe != "hp":
            assert adds == 0 and calls["residual"] == 4
        else:
            assert adds == 4
        runs.append(got)
    _compare(*runs)

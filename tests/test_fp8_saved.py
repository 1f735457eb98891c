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


def _mlp_inputs():
    """x [32, 48], LayerNorm's gamma and beta, fc1 [64, 48], fc2 [48, 64] (float32)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 48)).astype(np.float32)
    g, b = np.ones(48, np.float32), np.zeros(48, np.float32)
    w1 = rng.standard_normal((64, 48)).astype(np.float32) * 0.1
    w2 = rng.standard_normal((48, 64)).astype(np.float32) * 0.1
    return x, g, b, w1, w2


def test_mlp_releases_fc2_input_codes_before_the_activation_backward(monkeypatch):
    x, g, b, w1, w2 = _mlp_inputs()
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


def _gemm_operands(monkeypatch, watch=lambda op, args, out: args[3] if op == "fp8_gemm"
                   else None):
    """At each FP8 GEMM, whether each array `watch` picked so far is alive (default: the B
    operand, codes, of each earlier GEMM; watch(op, args, out) -> an array or None)."""
    refs, alive = [], []
    real = backends.dispatch

    def dispatch(op, *args, **kwargs):
        if op == "fp8_gemm":
            gc.collect()
            alive.append([r() is not None for r in refs])
        out = real(op, *args, **kwargs)
        picked = watch(op, args, out)
        if picked is not None:
            refs.append(weakref.ref(picked))
        return out
    monkeypatch.setattr(backends, "dispatch", dispatch)
    return alive


def test_linear_backward_drops_x_copy_before_dgrad(monkeypatch):
    """wgrad first, then x's column-wise copy dies, then dgrad allocates its output."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 48)).astype(np.float32)
    w = rng.standard_normal((64, 48)).astype(np.float32) * 0.1
    alive = _gemm_operands(monkeypatch)
    state = tecupy.FP8State()
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=DelayedScaling()):
        y = tecupy.linear(x, w, fp8_state=state)
    tape.gradient(y, [x, w], output_grad=np.ones_like(y))
    # forward (B: w's codes), wgrad (B: x's copy), dgrad (B: w's copy)
    assert len(alive) == 3 and alive[2][1] is False


def test_mlp_fc2_activation_codes_die_before_its_dgrad(monkeypatch):
    """The activation's row-wise codes die once transposed (before fc2's backward GEMMs);
    the transposed copy once wgrad read it (before dgrad)."""
    x, g, b, w1, w2 = _mlp_inputs()
    refs, alive = _watch(monkeypatch, "gelu_fwd", "fp8_gemm")
    grads = _gemm_operands(monkeypatch)
    _step(lambda *a, fp8_state: tecupy.layernorm_mlp(*a, fp8_state=fp8_state), x, g, b, w1,
          None, w2, None)
    # GEMMs: fc1 fwd, fc2 fwd, fc2 wgrad, fc2 dgrad, fc1 wgrad, fc1 dgrad
    assert alive == [0, 1, 0, 0, 0, 0]
    assert grads[3][2] is False  # fc2's wgrad B (the activation's copy) dead at its dgrad


def test_mlp_dgelu_epilogue_path_equals_the_activation_cast_path(monkeypatch):
    """bf16 gelu: fc2's dgrad applies gelu' in its epilogue (h dies before dh's cast); the
    reference gives the same gradients bit for bit as the one-pass dact cast path."""
    from tecupy.ops import blocks
    rng = np.random.default_rng(0)
    bf16 = tecupy.bfloat16
    x = rng.standard_normal((32, 48)).astype(bf16)
    g, b = np.ones(48, bf16), np.zeros(48, bf16)
    w1 = (rng.standard_normal((64, 48)) * 0.1).astype(bf16)
    b1 = (rng.standard_normal(64) * 0.1).astype(bf16)
    w2 = (rng.standard_normal((48, 64)) * 0.1).astype(bf16)

    def grads():
        return _step(lambda *a, fp8_state: tecupy.layernorm_mlp(*a, fp8_state=fp8_state),
                     x, g, b, w1, b1, w2, None)
    monkeypatch.setattr(blocks, "DGELU_EPILOGUE", (bf16,))
    seen = []
    real = backends.dispatch
    monkeypatch.setattr(backends, "dispatch", lambda op, *a, **k: (
        seen.append("dgelu_aux" in k), real(op, *a, **k))[1])
    with_epilogue = grads()
    assert any(seen)
    monkeypatch.setattr(blocks, "DGELU_EPILOGUE", ())
    seen.clear()
    without = grads()
    assert not any(seen)
    for got, want in zip(with_epilogue, without):
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def test_mlp_dgrad_and_dact_in_column_chunks(monkeypatch, xp):
    """fc2's dgrad output [M, ffn] made and cast in column chunks (DACT_CHUNK_BYTES; issue 22:
    one chunk at a time in memory): the same gradients, FP8 state and amax history, bit for
    bit, as in one piece; 6 chunks of 64 columns and a last one of 16 (ffn 400)."""
    from tecupy.ops import blocks
    rng = np.random.default_rng(2)
    dt = tecupy.bfloat16 if xp.__name__ == "cupy" else np.float32
    m, hidden, ffn = 48, 32, 400
    arrays = [xp.asarray(a.astype(dt)) for a in (
        rng.standard_normal((m, hidden)), np.ones(hidden), np.zeros(hidden),
        rng.standard_normal((ffn, hidden)) * 0.1, rng.standard_normal(ffn) * 0.1,
        rng.standard_normal((hidden, ffn)) * 0.1, rng.standard_normal(hidden) * 0.1)]

    def run():
        state = tecupy.FP8State(num_gemms=2)
        dy = xp.asarray(rng.standard_normal((m, hidden)).astype(dt))
        with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=DelayedScaling()):
            y = tecupy.layernorm_mlp(*arrays, fp8_state=state)
        grads = tape.gradient(y, arrays, output_grad=dy)
        return [np.asarray(tecupy._array.to_numpy(a)) for a in (
            *grads, state.bwd.amax_history, state.bwd.scale)]
    widths = []
    real = backends.dispatch

    def dispatch(op, *a, **k):
        if op == "dact_cast_transpose":
            widths.append(a[0].shape[1])
        return real(op, *a, **k)
    monkeypatch.setattr(backends, "dispatch", dispatch)
    rng = np.random.default_rng(3)
    whole = run()
    assert widths == [ffn]
    monkeypatch.setattr(blocks, "DACT_CHUNK_BYTES", m * 64 * np.dtype(dt).itemsize + 1)
    widths.clear()
    rng = np.random.default_rng(3)
    chunked = run()
    assert widths == [64] * 6 + [16]
    for got, want in zip(chunked, whole):
        assert got.tobytes() == want.tobytes()


def test_dy_copy_dies_after_wgrad(monkeypatch):
    """dy's column-wise codes (wgrad's A operand) die once wgrad has run, before dgrad
    allocates: in a linear and in layernorm_mlp (fc2's dy, and fc1's dh cast)."""
    casts = ("cast_transpose", "cast_transpose_dbias", "dact_cast_transpose")

    def run(fn, *arrays):  # the column-wise copy of each cast
        real = backends.dispatch
        alive = _gemm_operands(monkeypatch, lambda op, args, out: out[1] if op in casts
                               else None)
        _step(fn, *arrays)
        monkeypatch.setattr(backends, "dispatch", real)
        return alive
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 48)).astype(np.float32)
    w = rng.standard_normal((64, 48)).astype(np.float32) * 0.1
    alive = run(lambda *a, fp8_state: tecupy.linear(*a, fp8_state=fp8_state), x, w)
    # casts: x, w (forward), dy (backward); GEMMs: forward, wgrad, dgrad
    assert alive[1] == [True, True, True] and alive[2][2] is False
    x, g, b, w1, w2 = _mlp_inputs()
    alive = run(lambda *a, fp8_state: tecupy.layernorm_mlp(*a, fp8_state=fp8_state),
                x, g, b, w1, None, w2, None)
    # casts: w1, w2 (forward), fc2's dy, fc1's dh; GEMMs: fc1, fc2, fc2 wgrad, fc2 dgrad,
    # fc1 wgrad, fc1 dgrad
    assert alive[3][2] is False and alive[4][3] is True and alive[5][3] is False


def test_mlp_activation_cast_writes_wgrad_copy(monkeypatch):
    """Delayed scaling: the activation's cast writes fc2's input codes and their column-wise
    copy in one pass (act_cast_transpose), and the node keeps only that copy: the backward
    transposes the norm's codes only (one fp8_transpose where the row-wise path has two);
    every gradient bit for bit the row-wise path's (quantize_act's transpose off)."""
    from tecupy.quantization import DelayedQuantizer
    x, g, b, w1, w2 = _mlp_inputs()
    mlp = lambda *a, fp8_state: tecupy.layernorm_mlp(*a, fp8_state=fp8_state)  # noqa: E731
    ops, real = [], backends.dispatch

    def spy(op, *args, **kwargs):
        ops.append(op)
        return real(op, *args, **kwargs)
    monkeypatch.setattr(backends, "dispatch", spy)
    both = _step(mlp, x, g, b, w1, None, w2, None)
    assert ops.count("act_cast_transpose") == 1 and ops.count("fp8_transpose") == 1
    real_act = DelayedQuantizer.quantize_act
    monkeypatch.setattr(DelayedQuantizer, "quantize_act",
                        lambda self, h, bias, name, transpose=False:
                        real_act(self, h, bias, name, False))
    ops.clear()
    rowwise = _step(mlp, x, g, b, w1, None, w2, None)
    assert ops.count("act_cast_transpose") == 0 and ops.count("fp8_transpose") == 2
    for got, want in zip(both, rowwise):
        assert got.tobytes() == want.tobytes()

"""Optimizer.step_in_backward (issue 22): each parameter updated as soon as its gradient is
final, that gradient then freed. On the CPU: bit-identical to tape.gradient + step over N
steps (AdamW, SGD, a schedule; plain, FP8, checkpoint, FP8 weights), the gradients freed as
they are applied, and the errors; on the GPU (marked gpu) the fused kernels one tensor at a
time against the fused step, and the pool's peak."""
import weakref

import numpy as np
import pytest

import tecupy
from tecupy.optim import SGD, AdamW, WarmupCosine
from tecupy.recipe import DelayedScaling

from conftest import asnp

gpu = pytest.mark.gpu

OPTIMIZERS = {
    "adamw": lambda p: AdamW(p, lr=1e-2, weight_decay=0.1),
    "adamw_schedule": lambda p: AdamW(p, schedule=WarmupCosine(1e-2, 2, 5, 1e-3)),
    "sgd_nesterov": lambda p: SGD(p, lr=1e-2, momentum=0.9, weight_decay=0.01,
                                  nesterov=True),
}
# (FP8 autocast, tecupy.checkpoint around each layer, FP8 weights)
MODES = {"high precision": (False, False, False), "fp8": (True, False, False),
         "fp8 checkpoint": (True, True, False), "fp8 weights": (True, False, True),
         "fp8 weights checkpoint": (True, True, True)}


def _recipe():
    return DelayedScaling(amax_history_len=4)


def _stack(w8, device="cpu", dtype=np.float32, n=2, size=(32, 64, 2)):
    """n small TransformerLayers (hidden, ffn, heads = size; FP8 weights where w8) and their
    parameters by name."""
    with tecupy.quantized_model_init(enabled=w8, recipe=_recipe()):
        layers = [tecupy.nn.TransformerLayer(*size, device=device, seed=3 + k,
                                             params_dtype=dtype) for k in range(n)]
    params = {f"{k}.{name}": p for k, layer in enumerate(layers)
              for name, p in layer.named_parameters().items()}
    return layers, params


def _forward(layers, x, fp8, ckpt, recipe):
    with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
        h = x
        for layer in layers:
            h = tecupy.checkpoint(layer, h) if ckpt else layer(h)
    return tape, h


def _data(xp=np, dtype=np.float32, hidden=32):
    rng = np.random.default_rng(5)
    x, dy = (xp.asarray(rng.standard_normal((16, 2, hidden)).astype(dtype)) for _ in range(2))
    return x, dy


def _train(make_opt, mode, in_backward, steps=3, device="cpu", dtype=np.float32):
    """steps training steps -> (layers' state_dicts, optimizer's state_dict)."""
    fp8, ckpt, w8 = MODES[mode]
    layers, params = _stack(w8, device, dtype)
    opt, recipe = make_opt(params), _recipe()
    x, dy = _data(layers[0].xp, dtype)
    for _ in range(steps):
        tape, y = _forward(layers, x, fp8, ckpt, recipe)
        if in_backward:
            assert opt.step_in_backward(tape, y, output_grad=dy) is None
        else:
            opt.step(tape.gradient(y, params, output_grad=dy))
    return [layer.state_dict() for layer in layers], opt.state_dict()


def _assert_same(got, want):
    (layers_g, opt_g), (layers_w, opt_w) = got, want
    for sd_g, sd_w in [*zip(layers_g, layers_w), (opt_g, opt_w)]:
        assert set(sd_g) == set(sd_w)
        for k, w in sd_w.items():
            g = sd_g[k]
            if isinstance(w, np.ndarray):
                assert g.dtype == w.dtype, k
                np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8), err_msg=k)
            else:
                assert g == w or (g != g and w != w), k


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("which", list(OPTIMIZERS))
def test_bit_identical_to_gradient_then_step(which, mode):
    make_opt = OPTIMIZERS[which]
    _assert_same(_train(make_opt, mode, True), _train(make_opt, mode, False))


def _watch_grads(opt):
    """Wraps opt's per-parameter update: -> (refs, alive), alive[k] how many of the
    gradients applied before the k-th update are still alive then."""
    refs, alive, real = [], [], opt._step_one

    def spy(i, grad, sc):
        alive.append(sum(r() is not None for r in refs))
        refs.append(weakref.ref(grad))
        real(i, grad, sc)
    opt._step_one = spy
    return refs, alive


@pytest.mark.parametrize("mode", ["high precision", "fp8", "fp8 checkpoint",
                                  "fp8 weights checkpoint"])
def test_each_gradient_is_freed_once_applied(mode):
    """Every gradient applied is dead when the next one comes (a node's gradients are made
    together: only those of the node that just ran, or of the checkpointed layer, exist
    then), and none is alive after the call; tape.gradient + step holds them all."""
    fp8, ckpt, w8 = MODES[mode]
    layers, params = _stack(w8, n=3)
    opt = AdamW(params, lr=1e-3)
    refs, alive = _watch_grads(opt)
    x, dy = _data()
    tape, y = _forward(layers, x, fp8, ckpt, _recipe())
    opt.step_in_backward(tape, y, output_grad=dy)
    assert len(refs) == len(params) and alive == [0] * len(params)
    assert not any(r() is not None for r in refs)
    tape, y = _forward(layers, x, fp8, ckpt, _recipe())
    grads = tape.gradient(y, params, output_grad=dy)  # (the yardstick: all alive)
    assert all(weakref.ref(g)() is not None for g in grads.values())


def test_parameters_change_only_after_their_last_reader():
    """A weight used by two nodes is updated after both ran: the earlier node's backward
    reads it for the gradient that reaches w0 (the same result as the step after the
    backward; with the update after the later node alone, w0's would differ)."""
    rng = np.random.default_rng(7)
    w0, w, x = rng.standard_normal((6, 6)), rng.standard_normal((6, 6)), rng.standard_normal((4, 6))
    results = []
    for in_backward in (False, True):
        params = [w0.copy(), w.copy()]
        opt = SGD(params, lr=0.5)
        with tecupy.Tape() as tape:
            h = tecupy.linear(x, params[0])
            y = tecupy.linear(tecupy.relu(tecupy.linear(h, params[1])), params[1])
        if in_backward:
            opt.step_in_backward(tape, y)
        else:
            opt.step(tape.gradient(y, params))
        results.append(params)
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    assert not np.array_equal(results[0][0], w0)


def test_a_parameter_no_node_reaches_is_stepped_with_zeros():
    """As step() gets it from tape.gradient: zeros (weight decay still applies)."""
    x = np.random.default_rng(2).standard_normal((3, 4))
    results = []
    for in_backward in (False, True):
        used, unused = np.ones((5, 4)), np.full((2,), 3.0)
        opt = SGD([used, unused], lr=0.1, weight_decay=0.5)
        with tecupy.Tape() as tape:
            y = tecupy.linear(x, used)
            tecupy.add(unused, unused)  # on the tape, not reaching y
        if in_backward:
            opt.step_in_backward(tape, y)
        else:
            opt.step(tape.gradient(y, [used, unused]))
        results.append((used, unused))
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(results[1][1], np.full((2,), 3.0 - 0.1 * 0.5 * 3.0), rtol=1e-15)


class _Handing:
    """A stand-in tape whose backward hands the given gradients over in the given order
    (step_in_backward's contract with Tape.gradient: each index once, then nothing kept)."""

    def __init__(self, grads, order):
        self.grads, self.order = grads, order

    def gradient(self, outputs, wrt, output_grad=None, on_grad=None, keep_grads=True):
        assert not keep_grads and len(wrt) == len(self.grads)
        for i in self.order:
            on_grad(i, self.grads[i])


@pytest.mark.parametrize("which", ["adamw", "adamw_bf16_moments", "adamw_schedule",
                                   "sgd_nesterov"])
def test_one_tensor_at_a_time_equals_the_step(xp, which):
    """The same gradients applied by step() and one at a time in any order: parameters,
    masters and moments bit-identical (on the GPU: the fused kernels, many tensors of mixed
    dtypes, float32 gradients for 16-bit parameters, more than one launch's pack)."""
    rng = np.random.default_rng(11)
    make_opt = dict(OPTIMIZERS, adamw_bf16_moments=lambda p: AdamW(
        p, lr=1e-2, moments_dtype=tecupy.bfloat16))[which]
    n = 300 if xp is not np else 12
    dtypes = [np.float32, tecupy.bfloat16, np.float16]
    host = [rng.standard_normal(int(rng.integers(1, 3000))).astype(dtypes[i % 3])
            for i in range(n)]
    opts = [make_opt([xp.array(p) for p in host]) for _ in range(2)]  # (copies)
    assert opts[0].fused == (xp is not np)
    for step in range(3):
        grads = [xp.asarray(rng.standard_normal(p.shape).astype(
            np.float32 if (i + step) % 2 else p.dtype)) for i, p in enumerate(host)]
        opts[0].step(grads)
        opts[1].step_in_backward(_Handing(grads, rng.permutation(n).tolist()), None)
    _assert_same(([], opts[1].state_dict()), ([], opts[0].state_dict()))
    for a, b in zip(*(o.params for o in opts)):
        np.testing.assert_array_equal(asnp(a).view(np.uint8), asnp(b).view(np.uint8))


# ---- errors ------------------------------------------------------------------------------
def _one_layer():
    layers, params = _stack(False, n=1)
    x, dy = _data()
    tape, y = _forward(layers, x, False, False, None)
    return layers[0], params, tape, y, dy


def test_clipping_is_refused_before_anything_runs():
    layer, params, tape, y, dy = _one_layer()
    opt = AdamW(params, max_grad_norm=1.0)
    before = {k: v.copy() for k, v in params.items()}
    with pytest.raises(ValueError, match=r"AdamW.step_in_backward: .*max_grad_norm=1.0.*"
                                         r"max_grad_norm=None"):
        opt.step_in_backward(tape, y, output_grad=dy)
    assert opt.step_count == 0
    for k, v in params.items():
        np.testing.assert_array_equal(v, before[k])
    grads = tape.gradient(y, params, output_grad=dy)  # the tape was not used up
    opt.step(grads)
    assert opt.step_count == 1


def test_a_second_call_on_the_same_tape_changes_nothing():
    layer, params, tape, y, dy = _one_layer()
    opt = AdamW(params, lr=1e-3)
    opt.step_in_backward(tape, y, output_grad=dy)
    state = opt.state_dict()
    with pytest.raises(RuntimeError, match="already ran"):
        opt.step_in_backward(tape, y, output_grad=dy)
    assert opt.step_count == 1
    _assert_same(([], opt.state_dict()), ([], state))


@pytest.mark.parametrize("extra, missing", [(True, False), (False, True), (True, True)])
def test_params_must_be_the_optimizers(extra, missing):
    layer, params, tape, y, dy = _one_layer()
    opt = AdamW(params, lr=1e-3)
    given = dict(params)
    if missing:
        given.pop("0.fc2_weight" if "0.fc2_weight" in given else next(iter(given)))
    if extra:
        given["stranger"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="params must be this optimizer's parameters") as err:
        opt.step_in_backward(tape, y, output_grad=dy, params=given)
    msg = str(err.value)
    assert ("params['stranger']" in msg) == extra
    assert (("not given: none" in msg) != missing)
    assert opt.step_count == 0
    opt.step_in_backward(tape, y, output_grad=dy, params=params)  # the same: accepted
    assert opt.step_count == 1


def test_params_as_a_module_and_bad_arguments():
    layer, params, tape, y, dy = _one_layer()
    opt = AdamW(layer.named_parameters(), lr=1e-3)
    with pytest.raises(TypeError, match="tape must be the tecupy.Tape"):
        opt.step_in_backward(y, y)
    with pytest.raises(TypeError, match="params must be None, a tecupy.nn module"):
        opt.step_in_backward(tape, y, output_grad=dy, params=3)
    opt.step_in_backward(tape, y, output_grad=dy, params=layer)
    assert opt.step_count == 1


def test_a_parameter_not_on_the_tape_is_the_tapes_error():
    x = np.ones((2, 3))
    w, stray = np.ones((4, 3)), np.ones(2)
    opt = SGD([w, stray], lr=0.1)
    with tecupy.Tape() as tape:
        y = tecupy.linear(x, w)
    with pytest.raises(ValueError, match=r"wrt\[1\].*is not on this tape"):
        opt.step_in_backward(tape, y)
    assert opt.step_count == 0


# ---- GPU ----------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("mode", ["high precision", "fp8 checkpoint", "fp8 weights checkpoint"])
@pytest.mark.parametrize("which", ["adamw", "sgd_nesterov"])
def test_fused_bit_identical_to_gradient_then_step(which, mode):
    """The fused kernels one tensor at a time (bf16 parameters, float32 masters) against the
    fused step over all of them."""
    make_opt = OPTIMIZERS[which]
    got = _train(make_opt, mode, True, device="cuda", dtype=tecupy.bfloat16)
    want = _train(make_opt, mode, False, device="cuda", dtype=tecupy.bfloat16)
    _assert_same(got, want)


@gpu
def test_gpu_peak_without_the_gradients():
    """A checkpointed stack whose gradients dominate (small activations): the pool's peak
    with the step in the backward is below that of tape.gradient's by most of the
    gradients' bytes (one layer's may be alive: a checkpointed layer's come together)."""
    from tecupy.bench.layer import Stack
    from tecupy.bench.memory import step_memory
    n, dtype = 4, tecupy.bfloat16
    layers, params = _stack(False, "cuda", dtype, n, size=(128, 512, 2))
    x, dy = _data(layers[0].xp, dtype, hidden=128)
    stack = Stack(layers, checkpointed=True)
    plain, _, _ = step_memory(stack, x, dy, _recipe())
    opt = AdamW(params, lr=1e-4)
    in_backward, _, _ = step_memory(stack, x, dy, _recipe(), optimizer=opt)
    grads = sum(p.size * 2 for p in params.values())  # bf16
    assert in_backward <= plain - grads * (n - 1.5) / n, (plain, in_backward, grads)

"""tecupy.checkpoint: activation recompute with te.checkpoint's semantics (issue 22). The
recompute gives bit-identical gradients and leaves the FP8 state and the dropout generators
as a plain step does; nothing fn makes is kept for the backward."""
import weakref

import numpy as np
import pytest

import tecupy
from tecupy.recipe import DelayedScaling, Float8CurrentScaling

RECIPES = [None, DelayedScaling(amax_history_len=4), Float8CurrentScaling()]
IDS = ["high precision", "fp8 delayed", "fp8 current"]


def _layer(dropout):
    return tecupy.nn.TransformerLayer(32, 64, 2, hidden_dropout=dropout,
                                      attention_dropout=dropout, device="cpu", seed=7)


def _steps(layer, recipe, call, steps=3):
    """`steps` training steps; the last step's output and gradients."""
    rng = np.random.default_rng(11)
    for _ in range(steps):
        x = rng.standard_normal((16, 2, 32)).astype(np.float32)
        dy = rng.standard_normal((16, 2, 32)).astype(np.float32)
        with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=recipe is not None,
                                                        fp8_recipe=recipe):
            y = call(layer, x)
        grads = tape.gradient(y, dict(layer.named_parameters(), x=x), output_grad=dy)
    return y, grads


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:  # parameters, every generator's state, every FP8 scale and history
        if isinstance(sa[k], np.ndarray):
            np.testing.assert_array_equal(sa[k], sb[k], err_msg=k)
        else:
            assert sa[k] == sb[k], k


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no dropout", "dropout"])
@pytest.mark.parametrize("recipe", RECIPES, ids=IDS)
def test_transformer_layer_bit_identical(recipe, dropout):
    plain, ckpt = _layer(dropout), _layer(dropout)
    y0, g0 = _steps(plain, recipe, lambda layer, x: layer(x))
    y1, g1 = _steps(ckpt, recipe, lambda layer, x: tecupy.checkpoint(layer, x))
    np.testing.assert_array_equal(y0, y1)
    assert set(g0) == set(g1)
    for k in g0:
        np.testing.assert_array_equal(g0[k], g1[k], err_msg=k)
    _assert_same_state(plain, ckpt)  # FP8 scales/histories and generators as after a plain step


@pytest.mark.parametrize("recipe", RECIPES[:2], ids=IDS[:2])
def test_bound_method_and_module_wrt(recipe):
    plain, ckpt = _layer(0.1), _layer(0.1)
    _, g0 = _steps(plain, recipe, lambda layer, x: layer(x), steps=2)
    _, g1 = _steps(ckpt, recipe, lambda layer, x: tecupy.checkpoint(layer.forward, x), steps=2)
    for k in g0:
        np.testing.assert_array_equal(g0[k], g1[k], err_msg=k)
    x = np.random.default_rng(0).standard_normal((16, 2, 32)).astype(np.float32)
    with tecupy.Tape() as tape:
        y = tecupy.checkpoint(ckpt, x)
    g = tape.gradient(y, ckpt)  # w.r.t. a module: its parameters are the node's inputs
    assert set(g) == set(dict(ckpt.named_parameters()))


def _block(x, w1, w2, b):
    h = tecupy.gelu(tecupy.linear(x, w1, b))
    return tecupy.linear(h, w2), tecupy.relu(h)


def test_function_of_arrays(rng):
    x, w1, w2 = (rng.standard_normal(s) for s in ((6, 8), (12, 8), (5, 12)))
    b, dy1, dy2 = rng.standard_normal(12), rng.standard_normal((6, 5)), \
        rng.standard_normal((6, 12))
    got = []
    for call in (_block, lambda *a: tecupy.checkpoint(_block, *a)):
        with tecupy.Tape() as tape:
            y1, y2 = call(x, w1, w2, b)
            z = tecupy.add(y1, tecupy.linear(x, w2[:, :8]))  # x is used outside too
        got.append(tape.gradient([z, y2], [x, w1, w2, b], output_grad=[dy1, dy2]))
    for g0, g1 in zip(*got):
        np.testing.assert_array_equal(g0, g1)


def test_nothing_fn_makes_is_kept(rng):
    x, w = rng.standard_normal((6, 8)), rng.standard_normal((8, 8))
    refs = []

    def fn(x, w):
        h = tecupy.gelu(tecupy.linear(x, w))
        refs.append(weakref.ref(h))
        return tecupy.linear(h, w)
    with tecupy.Tape() as tape:
        y = tecupy.checkpoint(fn, x, w)
        assert refs[0]() is None  # gone as the first forward returned
    assert len(tape._nodes) == 1
    node = tape._nodes[0]
    assert [id(a) for a in node.inputs] == [id(x), id(w)]
    assert node.outputs[0] is y
    dx, dw = tape.gradient(y, [x, w])
    with tecupy.Tape() as tape:
        y = fn(x, w)
    dx0, dw0 = tape.gradient(y, [x, w])
    np.testing.assert_array_equal(dx, dx0)
    np.testing.assert_array_equal(dw, dw0)


def test_repeated_array_argument_is_one_input(rng):
    x = rng.standard_normal((4, 4))
    with tecupy.Tape() as tape:
        y = tecupy.checkpoint(tecupy.add, x, x)
    np.testing.assert_array_equal(tape.gradient(y, x), np.full((4, 4), 2.0))


def test_without_a_tape_it_just_calls_fn(rng):
    x = rng.standard_normal(5)
    np.testing.assert_array_equal(tecupy.checkpoint(tecupy.relu, x), np.maximum(x, 0))
    assert tecupy.checkpoint(lambda v: "anything", x) == "anything"


def test_retain_graph_reruns_in_high_precision_refused_in_fp8(rng):
    layer = _layer(0.1)
    x = rng.standard_normal((16, 2, 32)).astype(np.float32)
    with tecupy.Tape() as tape:
        y = tecupy.checkpoint(layer, x)
    g1 = tape.gradient(y, x, retain_graph=True)
    np.testing.assert_array_equal(tape.gradient(y, x), g1)
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=DelayedScaling()):
        y = tecupy.checkpoint(layer, x)
    tape.gradient(y, x, retain_graph=True)
    with pytest.raises(RuntimeError, match="already ran"):
        tape.gradient(y, x)


def test_errors(rng):
    x = rng.standard_normal(4)
    with tecupy.Tape():
        with pytest.raises(TypeError, match=r"tecupy.checkpoint: fn must be a callable.*got 3"):
            tecupy.checkpoint(3, x)
        with pytest.raises(TypeError, match=r"tecupy.checkpoint: fn's output must be an array"
                                            r".*got 1.5"):
            tecupy.checkpoint(lambda v: 1.5, x)
        with pytest.raises(TypeError, match=r"fn's output\[1\] must be a numpy or cupy array"):
            tecupy.checkpoint(lambda v: (tecupy.relu(v), None), x)
    with pytest.raises(TypeError, match="fn must be a callable"):
        tecupy.checkpoint(None)

"""The tape frees what only it holds (issue 22): an array no variable, closure, view or other
tape refers to is swapped for a placeholder, while recording, when a backward starts and
after each node's backward. NumPy arrays take weakrefs: a dead weakref is a freed array."""
import weakref

import numpy as np
import pytest

import tecupy
import tecupy.tape as tape_mod
from tecupy import tape_memory
from tecupy.recipe import DelayedScaling


@pytest.fixture
def no_release(monkeypatch):
    """The tape as before: nothing is ever found alone, so everything stays alive."""
    monkeypatch.setattr(tape_memory, "_ALONE", -10**9)


def _alive(ref):
    return ref() is not None


def test_dropped_intermediate_is_freed_when_the_backward_starts(rng):
    x, z = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))
    with tecupy.Tape() as tape:
        a = tecupy.add(x, z)  # add's backward saves nothing
        b = tecupy.add(a, z)
    ref = weakref.ref(a)
    del a
    assert _alive(ref)  # two records: no sweep yet
    seen = []
    tape._nodes[1].backward = _spy(tape._nodes[1].backward, lambda: seen.append(_alive(ref)))
    gx, gz = tape.gradient(b, [x, z], retain_graph=True)
    assert seen == [False]  # freed before the first backward ran
    np.testing.assert_array_equal(gx, np.ones_like(x))
    np.testing.assert_array_equal(gz, np.full_like(z, 2.0))
    assert isinstance(tape._nodes[0].outputs[0], tape_mod._Released)


def _spy(backward, probe):
    def run(*grads):
        probe()
        return backward(*grads)
    return run


def test_freed_while_recording(rng):
    x, z = rng.standard_normal(6), rng.standard_normal(6)
    with tecupy.Tape() as tape:
        h = tecupy.add(x, z)
        ref = weakref.ref(h)
        for _ in range(2 * tape_mod._SWEEP_EVERY):
            h = tecupy.add(h, z)
        assert not _alive(ref)  # before any backward
    gz = tape.gradient(h, z)
    np.testing.assert_array_equal(gz, np.full(6, 2.0 * tape_mod._SWEEP_EVERY + 1))


def test_what_the_user_or_a_closure_holds_stays(rng):
    x, z = rng.standard_normal(5), rng.standard_normal(5)
    with tecupy.Tape() as tape:
        kept = tecupy.add(x, z)
        saved = tecupy.add(x, z)
        y = tecupy.add(tecupy.relu(saved), kept)  # relu's backward saved its input
    ref = weakref.ref(saved)
    del saved
    tape.gradient(y, x, retain_graph=True)
    assert _alive(ref)
    assert tape._nodes[0].outputs[0] is kept
    tape.gradient(y, x)  # relu's closure is dropped: nothing holds `saved` any more
    assert not _alive(ref)
    assert tape._nodes[0].outputs[0] is kept


def test_a_view_keeps_its_base_and_view_then_base_are_freed(rng):
    x, z = rng.standard_normal((3, 4)), rng.standard_normal(12)
    with tecupy.Tape() as tape:
        a = tecupy.add(x, x)
        view = a[1:]  # the user's view: its .base is a
        ref_a = weakref.ref(a)
        del a
        tape.gradient(tecupy.relu(view), x, retain_graph=True)
        assert _alive(ref_a)
        del view
        b = tecupy.add(x, x)
        flat = b.reshape(-1)  # a view recorded by hand, its backward saving only the shape
        tape_mod.record(lambda dy: (dy.reshape(3, 4),), (b,), (flat,))
        y = tecupy.add(flat, z)
    ref_b, ref_flat = weakref.ref(b), weakref.ref(flat)
    del b, flat
    assert _alive(ref_b) and _alive(ref_flat)
    gx = tape.gradient(y, x)  # the view first, then (next round) its base
    assert not _alive(ref_flat) and not _alive(ref_b)
    assert _alive(ref_a)  # relu's node did not run: its closure still holds the view
    np.testing.assert_array_equal(gx, np.full((3, 4), 2.0))


def _chain(x, z):
    return tecupy.gelu(tecupy.add(tecupy.relu(tecupy.add(x, z)), z))


def _diamond(x, z):
    a = tecupy.add(x, z)
    return tecupy.add(tecupy.gelu(a), tecupy.add(tecupy.relu(a), a))


def _grads(graph, x, z, dy, retain):
    with tecupy.Tape() as tape:
        y = graph(x, z)
    return tape.gradient(y, [x, z], output_grad=dy, retain_graph=retain)


@pytest.mark.parametrize("graph", [_chain, _diamond])
@pytest.mark.parametrize("retain", [False, True])
def test_gradients_as_before(graph, retain, rng, monkeypatch):
    x, z, dy = (rng.standard_normal((3, 7)) for _ in range(3))
    got = _grads(graph, x, z, dy, retain)
    monkeypatch.setattr(tape_memory, "_ALONE", -10**9)
    want = _grads(graph, x, z, dy, retain)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def _layer_step(recipe, retain):
    layer = tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=3)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 2, 32)).astype(np.float32)
    dy = rng.standard_normal((16, 2, 32)).astype(np.float32)
    with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=recipe is not None,
                                                    fp8_recipe=recipe):
        y = layer(x)
    return tape.gradient(y, dict(layer.named_parameters(), x=x), output_grad=dy,
                         retain_graph=retain), tape


@pytest.mark.parametrize("recipe", [None, DelayedScaling(amax_history_len=4)],
                         ids=["high precision", "fp8"])
@pytest.mark.parametrize("retain", [False, True])
def test_transformer_layer_gradients_as_before(recipe, retain, monkeypatch):
    got, tape = _layer_step(recipe, retain)
    released = sum(isinstance(a, tape_mod._Released)
                   for n in tape._nodes for a in (*n.inputs, *n.outputs))
    assert released > 0
    monkeypatch.setattr(tape_memory, "_ALONE", -10**9)
    want, _ = _layer_step(recipe, retain)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_nested_tapes(rng):
    x, z = rng.standard_normal(4), rng.standard_normal(4)
    with tecupy.Tape() as outer:
        with tecupy.Tape() as inner:
            a = tecupy.add(x, z)
            b = tecupy.add(a, z)
        c = tecupy.add(a, x)  # only the outer tape holds this reference to `a`
    ref = weakref.ref(a)
    del a
    np.testing.assert_array_equal(inner.gradient(b, x, retain_graph=True), np.ones(4))
    assert _alive(ref)  # the inner tape's sweep counts only its nodes: kept
    np.testing.assert_array_equal(outer.gradient([b, c], x), np.full(4, 3.0))
    assert not _alive(ref)


def test_a_new_array_at_a_freed_id_is_another_array(rng):
    x, z = rng.standard_normal(8), rng.standard_normal(8)
    with tecupy.Tape() as tape:
        a = tecupy.add(x, z)
        b = tecupy.add(a, z)
        old = id(a)
        del a
        tape_mod._sweep(tape._nodes)
        pool = [np.ones(8) for _ in range(64)]  # CPython reuses freed objects' memory
        new = next((p for p in pool if id(p) == old), None)
        if new is None:
            pytest.skip("no new array took the freed id")
        c = tecupy.add(new, x)
    with pytest.raises(ValueError, match="not on this tape"):
        tape.gradient(b, pool[0] if pool[0] is not new else pool[1])
    gb, gnew = tape.gradient([b, c], [x, new], retain_graph=True)
    np.testing.assert_array_equal(gb, np.full(8, 2.0))  # b's path and c's
    np.testing.assert_array_equal(gnew, np.ones(8))  # c's path only


def test_saved_bytes_counts_only_live_arrays(rng):
    x, z = rng.standard_normal((64, 64)), rng.standard_normal((64, 64))
    with tecupy.Tape() as tape:
        a = tecupy.add(x, z)
        y = tecupy.add(tecupy.relu(tecupy.add(a, z)), z)
    del a
    rows, held = tape_mod.saved_bytes(tape)
    assert [op for op, _ in rows] == ["add", "add", "activation", "add"]
    assert dict(rows)["activation"] == 64 * 64 * 8  # relu's saved input
    assert held == 3 * 64 * 64 * 8  # x, z and y: the caller holds them; `a` was freed
    assert tape.gradient(y, x).shape == (64, 64)


def test_release_off_fixture_keeps_everything(no_release, rng):
    x, z = rng.standard_normal(3), rng.standard_normal(3)
    with tecupy.Tape() as tape:
        a = tecupy.add(x, z)
        y = tecupy.add(a, z)
    ref = weakref.ref(a)
    del a
    tape.gradient(y, x)
    assert _alive(ref)


def test_intermediate_gradients_die_once_their_producer_ran(rng):
    """The gradient of an intermediate array is handed to the node that made it and not
    kept (as in PyTorch's autograd); one asked for is kept and returned."""
    x, z = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))
    with tecupy.Tape() as tape:
        a = tecupy.linear(x, z)   # a [3, 3]
        b = tecupy.relu(a)
        c = tecupy.add(b, b)
    refs, seen = [], []

    def keep_ref(*grads):  # runs as relu's backward: takes d(b) and keeps a weakref
        refs.append(weakref.ref(grads[0]))
        return relu_bwd(*grads)

    def probe(*grads):  # runs as linear's backward: d(b) must be dead by now
        seen.append(_alive(refs[0]))
        return lin_bwd(*grads)
    relu_bwd, lin_bwd = tape._nodes[1].backward, tape._nodes[0].backward
    tape._nodes[1].backward, tape._nodes[0].backward = keep_ref, probe
    ga, gx = tape.gradient(c, [a, x])
    assert seen == [False]
    want_a = 2.0 * (a > 0)
    np.testing.assert_array_equal(ga, want_a)  # asked for: kept, though a node consumed it
    np.testing.assert_allclose(gx, want_a @ z, rtol=1e-12)


@pytest.mark.parametrize("keep", [False, True])
def test_keep_grads_false_frees_each_gradient_once_handed_over(keep):
    """With keep_grads=False, a gradient on_grad was given is dead when the next comes (and
    all are after the call): only the gradients of the node that just ran can be alive at
    once. keep_grads=True (the yardstick) keeps every one for the result."""
    layers = [tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=s) for s in (1, 2)]
    params = [p for layer in layers for p in layer.parameters()]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((16, 2, 32)).astype(np.float32)
    with tecupy.Tape() as tape:
        y = layers[1](layers[0](x))
    refs, alive = [], []

    def on_grad(i, g):
        alive.append(sum(_alive(r) for r in refs))
        refs.append(weakref.ref(g))
    got = tape.gradient(y, params, on_grad=on_grad, keep_grads=keep)
    assert len(refs) == len(params)
    if keep:
        assert alive == list(range(len(params))) and len(got) == len(params)
    else:
        assert got is None and alive == [0] * len(params)
        assert not any(_alive(r) for r in refs)

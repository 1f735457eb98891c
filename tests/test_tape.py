"""The tape: accumulation, unbroadcasting, multiple outputs, structures, clear errors."""
import numpy as np
import pytest

import tecupy
from conftest import asnp


def test_array_used_twice_accumulates(xp, rng):
    x = xp.asarray(rng.standard_normal((5, 7)))
    w = xp.asarray(rng.standard_normal((3, 7)))
    with tecupy.Tape() as tape:
        y = tecupy.add(tecupy.linear(x, w), tecupy.linear(x, w))
    dy = xp.asarray(rng.standard_normal((5, 3)))
    dx, dw = tape.gradient(y, [x, w], output_grad=dy)
    np.testing.assert_allclose(asnp(dx), 2 * asnp(dy) @ asnp(w), rtol=1e-12)
    np.testing.assert_allclose(asnp(dw), 2 * asnp(dy).T @ asnp(x), rtol=1e-12)


def test_broadcast_add_is_unbroadcast(rng):
    a, b = rng.standard_normal((4, 6)), rng.standard_normal((6,))
    c = rng.standard_normal((4, 1))
    with tecupy.Tape() as tape:
        y = tecupy.add(tecupy.add(a, b), c)
    ga, gb, gc = tape.gradient(y, [a, b, c])
    np.testing.assert_array_equal(ga, np.ones((4, 6)))
    np.testing.assert_array_equal(gb, np.full(6, 4.0))
    np.testing.assert_array_equal(gc, np.full((4, 1), 6.0))


def test_bias_row_gradient_is_float32_column_sums_rounded_once(rng):
    """add(a, b) with b a row over a's rows (a bias): b's gradient is the float32 column
    sums of dy rounded once to b's dtype (bias_grad), not a sum in bfloat16."""
    a = rng.standard_normal((3, 700, 8)).astype(tecupy.bfloat16)
    b = rng.standard_normal((8,)).astype(tecupy.bfloat16)
    dy = (rng.standard_normal(a.shape) + 1).astype(tecupy.bfloat16)
    with tecupy.Tape() as tape:
        y = tecupy.add(a, b)
    gb = tape.gradient(y, [b], output_grad=dy)[0]
    want = dy.astype(np.float32).reshape(-1, 8).sum(0).astype(tecupy.bfloat16)
    np.testing.assert_array_equal(gb.view(np.uint16), want.view(np.uint16))


def test_default_output_grad_is_ones_and_multiple_outputs(rng):
    x = rng.standard_normal((4, 6))
    with tecupy.Tape() as tape:
        a, b = tecupy.split(x, [2, 4], axis=1)
        y1, y2 = tecupy.relu(a), tecupy.reshape(b, (8, 2))
    (gx,) = tape.gradient([y1, y2], [x])
    want = np.concatenate([(x[:, :2] > 0) * 1.0, np.ones((4, 4))], axis=1)
    np.testing.assert_array_equal(gx, want)


def test_unused_array_on_tape_gets_zeros_and_single_wrt(rng):
    x, z = rng.standard_normal(5), rng.standard_normal(5)
    with tecupy.Tape() as tape:
        y = tecupy.relu(x)
        tecupy.gelu(z)
    gz = tape.gradient(y, z)
    assert isinstance(gz, np.ndarray) and np.all(gz == 0)


def test_dict_and_module_wrt(rng):
    lin = tecupy.nn.Linear(6, 4, device="cpu", params_dtype=np.float64, seed=0)
    x = rng.standard_normal((3, 6))
    with tecupy.Tape() as tape:
        y = lin(x)
    g = tape.gradient(y, lin, retain_graph=True)  # a second call below
    assert set(g) == {"weight", "bias"}
    np.testing.assert_allclose(g["bias"], np.full(4, 3.0))
    g2 = tape.gradient(y, {"input": x})
    np.testing.assert_allclose(g2["input"], np.ones((3, 4)) @ lin.weight)


def test_nested_tapes_both_record(rng):
    x = rng.standard_normal(4)
    with tecupy.Tape() as outer:
        with tecupy.Tape() as inner:
            y = tecupy.relu(x)
        z = tecupy.gelu(y)
    assert inner.gradient(y, x, retain_graph=True).shape == (4,)  # relu's node is shared
    assert outer.gradient(z, x).shape == (4,)
    with pytest.raises(ValueError, match="not produced"):
        inner.gradient(z, x)


def test_errors_are_clear(rng):
    x = rng.standard_normal((4, 4))
    with tecupy.Tape() as tape:
        y = tecupy.relu(x)
    with pytest.raises(ValueError, match=r"wrt\[0\].*not on this tape"):
        tape.gradient(y, [x[:2]])  # a slice is a new array
    with pytest.raises(ValueError, match="not produced by a tecupy op"):
        tape.gradient(x * 2, [x])
    with pytest.raises(ValueError, match="output_grad 0 has shape"):
        tape.gradient(y, [x], output_grad=np.ones(3))
    with pytest.raises(ValueError, match="1 outputs but 2 output grads"):
        tape.gradient(y, [x], output_grad=[np.ones((4, 4))] * 2)


def test_no_recording_without_tape(rng):
    x = rng.standard_normal(3)
    tecupy.relu(x)
    with tecupy.Tape() as tape:
        pass
    with pytest.raises(ValueError):
        tape.gradient(tecupy.relu(x), x)


def test_loss_is_an_array_that_chains(rng):
    logits, target = rng.standard_normal((6, 5)), rng.integers(0, 5, 6)
    with tecupy.Tape() as tape:
        loss = tecupy.cross_entropy(logits, target)
        total = tecupy.add(loss, tecupy.cross_entropy(logits, target, reduction="sum"))
    assert isinstance(loss, np.ndarray) and loss.shape == ()
    g = tape.gradient(total, logits)
    assert g.shape == logits.shape


def _fp8_step(lin, x):
    recipe = tecupy.recipe.DelayedScaling(amax_history_len=4)
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
        y = lin(x)
    return tape, y


def test_second_gradient_through_fp8_is_a_clear_error(rng):
    """An FP8 backward records the gradients' amaxes and updates the backward scales once
    per backward, as Transformer Engine does (transformer_engine/pytorch/quantization.py:
    reduce_and_update_fp8_tensors(forward=False) once per backward); a second backward
    through the same FP8 ops would cast with the new scales and record the amaxes again.
    PyTorch refuses a second backward through a freed graph; tecupy refuses this one, before
    anything runs (the state is untouched), and says how to get the gradients."""
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=0)
    x, dy = rng.standard_normal((16, 32)).astype(np.float32), \
        rng.standard_normal((16, 16)).astype(np.float32)
    tape, y = _fp8_step(lin, x)
    dx, dw = tape.gradient(y, [x, lin.weight], output_grad=dy)
    bwd = {k: getattr(lin.fp8_state.bwd, k).copy() for k in ("amax_history", "scale")}
    with pytest.raises(RuntimeError, match=r"already ran.*one call.*new Tape"):
        tape.gradient(y, [x], output_grad=dy)
    for k, v in bwd.items():
        np.testing.assert_array_equal(getattr(lin.fp8_state.bwd, k), v)
    # the fix the message names: a fresh Tape gives the same gradients again
    lin2 = tecupy.nn.Linear(32, 16, device="cpu", seed=0)
    tape2, y2 = _fp8_step(lin2, x)
    dx2, dw2 = tape2.gradient(y2, [x, lin2.weight], output_grad=dy)
    np.testing.assert_array_equal(dx, dx2)
    np.testing.assert_array_equal(dw, dw2)


def test_nested_tapes_share_the_fp8_backward_once(rng):
    """The FP8 nodes are shared by nested tapes: the outer tape may not run them again."""
    from tecupy.recipe import DelayedScaling
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=1)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    with tecupy.Tape() as outer:
        with tecupy.Tape() as inner, tecupy.fp8_autocast(fp8_recipe=DelayedScaling()):
            y = lin(x)
        z = tecupy.relu(y)
    inner.gradient(y, x)
    with pytest.raises(RuntimeError, match="already ran"):
        outer.gradient(z, x)


def test_second_gradient_elsewhere_is_fine(rng):
    """Only a backward through FP8 ops that already ran is refused: high-precision tapes
    and FP8 ops not reached by the first call may be differentiated again."""
    x = rng.standard_normal((16, 32))
    lin = tecupy.nn.Linear(32, 16, device="cpu", params_dtype=np.float64, seed=2)
    with tecupy.Tape() as tape:
        y = lin(x)
    np.testing.assert_array_equal(tape.gradient(y, x, retain_graph=True), tape.gradient(y, x))
    a, b = (tecupy.nn.Linear(32, 16, device="cpu", seed=s) for s in (3, 4))
    x32 = x.astype(np.float32)
    from tecupy.recipe import DelayedScaling
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=DelayedScaling()):
        ya, yb = a(x32), b(x32)
    tape.gradient(ya, x32)
    assert tape.gradient(yb, x32).shape == x32.shape  # b's backward had not run yet
    current = tecupy.recipe.Float8CurrentScaling()
    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=current):
        y = a(x32)  # current scaling: no state, nothing recorded twice
    np.testing.assert_array_equal(tape.gradient(y, x32, retain_graph=True),
                                  tape.gradient(y, x32))


def test_gradient_wrt_a_string_is_a_clear_error(rng):
    x = rng.standard_normal(4)
    with tecupy.Tape() as tape:
        y = tecupy.relu(x)
    with pytest.raises((TypeError, ValueError), match="wrt"):
        tape.gradient(y, "x")


def _node(log, name, x, after=(), once=None):
    """A recorded op y = 2 x whose backward notes its name in `log`."""
    from tecupy.tape import record
    y = 2 * x

    def backward(dy):
        log.append(name)
        return (2 * dy,)
    record(backward, (x,), (y,), after_backward=after, once=once)
    return y


def test_after_backward_hooks_run_once_batched_after_the_backward(rng):
    """Hooks (fn, item): each fn runs once per gradient call, after every backward of the
    call, with the distinct items (by identity, in the order first met) of the nodes that
    ran; a node the backward does not reach gives nothing."""
    log, a, b = [], object(), object()

    def fn(items):
        log.append(("fn", [{id(a): "a", id(b): "b"}[id(i)] for i in items]))

    def other(items):
        log.append(("other", len(items)))
    x = rng.standard_normal(3)
    with tecupy.Tape() as tape:
        y1 = _node(log, "n1", x, after=((fn, a),))
        y2 = _node(log, "n2", y1, after=((fn, b), (fn, a), (other, a)))
        _node(log, "unreached", x, after=((fn, object()),))
    tape.gradient(y2, x, retain_graph=True)
    assert log == ["n2", "n1", ("fn", ["b", "a"]), ("other", 1)]
    log.clear()
    tape.gradient(y2, x)  # no `once`: a second call runs the backward and the hooks again
    assert log == ["n2", "n1", ("fn", ["b", "a"]), ("other", 1)]


def test_once_refuses_a_second_backward_before_anything_runs(rng):
    """A node recorded with once=(what, why): its second backward is refused with a message
    built from them, before any backward or hook runs; nodes not reached are unaffected."""
    log = []
    x = rng.standard_normal(3)
    hook = ((lambda items: log.append("hook"), x),)
    with tecupy.Tape() as tape:
        y = _node(log, "once", x, after=hook, once=("my ops", "(they count calls)"))
        z = _node(log, "plain", x)
    tape.gradient(y, x)
    assert log == ["once", "hook"]
    with pytest.raises(RuntimeError, match=r"^Tape.gradient: the backward of my ops on this "
                       r"tape already ran \(they count calls\)\. Ask for every gradient"):
        tape.gradient(y, x)
    assert log == ["once", "hook"]
    tape.gradient(z, x)
    assert log == ["once", "hook", "plain"]


def test_tape_imports_nothing_of_fp8_or_nn():
    """The tape runs nodes and hooks (DESIGN.md): no import of the FP8 modules or of nn,
    at the top or inside a function."""
    import ast
    import inspect
    import tecupy.tape
    tree = ast.parse(inspect.getsource(tecupy.tape))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.update(f"{node.module or ''}.{a.name}" for a in node.names)
    banned = ("autocast", "quantization", "recipe", "nn", "ops")
    bad = [n for n in names if any(part in banned or part.startswith("fp8")
                                   for part in n.split("."))]
    assert not bad, bad


def test_backward_releases_what_each_op_saved(rng):
    """Each node's backward drops its closure, and with it the arrays its op saved (here the
    FP8 codes of a linear's input and weight), as soon as it has run: memory comes back
    during the backward (issue 22), as in PyTorch without retain_graph."""
    import weakref
    from tecupy import fp8 as fp8_module
    saved = []
    real = fp8_module.FP8Tensor.made.__func__

    def spy(cls, data, *args, **kwargs):
        saved.append(weakref.ref(data))
        return real(cls, data, *args, **kwargs)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8_module.FP8Tensor, "made", classmethod(spy))
        with tecupy.Tape() as tape, tecupy.fp8_autocast(
                fp8_recipe=tecupy.recipe.Float8CurrentScaling()):
            y = tecupy.linear(x, w)
    alive = [r for r in saved if r() is not None]
    # kept for the backward: the column-wise copies of x and w, not the row-wise codes
    assert sorted(r().shape for r in alive) == [(32, 16), (32, 16)]
    tape.gradient(y, [x, w])
    assert all(r() is None for r in saved), "the FP8 codes outlived their backward"


def test_second_gradient_without_retain_graph_is_a_clear_error(rng):
    x = rng.standard_normal((4, 8))
    with tecupy.Tape() as tape:
        y = tecupy.gelu(x)
    tape.gradient(y, x)
    with pytest.raises(RuntimeError, match="retain_graph=True"):
        tape.gradient(y, x)


def test_saved_bytes(rng):
    """saved_bytes: what each node's backward keeps (an FP8 linear: its codes, not the
    parameters excluded), nothing once the backward ran."""
    from tecupy.tape import saved_bytes
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    with tecupy.Tape() as tape, tecupy.fp8_autocast(
            fp8_recipe=tecupy.recipe.DelayedScaling(amax_history_len=2)):
        y = tecupy.gelu(lin(x))
    rows, held = saved_bytes(tape, {id(p) for p in lin.parameters()})
    ops = dict(rows)
    # the column-wise FP8 copies of x and w (1 byte each) and two scale_invs: not x (float32)
    # nor the row-wise codes (issue 22: the backward GEMMs read only the column-wise
    # copies), nor the excluded parameters
    assert ops["_linear_fp8"] == (16 * 32 + 16 * 32) + 2 * 4
    tape.gradient(y, x)
    assert saved_bytes(tape)[0] == []  # the closures are gone after the backward


def _count_dispatches(monkeypatch, name):
    from tecupy import backends
    calls, real = [], backends.dispatch

    def counting(op, *a, **k):
        calls.append(op)
        return real(op, *a, **k)
    monkeypatch.setattr(backends, "dispatch", counting)
    return lambda: calls.count(name)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm", "layernorm_linear", "layernorm_mlp"])
def test_norm_sums_the_residual_gradient_in_its_pass(monkeypatch, xp, rng, norm):
    """A pre-norm residual block, y = x + f(norm(x)): the norm's backward is handed the
    residual's gradient (tape.record's partial) and adds it in its own pass: no add op, and
    the same gradient as x feeding the two branches as two arrays (float64)."""
    hidden, rms = 16, norm == "rmsnorm"
    g, b = (xp.asarray(rng.standard_normal(hidden)) for _ in range(2))
    w1, w2, w3 = (xp.asarray(rng.standard_normal(s))
                  for s in ((32, hidden), (hidden, 32), (hidden, hidden)))

    def branch(x):
        if norm == "layernorm_linear":
            return tecupy.layernorm_linear(x, g, b, w3)
        if norm == "layernorm_mlp":
            return tecupy.layernorm_mlp(x, g, b, w1, None, w2, None)
        return tecupy.rmsnorm(x, g) if rms else tecupy.layernorm(x, g, b)
    x = xp.asarray(rng.standard_normal((3, 5, hidden)))
    x2 = x.copy()
    adds = _count_dispatches(monkeypatch, "add_fwd")
    with tecupy.Tape() as tape:
        y = tecupy.add(x, branch(x))
    n = adds()
    dy = xp.asarray(rng.standard_normal(y.shape))
    dx = tape.gradient(y, x, output_grad=dy)
    assert adds() == n, "the residual's gradient went through an add op"
    with tecupy.Tape() as tape:
        y2 = tecupy.add(x2, branch(x))
    da, db = tape.gradient(y2, [x2, x], output_grad=dy)
    np.testing.assert_allclose(asnp(dx), asnp(da) + asnp(db), rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(asnp(dy), asnp(tecupy.add(dy, 0 * dy)))  # dy untouched


def test_partial_only_where_it_fits(rng):
    """A node recorded with partial=0 gets x's gradient so far when one exists with x's
    shape and dtype (and returns the sum), None otherwise; the sums are right either way."""
    from tecupy.tape import record
    seen = []

    def summing(x, out_dtype):
        y = x * 2

        def backward(dy, partial=None):
            seen.append(None if partial is None else partial.dtype)
            g = 2 * dy
            return [g if partial is None else g + partial]
        record(backward, (x,), (y,), partial=0)
        return y

    def plain(x, grad_dtype):
        y = x * 3
        record(lambda dy: [(3 * dy).astype(grad_dtype)], (x,), (y,))
        return y
    x = rng.standard_normal((2, 3))
    for grad_dtype, want_seen in ((np.float64, [np.float64]), (np.float32, [None])):
        seen.clear()
        with tecupy.Tape() as tape:
            y = tecupy.add(summing(x, None), plain(x, grad_dtype))
        np.testing.assert_allclose(tape.gradient(y, x), np.full((2, 3), 5.0), rtol=1e-6)
        assert seen == want_seen
    seen.clear()  # the summing node recorded last runs first: nothing to sum yet
    with tecupy.Tape() as tape:
        y = tecupy.add(plain(x, np.float64), summing(x, None))
    np.testing.assert_allclose(tape.gradient(y, x), np.full((2, 3), 5.0), rtol=1e-12)
    assert seen == [None]


# -- on_grad: each gradient handed over as soon as it is final (issue 25) -------------------

def _watch(monkeypatch):
    """Counts node backwards as they run. -> (ran, calls, on_grad): ran[k] the ids of the
    k-th node's inputs; calls (i, nodes run at the call, a copy of grad then, grad)."""
    import tecupy.tape as tape_mod
    ran, calls, real = [], [], tape_mod._run

    def counting(node, ogs, grads):
        ran.append({id(a) for a in node.inputs})
        return real(node, ogs, grads)
    monkeypatch.setattr(tape_mod, "_run", counting)

    def on_grad(i, g):
        calls.append((i, len(ran), asnp(g).copy(), g))
    return ran, calls, on_grad


def _check_handed_over(wrt, got, ran, calls):
    """Each index once, in backward order; the very array returned, final when passed (its
    copy then equals what comes back); passed right after its last consumer's backward, or
    after the whole backward for one no node consumed. -> {i: nodes run at its call}."""
    assert sorted(c[0] for c in calls) == list(range(len(wrt)))
    counts = [c[1] for c in calls]
    assert counts == sorted(counts)
    for i, count, then, g in calls:
        assert g is got[i], f"wrt[{i}]: not the array returned"
        np.testing.assert_array_equal(then, asnp(got[i]), err_msg=f"wrt[{i}] changed later")
        consumers = [k for k, ids in enumerate(ran) if id(wrt[i]) in ids]
        assert count == (consumers[-1] + 1 if consumers else len(ran)), i
    return {i: count for i, count, _, _ in calls}


def _both(monkeypatch, make, wrt_of, **kw):
    """make() -> (tape, outputs, extra); the gradients without on_grad, then of a second
    make() with it (bit-identical), checked by _check_handed_over. -> (counts, nodes run)."""
    tape, out, extra = make()
    want = tape.gradient(out, wrt_of(extra), **kw)
    tape, out, extra = make()
    ran, calls, on_grad = _watch(monkeypatch)
    wrt = wrt_of(extra)
    got = tape.gradient(out, wrt, on_grad=on_grad, **kw)
    if callable(getattr(wrt, "named_parameters", None)):
        wrt = wrt.named_parameters()
    if isinstance(wrt, dict):
        assert list(got) == list(wrt)
        wrt, got, want = list(wrt.values()), list(got.values()), list(want.values())
    assert len(got) == len(want)
    for n, (a, b) in enumerate(zip(got, want)):
        assert a.dtype == b.dtype and a.shape == b.shape, n
        np.testing.assert_array_equal(asnp(a), asnp(b), err_msg=f"wrt[{n}]")
    return _check_handed_over(wrt, got, ran, calls), len(ran)


def test_on_grad_arrays_used_twice_and_an_intermediate(monkeypatch, xp):
    """w feeds two linears, x a linear and the residual add, h an intermediate asked for:
    each is passed after its earliest-recorded consumer; w2 and b2 after the first node."""
    rng = np.random.default_rng()
    x, w, w2, b2, dy = (xp.asarray(rng.standard_normal(s)) for s in
                        ((5, 7), (7, 7), (3, 7), (3,), (5, 3)))
    keep = {}

    def make():
        with tecupy.Tape() as tape:
            h = tecupy.linear(x, w)
            y = tecupy.linear(tecupy.add(tecupy.linear(tecupy.relu(h), w), x), w2, b2)
        keep["h"] = h
        return tape, y, None
    counts, total = _both(monkeypatch, make, lambda _: [x, w, w2, b2, keep["h"]],
                          output_grad=dy)
    assert total == 5 and counts[2] == counts[3] == 1  # w2, b2: right after the last linear
    assert counts[4] == 4 and counts[0] == counts[1] == 5  # h after relu; x, w at the end


def test_on_grad_broadcast_inputs_are_unbroadcast(monkeypatch):
    rng = np.random.default_rng()
    a, b, c = rng.standard_normal((4, 6)), rng.standard_normal(6), rng.standard_normal((4, 1))

    def make():
        with tecupy.Tape() as tape:
            y = tecupy.add(tecupy.relu(tecupy.add(a, b)), c)
        return tape, y, None
    counts, total = _both(monkeypatch, make, lambda _: [a, b, c])
    assert counts == {2: 1, 0: 3, 1: 3} and total == 3


@pytest.mark.parametrize("norm", ["layernorm", "layernorm_mlp"])
def test_on_grad_after_a_norm_that_takes_the_partial_gradient(monkeypatch, xp, norm):
    """x + f(norm(x)): the norm's node pops x's gradient so far (the residual's) and returns
    the sum: x is passed after it, with that sum; the norm's parameters with it."""
    rng = np.random.default_rng()
    hidden = 16
    g, b = (xp.asarray(rng.standard_normal(hidden)) for _ in range(2))
    w1, w2 = (xp.asarray(rng.standard_normal(s)) for s in ((32, hidden), (hidden, 32)))
    x = xp.asarray(rng.standard_normal((3, 5, hidden)))
    dy = xp.asarray(rng.standard_normal((3, 5, hidden)))

    def make():
        with tecupy.Tape() as tape:
            f = tecupy.layernorm(x, g, b) if norm == "layernorm" else \
                tecupy.layernorm_mlp(x, g, b, w1, None, w2, None)
            y = tecupy.add(x, f)
        return tape, y, None
    wrt = [x, g, b] + ([w1, w2] if norm != "layernorm" else [])
    counts, total = _both(monkeypatch, make, lambda _: wrt, output_grad=dy)
    assert counts[0] == counts[1] == counts[2] == total  # the norm's node runs last
    assert all(counts[i] < total for i in (3, 4)[:len(wrt) - 3])


def _fp8_layers(seed):
    return [tecupy.nn.Linear(32, 48, device="cpu", seed=seed),
            tecupy.nn.Linear(48, 32, device="cpu", seed=seed + 1)]


def test_on_grad_fp8_ops_and_a_dict_wrt(monkeypatch):
    """Two FP8 linears (delayed scaling: run-once nodes, backward amaxes, the scales'
    update after the backward): the second's gradients come first, before its FP8 state
    is updated; a dict wrt numbers them in its key order."""
    rng = np.random.default_rng()
    x = rng.standard_normal((16, 32)).astype(np.float32)
    dy = rng.standard_normal((16, 32)).astype(np.float32)
    recipe = tecupy.recipe.DelayedScaling(amax_history_len=4)

    def make():
        a, b = _fp8_layers(3)
        with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
            y = b(tecupy.gelu(a(x)))
        return tape, y, (a, b)

    def wrt(ab):
        a, b = ab
        return {"b.weight": b.weight, "x": x, "a.weight": a.weight, "b.bias": b.bias,
                "a.bias": a.bias}
    counts, total = _both(monkeypatch, make, wrt, output_grad=dy)
    assert total == 3 and counts == {0: 1, 3: 1, 1: 3, 2: 3, 4: 3}


def test_on_grad_module_wrt_follows_named_parameters(monkeypatch):
    rng = np.random.default_rng()
    x = rng.standard_normal((16, 2, 32)).astype(np.float32)
    dy = rng.standard_normal((16, 2, 32)).astype(np.float32)
    holder = {}

    def make():
        layer = tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=3)
        holder["layer"] = layer
        with tecupy.Tape() as tape, tecupy.fp8_autocast(
                fp8_recipe=tecupy.recipe.DelayedScaling(amax_history_len=4)):
            y = layer(x)
        return tape, y, layer
    counts, total = _both(monkeypatch, make, lambda layer: layer, output_grad=dy)
    names = list(holder["layer"].named_parameters())
    first = [n for n in names if n.startswith("layernorm_mlp")]
    mlp = {counts[names.index(n)] for n in first}  # one fused node, the first to finish any
    assert len(mlp) == 1 and mlp.pop() == min(counts.values())
    assert min(counts.values()) < total // 2  # the MLP's: a few nodes into the backward
    assert max(counts.values()) == total  # the first norm's: after the last node


def test_on_grad_through_checkpoint(monkeypatch):
    """A checkpointed module is one node: its parameters are passed together after it."""
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 32)).astype(np.float64)
    dy = rng.standard_normal((4, 32))
    mk = dict(device="cpu", params_dtype=np.float64)

    def make():
        a = tecupy.nn.Linear(32, 32, seed=1, **mk)
        b = tecupy.nn.Linear(32, 32, seed=2, **mk)
        with tecupy.Tape() as tape:
            y = b(tecupy.checkpoint(a, x))
        return tape, y, (a, b)
    counts, total = _both(monkeypatch, make, lambda ab: [ab[0].weight, ab[0].bias, x,
                                                         ab[1].weight, ab[1].bias],
                          output_grad=dy)
    # b's node, then the checkpoint's (counted as it starts) and the recompute's linear
    assert total == 3 and counts == {3: 1, 4: 1, 0: 3, 1: 3, 2: 3}


def test_on_grad_unreached_and_outputs_come_after_the_backward(monkeypatch):
    """On the tape but off the path to the outputs: the zeros returned, after the backward,
    in index order; an output asked for that nothing consumes: its output_grad then."""
    rng = np.random.default_rng()
    x, z = rng.standard_normal(5), rng.standard_normal(5)
    ran, calls, on_grad = _watch(monkeypatch)
    with tecupy.Tape() as tape:
        y = tecupy.relu(x)
        tecupy.gelu(z)
    got = tape.gradient(y, [z, y, x], on_grad=on_grad)
    assert [(i, n) for i, n, _, _ in calls] == [(2, 1), (0, 1), (1, 1)]
    assert np.all(got[0] == 0) and np.all(got[1] == 1)
    _check_handed_over([z, y, x], got, ran, calls)


def test_on_grad_after_a_skipped_last_consumer(monkeypatch):
    """t's earliest consumer gets no gradient (its consumer gave None) and is skipped: t is
    passed where it would have run; u, whose every consumer gave None, gets zeros after
    the backward."""
    from tecupy.tape import record
    rng = np.random.default_rng()
    t, u = rng.standard_normal(4), rng.standard_normal(4)
    ran, calls, on_grad = _watch(monkeypatch)
    with tecupy.Tape() as tape:
        z = 3 * t
        record(lambda dz: (3 * dz,), (t,), (z,))
        w = z * u
        record(lambda dw: (None, None), (z, u), (w,))
        y = 2 * t
        record(lambda dy: (2 * dy,), (t,), (y,))
        out = tecupy.add(w, y)
    got = tape.gradient(out, [t, u], on_grad=on_grad)
    assert len(ran) == 3  # add, y's node, w's node; z's node skipped
    assert [(i, n) for i, n, _, _ in calls] == [(0, 3), (1, 3)]
    np.testing.assert_array_equal(got[0], np.full(4, 2.0))
    assert np.all(got[1] == 0) and calls[1][3] is got[1]


def test_on_grad_dtype_cast_as_returned(monkeypatch):
    """A float32 gradient of a float64 leaf and of a float64 intermediate: passed cast
    to float64, the array returned; the intermediate's producer still gets the float32
    gradient (the results are those without on_grad)."""
    from tecupy.tape import record
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 3))
    keep, seen = {}, []

    def make():
        with tecupy.Tape() as tape:
            h = x * 3
            record(lambda dh: (seen.append(dh.dtype) or (3 * dh).astype(np.float32),),
                   (x,), (h,))
            y = h * 2
            record(lambda dy: ((2 * dy + 1e-9).astype(np.float32),), (h,), (y,))
        keep["h"] = h
        return tape, y, None
    counts, _ = _both(monkeypatch, make, lambda _: [keep["h"], x])
    assert counts == {0: 1, 1: 2} and seen == [np.float32, np.float32]


def test_on_grad_must_be_callable_checked_before_anything_runs(rng):
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=0)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    tape, y = _fp8_step(lin, x)
    with pytest.raises(TypeError, match=r"on_grad must be None or a callable on_grad\(i, "
                                        r"grad\); got list"):
        tape.gradient(y, lin, on_grad=[])
    assert tape.gradient(y, x).shape == x.shape  # the run-once FP8 backward had not run


def test_on_grad_keeps_the_release_and_no_reference(monkeypatch):
    """With on_grad, the backward frees what each op saved as without it (the same
    placeholders on the tape after it), and once gradient() returns nothing but the
    caller holds the arrays passed."""
    import sys

    import tecupy.tape as tape_mod
    x = np.random.default_rng(1).standard_normal((16, 2, 32)).astype(np.float32)

    def run(on_grad):
        layer = tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=3)
        with tecupy.Tape() as tape, tecupy.fp8_autocast(
                fp8_recipe=tecupy.recipe.DelayedScaling(amax_history_len=4)):
            y = layer(x)
        got = tape.gradient(y, layer, on_grad=on_grad)
        released = [isinstance(a, tape_mod._Released)
                    for n in tape._nodes for a in (*n.inputs, *n.outputs)]
        return got, released
    want, released = run(None)
    got, released_on = run(lambda i, g: None)
    assert released_on == released and sum(released) > 0
    for k in want:
        assert sys.getrefcount(got[k]) == sys.getrefcount(want[k]), k


# -- keep_grads=False: on_grad consumes each gradient, the tape keeps none (issue 22) ------

def _handed(tape, out, wrt, **kw):
    """gradient(keep_grads=False) -> (its return, {i: a copy of each gradient passed})."""
    seen = {}

    def on_grad(i, g):
        assert i not in seen
        seen[i] = asnp(g).copy()
    got = tape.gradient(out, wrt, on_grad=on_grad, keep_grads=False, **kw)
    return got, seen


def test_keep_grads_false_hands_over_what_is_returned_otherwise():
    """Arrays used twice, an intermediate asked for, an array wrt holds twice, an unreached
    one and an output: each index passed once, the gradient keep_grads=True returns; the
    call returns None (a list, a dict or a module wrt alike)."""
    from tecupy.tape import record
    rng = np.random.default_rng()
    x, w, z = rng.standard_normal((4, 3)), rng.standard_normal((5, 3)), rng.standard_normal(2)
    keep = {}

    def make():
        with tecupy.Tape() as tape:
            h = tecupy.linear(x, w)
            h2 = h * 2.0
            record(lambda d: (2.0 * d,), (h,), (h2,))
            y = tecupy.add(tecupy.relu(h2), tecupy.linear(x, w))
            tecupy.gelu(z)
        keep.update(h=h, y=y)
        return tape, y
    wrt = lambda: [w, keep["h"], x, w, z, keep["y"]]  # noqa: E731
    tape, y = make()
    want = tape.gradient(y, wrt())
    tape, y = make()
    got, seen = _handed(tape, y, wrt())
    assert got is None and sorted(seen) == list(range(6))
    for i, g in enumerate(want):
        np.testing.assert_array_equal(seen[i], g, err_msg=str(i))
    tape, y = make()
    got, seen = _handed(tape, y, {"w": w, "x": x})
    assert got is None and sorted(seen) == [0, 1]
    np.testing.assert_array_equal(seen[0], want[0])


def test_keep_grads_false_with_a_module_and_fp8():
    """A module's parameters in named_parameters() order, through an FP8 op."""
    x = np.random.default_rng().standard_normal((16, 32)).astype(np.float32)
    lin = tecupy.nn.Linear(32, 16, device="cpu", seed=0)
    tape, y = _fp8_step(lin, x)
    want = tape.gradient(y, lin)
    lin2 = tecupy.nn.Linear(32, 16, device="cpu", seed=0)
    got, seen = _handed(*_fp8_step(lin2, x), lin2)
    assert got is None and sorted(seen) == list(range(len(want)))
    for i, k in enumerate(want):
        np.testing.assert_array_equal(seen[i], want[k], err_msg=k)


def test_keep_grads_false_needs_on_grad_and_a_bool(rng):
    x, w = rng.standard_normal((2, 3)), rng.standard_normal((4, 3))
    with tecupy.Tape() as tape:
        y = tecupy.linear(x, w)
    with pytest.raises(ValueError, match="keep_grads=False needs an on_grad"):
        tape.gradient(y, w, keep_grads=False)
    with pytest.raises(TypeError, match="keep_grads must be a bool; got str"):
        tape.gradient(y, w, on_grad=lambda i, g: None, keep_grads="no")
    np.testing.assert_array_equal(tape.gradient(y, w), np.ones((2, 4)).T @ x)


@pytest.mark.parametrize("fp8, ckpt, w8", [(False, False, False), (True, False, False),
                                           (True, True, False), (True, True, True)],
                         ids=["hp", "fp8", "fp8 checkpoint", "fp8 weights checkpoint"])
def test_a_parameter_may_change_once_handed_over(fp8, ckpt, w8):
    """on_grad scribbles over each parameter (NaN, or an FP8 weight's codes) when it is
    handed over: no later node's backward reads it, so every gradient is as without."""
    from tecupy.fp8_params import FP8Weight
    from tecupy.recipe import DelayedScaling
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 2, 32)).astype(np.float32)
    dy = rng.standard_normal((16, 2, 32)).astype(np.float32)

    def run(scribble):
        r = DelayedScaling(amax_history_len=4)
        with tecupy.quantized_model_init(enabled=w8, recipe=r):
            layers = [tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=s)
                      for s in (1, 2)]
        params = [p for layer in layers for p in layer.parameters()]
        with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=r):
            h = x
            for layer in layers:
                h = tecupy.checkpoint(layer, h) if ckpt else layer(h)
        seen = {}

        def on_grad(i, g):
            seen[i] = g.copy()
            if scribble and isinstance(params[i], FP8Weight):
                params[i].data[...] = 0x7F  # E4M3 NaN
                params[i].data_t[...] = 0x7F
            elif scribble:
                params[i][...] = np.nan
        tape.gradient(h, params, output_grad=dy, on_grad=on_grad, keep_grads=False)
        return seen
    want, got = run(False), run(True)
    assert sorted(got) == sorted(want) == list(range(len(want)))
    for i in want:
        np.testing.assert_array_equal(got[i], want[i], err_msg=str(i))
        assert np.all(np.isfinite(got[i]))

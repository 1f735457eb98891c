"""Autocast and tape state are per thread (context variables): two threads whose steps are
interleaved by a barrier never see each other's Tape, recipe or FP8 states to update.
(Transformer Engine keeps one process-global FP8GlobalStateManager; tecupy's design notes ask
for per-thread state, DESIGN.md.)"""
import threading

import numpy as np
import pytest

import tecupy
from tecupy.autocast import active_recipe
from tecupy.recipe import DelayedScaling
from tecupy.tape import recording


def run_pair(a, b):
    """Run a(step) and b(step) in two threads; step() is a shared barrier that forces the
    interleaving. An exception in either thread fails the test (and breaks the barrier so
    the other thread does not hang)."""
    barrier, errors = threading.Barrier(2, timeout=20), []

    def wrap(fn):
        try:
            fn(barrier.wait)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            barrier.abort()
    threads = [threading.Thread(target=wrap, args=(f,)) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real or errors:
        raise (real or errors)[0]


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_ops_land_only_on_their_own_threads_tape(rng):
    xa, xb = f32(rng, 4), f32(rng, 4)
    out = {}

    def a(step):
        with tecupy.Tape() as tape:
            step()                      # 1: both tapes open
            out["ya"] = tecupy.relu(xa)
            step()                      # 2: a recorded while b's tape is open
            step()                      # 3: b recorded while a's tape is open
        out["ta"] = tape
        assert not recording()
        step()                          # 4: a's tape closed, b's still open

    def b(step):
        with tecupy.Tape() as tape:
            step()
            step()
            out["yb"] = tecupy.relu(xb)
            step()
            step()
            assert recording()          # a's exit did not close b's tape
        out["tb"] = tape
    run_pair(a, b)
    ta, tb = out["ta"], out["tb"]
    assert [n.outputs[0] is out["ya"] for n in ta._nodes] == [True]
    assert [n.outputs[0] is out["yb"] for n in tb._nodes] == [True]
    with pytest.raises(ValueError, match="not produced"):
        ta.gradient(out["yb"], xb)
    np.testing.assert_array_equal(tb.gradient(out["yb"], xb), (xb > 0).astype(np.float32))


def test_autocast_exit_never_pops_the_other_threads_recipe():
    ra, rb = DelayedScaling(amax_history_len=2), DelayedScaling(amax_history_len=3)
    seen = {}

    def a(step):
        with tecupy.fp8_autocast(fp8_recipe=ra):
            step()                      # 1: both autocasts open
            seen["a_inside"] = active_recipe()
        step()                          # 2: a exited
        step()                          # 3: b looked

    def b(step):
        with tecupy.fp8_autocast(fp8_recipe=rb):
            step()
            step()
            seen["b_after_a_exit"] = active_recipe()
            step()
        seen["b_after"] = active_recipe()
    run_pair(a, b)
    assert seen == {"a_inside": ra, "b_after_a_exit": rb, "b_after": None}
    assert active_recipe() is None  # and the main thread never saw either


def test_each_threads_exit_updates_only_its_own_states(rng):
    """The states noted for the forward update belong to the outermost autocast of their
    own thread: a's exit updates a's module, not b's, though b used its module first."""
    la, lb = (tecupy.nn.Linear(32, 16, device="cpu", seed=s) for s in (1, 2))
    xa, xb = f32(rng, 16, 32), f32(rng, 16, 32) * 4
    r = DelayedScaling(amax_history_len=2)
    seen = {}

    def a(step):
        with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
            step()                      # 1: both open
            step()                      # 2: b used its module
            la(xa)
        step()                          # 3: a exited
        seen["b_scale_after_a_exit"] = lb.fp8_state.fwd.scale.copy()
        step()                          # 4

    def b(step):
        with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
            step()
            lb(xb)
            step()
            step()
            step()
    run_pair(a, b)
    assert np.all(seen["b_scale_after_a_exit"] == 1)
    for lin, x in ((la, xa), (lb, xb)):
        want = np.float32(448) / np.float32(np.abs(x).max())
        assert lin.fp8_state.fwd.scale[0] == want


def test_threads_training_in_parallel_match_one_thread(rng):
    """Two threads each training their own layer, steps interleaved, give bit for bit what
    the same steps give in one thread."""
    xs = [f32(rng, 16, 32) for _ in range(3)]
    dy = f32(rng, 16, 16)

    def train(lin, step):
        r = DelayedScaling(amax_history_len=4)
        for x in xs:
            with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=r):
                step()
                y = lin(x)
            g = tape.gradient(y, lin, output_grad=dy)
            lin.weight -= 0.1 * g["weight"]
        return lin

    def solo(seed):
        return train(tecupy.nn.Linear(32, 16, device="cpu", seed=seed), lambda: None)
    pair = [tecupy.nn.Linear(32, 16, device="cpu", seed=s) for s in (5, 6)]
    run_pair(lambda step: train(pair[0], step), lambda step: train(pair[1], step))
    for lin, seed in zip(pair, (5, 6)):
        ref = solo(seed)
        np.testing.assert_array_equal(lin.weight, ref.weight)
        for d in ("fwd", "bwd"):
            for k in ("scale", "amax_history"):
                np.testing.assert_array_equal(getattr(getattr(lin.fp8_state, d), k),
                                              getattr(getattr(ref.fp8_state, d), k))

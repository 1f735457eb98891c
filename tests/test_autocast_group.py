"""fp8_autocast(fp8_group=g) / autocast(amax_reduction_group=g): Transformer Engine's amax
reduction over a data-parallel (or any) group (TE: pytorch/quantization.py, autocast's
amax_reduction_group; the reduction runs when recipe.reduce_amax). On ThreadGroup ranks,
each rank its own data: with the group every rank ends the step with the same forward and
backward scales and amax histories; without it (or with reduce_amax=False) they differ."""
import numpy as np
import pytest

import tecupy
from tecupy import distributed as dist
from tecupy.recipe import DelayedScaling


def _step(g, use_group, reduce_amax=True, spelling="fp8_autocast", ckpt=False):
    """One FP8 step of a Linear on rank g.rank's own data -> (fwd scale, fwd history,
    bwd scale, bwd history)."""
    lin = tecupy.nn.Linear(32, 48, seed=0, params_dtype=np.float32, device="cpu")
    rng = np.random.default_rng(g.rank)
    x = (rng.standard_normal((16, 32)) * (1 + 3 * g.rank)).astype(np.float32)
    dy = (rng.standard_normal((16, 48)) * (1 + 5 * g.rank)).astype(np.float32)
    recipe = DelayedScaling(amax_history_len=4, reduce_amax=reduce_amax)
    group = g if use_group else None
    ctx = (tecupy.fp8_autocast(fp8_recipe=recipe, fp8_group=group)
           if spelling == "fp8_autocast" else
           tecupy.autocast(recipe=recipe, amax_reduction_group=group))
    with tecupy.Tape() as tape, ctx:
        y = tecupy.checkpoint(lin, x) if ckpt else lin(x)
    tape.gradient(y, lin, output_grad=dy)
    s = lin.fp8_state
    return [a.copy() for a in (s.fwd.scale, s.fwd.amax_history, s.bwd.scale,
                               s.bwd.amax_history)]


@pytest.mark.parametrize("spelling", ["fp8_autocast", "autocast"])
@pytest.mark.parametrize("ckpt", [False, True])
def test_group_gives_every_rank_the_same_scales(spelling, ckpt):
    r0, r1 = dist.run_threads(2, _step, True, True, spelling, ckpt)
    for a, b in zip(r0, r1):
        np.testing.assert_array_equal(a, b)
    # the reduced amax is the larger rank's: rank 1's data is the larger
    alone = dist.run_threads(2, _step, False)
    np.testing.assert_array_equal(r0[1], np.maximum(alone[0][1], alone[1][1]))
    np.testing.assert_array_equal(r0[3], np.maximum(alone[0][3], alone[1][3]))


@pytest.mark.parametrize("use_group, reduce_amax", [(False, True), (True, False)])
def test_no_group_or_no_reduce_amax_leaves_ranks_apart(use_group, reduce_amax):
    r0, r1 = dist.run_threads(2, _step, use_group, reduce_amax)
    assert not np.array_equal(r0[0], r1[0]) and not np.array_equal(r0[2], r1[2])


def test_a_later_autocast_without_group_reduces_nothing():
    def body(g):
        lin = tecupy.nn.Linear(16, 16, seed=0, params_dtype=np.float32, device="cpu")
        x = np.full((16, 16), 1.0 + g.rank, np.float32)
        for group in (g, None):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_group=group):
                y = lin(x)
            tape.gradient(y, lin)
            assert lin.fp8_state.autocast_group is group
        return lin.fp8_state.fwd.amax_history.copy()  # (the second step's amaxes differ)
    a, b = dist.run_threads(2, body)
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("make", [lambda g: tecupy.fp8_autocast(fp8_group=g),
                                  lambda g: tecupy.autocast(amax_reduction_group=g)])
def test_a_group_that_is_not_a_process_group_is_refused(make):
    with pytest.raises(TypeError, match=r"(fp8_group|amax_reduction_group).*process group"):
        make("world")

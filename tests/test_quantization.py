"""The FP8 seam: one quantizer per recipe (quantization.py), the only place a recipe is
looked at; ops call the quantizers. scale_inv comes from the cast (IEEE 1 / scale)."""
import ast
import copy
import inspect
import pickle

import numpy as np
import pytest

import tecupy
from tecupy import backends, fp8
from tecupy.fp8 import E4M3, E5M2
from tecupy.fp8_state import FP8State, update_backward
from tecupy.quantization import (CurrentQuantizer, DelayedQuantizer, FP8_ONCE,
                                 gemm_quantizers)
from tecupy.recipe import DelayedScaling, Float8CurrentScaling, Format
from conftest import asnp


def f32(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


def test_no_quantizers_when_fp8_is_off():
    st = FP8State()
    assert gemm_quantizers(st, 0, np) is None
    with tecupy.fp8_autocast(enabled=False):
        assert gemm_quantizers(st, 0, np) is None
    assert st.fwd is None  # nothing bound


def test_delayed_quantizers_are_slots_of_the_state(rng):
    """GEMM g's input, weight and grad_output are slots 3g, 3g + 1 of fwd and 2g of bwd:
    their scale and amax_out are views of the state (the history's row 0); quantize is
    fp8.quantize with that slot, bit for bit, and maxes the amax into the history."""
    st = FP8State(num_gemms=2)
    with tecupy.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3)):
        q = gemm_quantizers(st, 1, np)
    for quant, meta, i, fmt in ((q.input, st.fwd, 3, E4M3), (q.weight, st.fwd, 4, E4M3),
                                (q.grad_output, st.bwd, 2, E5M2)):
        assert isinstance(quant, DelayedQuantizer) and quant.fused_ok and quant.fmt is fmt
        meta.scale[i] = np.float32(rng.uniform(0.5, 4))
        assert quant.scale[0] == meta.scale[i]
        assert np.shares_memory(quant.amax_out, meta.amax_history[0])
        x = f32(rng, 16, 32)
        t = quant.quantize(x, transpose=True)
        want = fp8.quantize(x, meta.scale[i:i + 1].copy(), fmt, transpose=True)
        np.testing.assert_array_equal(t.data, want.data)
        np.testing.assert_array_equal(t.data_t, want.data_t)
        assert t.scale_inv[0] == np.float32(1) / meta.scale[i]
        assert meta.amax_history[0, i] == np.abs(x).max()
    assert q.once == FP8_ONCE and q.after_backward == ((update_backward, st),)


def test_delayed_quantizer_with_dbias(rng):
    st = FP8State()
    with tecupy.fp8_autocast():
        q = gemm_quantizers(st, 0, np)
    dy = f32(rng, 16, 8)
    t, db = q.grad_output.quantize(dy, transpose=True, dbias_dtype=np.float32)
    np.testing.assert_allclose(db, dy.sum(0), rtol=1e-5, atol=1e-6)
    assert t.fmt is E5M2 and t.data_t.shape == (8, 16)


def test_quantizers_follow_the_state(rng):
    """The quantizers kept on the state are remade when its arrays or format change, and
    a pickled or copied state's quantizers are views of its own arrays."""
    st = FP8State()
    with tecupy.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=2)):
        q1 = gemm_quantizers(st, 0, np)
        assert gemm_quantizers(st, 0, np).input is q1.input  # kept
    with tecupy.fp8_autocast(fp8_recipe=DelayedScaling(fp8_format=Format.E4M3,
                                                       amax_history_len=4)):
        q2 = gemm_quantizers(st, 0, np)
    assert q2.grad_output.fmt is E4M3
    assert np.shares_memory(q2.input.amax_out, st.fwd.amax_history)
    assert not np.shares_memory(q1.input.amax_out, st.fwd.amax_history)
    st.fwd.scale[0] = 3.0
    for other in (copy.deepcopy(st), pickle.loads(pickle.dumps(st))):
        assert other.derived == {}
        with tecupy.fp8_autocast(fp8_recipe=DelayedScaling(fp8_format=Format.E4M3,
                                                           amax_history_len=4)):
            q = gemm_quantizers(other, 0, np)
        assert q.input.scale[0] == 3.0 and np.shares_memory(q.input.scale, other.fwd.scale)
        assert not np.shares_memory(q.input.scale, st.fwd.scale)
    fresh = FP8State()
    fresh.load_state_dict(FP8State().state_dict())  # never used: back to unmade
    st.load_state_dict(fresh.state_dict())
    assert st.fwd is None and st.derived == {}


def test_current_quantizers(rng):
    """Float8CurrentScaling: format-only quantizers that cannot fuse and ignore the state;
    DelayedScaling with no state falls back to them in the recipe's format."""
    st = FP8State()
    with tecupy.fp8_autocast(fp8_recipe=Float8CurrentScaling()):
        q = gemm_quantizers(st, 0, np)
    assert st.fwd is None and q.once is None and q.after_backward == ()
    for quant, fmt in ((q.input, E4M3), (q.weight, E4M3), (q.grad_output, E5M2)):
        assert isinstance(quant, CurrentQuantizer) and quant.fmt is fmt
        assert not quant.fused_ok and quant.scale is None and quant.amax_out is None
    x = f32(rng, 16, 32) * 100
    t = q.input.quantize(x)
    want = fp8.quantize_current(x, E4M3)
    np.testing.assert_array_equal(t.data, want.data)
    np.testing.assert_array_equal(t.scale_inv, want.scale_inv)
    with pytest.raises(TypeError, match="fused_ok is False"):
        q.input.wrap(t.data)
    with tecupy.fp8_autocast(fp8_recipe=DelayedScaling(fp8_format=Format.E4M3)):
        q = gemm_quantizers(None, 0, np)
    assert isinstance(q.grad_output, CurrentQuantizer) and q.grad_output.fmt is E4M3


def test_a_recipe_subclass_gets_its_parents_quantizers():
    class MyScaling(DelayedScaling):
        pass
    st = FP8State()
    with tecupy.fp8_autocast(fp8_recipe=MyScaling()):
        assert isinstance(gemm_quantizers(st, 0, np).input, DelayedQuantizer)


def test_wrap_gives_a_fresh_scale_inv(rng):
    """A fused producer's codes become an FP8Tensor with scale_inv = 1 / scale in IEEE
    float32 (subnormal kept), a copy: the update at autocast exit changes the state's."""
    st = FP8State()
    with tecupy.fp8_autocast():
        q = gemm_quantizers(st, 0, np)
    codes = rng.integers(0, 0x7F, (16, 16), dtype=np.uint8)
    for s in (np.float32(3.5), np.float32(2.0 ** 127 * 1.5), np.float32(3e38)):
        st.fwd.scale[0] = s
        t = q.input.wrap(codes)
        assert t.data is codes and t.fmt is E4M3
        assert t.scale_inv.tobytes() == (np.float32(1) / np.array([s], np.float32)).tobytes()
        st.fwd.scale[0] = 1.0
        assert t.scale_inv[0] == np.float32(1) / s


@pytest.mark.parametrize("how", ["cast", "transpose", "dbias"])
def test_quantize_scale_inv_comes_from_the_cast(rng, how):
    """The cast (here the reference) writes scale_inv_out = 1 / scale; quantize hands it
    to the FP8Tensor (no 1 / scale of its own): a subnormal inverse is kept."""
    x = f32(rng, 16, 8)
    for s in (0.37, 2.0 ** 127 * 1.5, 3e38):
        kw = dict(transpose=how != "cast",
                  dbias_dtype=np.float32 if how == "dbias" else None)
        t = tecupy.quantize(x, s, "e4m3", **kw)
        t = t[0] if how == "dbias" else t
        assert t.scale_inv.tobytes() == (np.float32(1) / np.float32(s)).reshape(1).tobytes()
    inv = np.full(1, np.nan, np.float32)
    backends.dispatch("cast_to_fp8", x, np.array([4.0], np.float32), E4M3,
                      scale_inv_out=inv)
    assert inv[0] == 0.25


def _names(module):
    """Every name and attribute an op module's code uses (docstrings and comments aside)."""
    tree = ast.parse(inspect.getsource(module))
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
        {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)} | \
        {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}


def test_ops_never_look_at_the_recipe():
    """ops/linear.py and ops/blocks.py call the quantizers: no recipe, no autocast state,
    no decision on whether a state is there."""
    import importlib
    blocks, linear = (importlib.import_module(f"tecupy.ops.{m}") for m in ("blocks", "linear"))
    banned = {"DelayedScaling", "Float8CurrentScaling", "active_recipe", "use_state",
              "fp8_enabled", "recipe", "quantize_current", "quantize_fwd", "quantize_bwd",
              "fwd_slot", "FP8Tensor"}
    for module in (linear, blocks):
        assert not _names(module) & banned, (module.__name__, _names(module) & banned)


def test_fp8_linear_on_the_tape_updates_the_backward_state_once(rng, monkeypatch):
    """The FP8 nodes' after-backward hook: one update of the backward slots per gradient
    call, for all the states its nodes used (two linears on one state, one on another:
    one call with both states), after every backward of the call."""
    from tecupy import fp8_state
    calls, real = [], fp8_state.update_states
    monkeypatch.setattr(fp8_state, "update_states",
                        lambda states, d: (calls.append((list(states), d)), real(states, d)))
    st, st2 = FP8State(), FP8State()
    x, w1, w2 = f32(rng, 16, 32), f32(rng, 32, 32), f32(rng, 16, 32)
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(fp8_recipe=DelayedScaling(amax_history_len=3)):
            h = tecupy.linear(tecupy.linear(x, w1, fp8_state=st), w1, fp8_state=st2)
            y = tecupy.linear(h, w2, fp8_state=st)
    calls.clear()  # (the forward update at the autocast exit)
    tape.gradient(y, x)
    assert len(calls) == 1 and calls[0][1] == "bwd"
    assert [s is st for s in calls[0][0]] == [True, False] and calls[0][0][1] is st2
    hist = asnp(st.bwd.amax_history)
    assert hist[0, 0] == 0 and hist[2, 0] > 0  # rolled: this step's amax is in the history

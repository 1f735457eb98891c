"""make_graphed_step (tecupy/graphs.py): its errors and seed bookkeeping on the CPU; on the
GPU, replays bit-identical to the same number of eager steps (high precision, FP8 delayed and
current scaling, with and without dropout) and the capture's refusals."""
import numpy as np
import pytest

import tecupy
from tecupy import graphs
from tecupy.recipe import DelayedScaling, Float8CurrentScaling, Format

gpu = pytest.mark.gpu


def _layer(device, dropout=0.0, hidden=128):
    """Heads of 64 (the fused attention kernel's smallest head size: the reference's
    attention calls cuBLAS through CuPy, which refuses capture)."""
    dtype = tecupy.bfloat16 if device == "cuda" else np.float32
    return tecupy.nn.TransformerLayer(hidden, 4 * hidden, 2, hidden_dropout=dropout,
                                      attention_dropout=dropout, params_dtype=dtype,
                                      device=device, seed=0)


# ---- CPU: the API's errors ----------------------------------------------------------------
def test_numpy_sample_args_refused():
    x = np.zeros((32, 2, 128), np.float32)
    with pytest.raises(TypeError, match=r"sample_args\[0\] must be a cupy array"):
        tecupy.make_graphed_step(lambda a, b: a, (x, x))


@pytest.mark.parametrize("kwargs, err, match", [
    ({"fn": 3}, TypeError, "fn must be a step function or a tecupy.nn.Module"),
    ({"warmup_steps": 0}, ValueError, "warmup_steps must be an int >= 1"),
    ({"warmup_steps": 1.5}, TypeError, "warmup_steps must be an int"),
    ({"fp8_recipe": DelayedScaling()}, TypeError, "fp8_enabled and fp8_recipe are for a "
                                                  "module"),
])
def test_bad_arguments(kwargs, err, match):
    args = {"fn": lambda a: a, "sample_args": (np.zeros(4, np.float32),), **kwargs}
    with pytest.raises(err, match=match):
        tecupy.make_graphed_step(args.pop("fn"), args.pop("sample_args"), **args)


def test_module_needs_output_grad():
    layer = _layer("cpu")
    with pytest.raises(ValueError, match="the gradient of its output"):
        tecupy.make_graphed_step(layer, (np.zeros((32, 2, 128), np.float32),))


def test_inside_autocast_refused():
    with tecupy.fp8_autocast(), pytest.raises(RuntimeError, match="inside fp8_autocast"):
        tecupy.make_graphed_step(lambda a: a, (np.zeros(4, np.float32),))


class _Table:  # stands in for the device seed table (only its address is read)
    class data:  # noqa: N801
        ptr = 1 << 20


def test_seeds_drawn_in_a_capture_get_slots():
    """draw_seed remembers each drawn value once (a checkpoint's recompute draws the same
    seed again: same slot), seed_pointer gives its slot's address, other seeds 0."""
    cap = graphs._Capture(_Table)
    token = graphs._capturing.set(cap)
    try:
        rng = np.random.default_rng(5)
        first = graphs.draw_seed(lambda: int(rng.integers(0, 2**63)))
        state = rng.bit_generator.state
        second = graphs.draw_seed(lambda: int(rng.integers(0, 2**63)))
        rng.bit_generator.state = state  # a recompute: the same draw again
        again = graphs.draw_seed(lambda: int(rng.integers(0, 2**63)))
        assert again == second and len(cap.draws) == 2 and cap.values == [first, second]
        assert graphs.seed_pointer(first) == (1 << 20)
        assert graphs.seed_pointer(second) == (1 << 20) + 8
        assert graphs.seed_pointer(12345) == 0 and graphs.seed_pointer(None) == 0
    finally:
        graphs._capturing.reset(token)
    assert graphs.seed_pointer(first) == 0 and not graphs.capturing()


def test_too_many_seeds():
    cap = graphs._Capture(_Table)
    cap.draws = [None] * graphs.MAX_SEEDS
    with pytest.raises(RuntimeError, match="more than 1024 dropout seeds"):
        cap.note_seed(7, None)


def test_next_seed_sequence_unchanged():
    """Module.next_seed goes through graphs.draw_seed: outside a capture the same seeds as
    drawing from the module's generator directly (checkpoints of earlier runs replay)."""
    layer = _layer("cpu")
    rng = np.random.default_rng()
    rng.bit_generator.state = layer.rng.bit_generator.state
    assert [layer.next_seed() for _ in range(3)] == [int(rng.integers(0, 2**63))
                                                     for _ in range(3)]


# ---- GPU: replays against eager steps -----------------------------------------------------
def _inputs(steps, hidden=128, seed=1):
    import cupy
    r = np.random.default_rng(seed)
    return [(cupy.asarray(r.standard_normal((32, 2, hidden)).astype(tecupy.bfloat16)),
             cupy.asarray((r.standard_normal((32, 2, hidden)) * 1e-2).astype(tecupy.bfloat16)))
            for _ in range(steps)]


def _snapshot(y, grads, dx):
    return [np.asarray(a.get()) for a in (y, *grads.values(), *dx)]


RECIPES = {"hp": None, "delayed": DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4),
           "current": Float8CurrentScaling()}


@gpu
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_replays_equal_eager_steps(recipe, dropout):
    """5 steps: eager on one layer; on its twin, 1 warm-up step then the capture and 4
    replays. Outputs, gradients (parameters and input) of every step and the FP8 state and
    generator state at the end: bit-identical."""
    import cupy
    r = RECIPES[recipe]
    data = _inputs(5)
    eager, twin = _layer("cuda", dropout), _layer("cuda", dropout)
    want = []
    for x, dy in data:
        with tecupy.Tape() as tape:
            with tecupy.fp8_autocast(enabled=r is not None, fp8_recipe=r):
                y = eager(x)
        params = eager.named_parameters()
        g = tape.gradient(y, list(params.values()) + [x], output_grad=dy)
        want.append(_snapshot(y, dict(zip(params, g[:-1])), g[-1:]))
    sx, sdy = cupy.empty_like(data[0][0]), cupy.empty_like(data[0][1])
    sx[...], sdy[...] = data[0]
    step = tecupy.make_graphed_step(twin, (sx, sdy), fp8_recipe=r)
    for n, (x, dy) in enumerate(data[1:], 1):
        got = _snapshot(*step(x, dy))
        for i, (a, b) in enumerate(zip(got, want[n])):
            assert a.tobytes() == b.tobytes(), f"step {n + 1}, array {i} differs"
    assert step.replays == 4
    sd_e, sd_t = eager.state_dict(), twin.state_dict()
    assert sd_e.keys() == sd_t.keys()
    for k in sd_e:
        if isinstance(sd_e[k], np.ndarray):
            assert sd_e[k].tobytes() == sd_t[k].tobytes(), k
        else:
            assert sd_e[k] == sd_t[k], k


@gpu
def test_step_function_and_static_outputs():
    """A step function: outputs are the same arrays each call (overwritten in place); the
    sample arrays are the static inputs (passing them copies nothing)."""
    import cupy
    a = cupy.arange(16, dtype=cupy.float32)
    step = tecupy.make_graphed_step(lambda x: (x * 2, {"s": x + 1}), (a,))
    out1 = step(a)
    assert out1[0] is step(cupy.ones(16, cupy.float32))[0]
    assert float(out1[0][3]) == 2.0 and float(out1[1]["s"][3]) == 2.0
    a[...] = 5
    step(a)
    assert float(out1[0][0]) == 10.0


@gpu
def test_call_errors():
    import cupy
    a = cupy.zeros(16, cupy.float32)
    step = tecupy.make_graphed_step(lambda x: x + 1, (a,))
    with pytest.raises(ValueError, match=r"argument 0 must be a cupy array of shape \(16,\)"):
        step(cupy.zeros(8, cupy.float32))
    with pytest.raises(ValueError, match="dtype float32"):
        step(np.zeros(16, np.float32))
    with pytest.raises(TypeError, match="captured with 1 arrays, called with 2"):
        step(a, a)


@gpu
def test_host_sync_in_the_step_is_a_clear_error():
    import cupy
    a = cupy.ones(16, cupy.float32)
    with pytest.raises(RuntimeError, match="could not be captured in a CUDA graph"):
        tecupy.make_graphed_step(lambda x: x * float(x.sum()), (a,))
    with pytest.raises(TypeError, match=r"output\[1\] must be a cupy array"):
        tecupy.make_graphed_step(lambda x: (x + 1, 3.0), (a,))
    assert not graphs.capturing()
    assert float((a + 1).sum()) == 32.0  # the device works after the failed capture


@gpu
def test_checkpointed_step_with_dropout():
    """A step function around tecupy.checkpoint(layer, x), FP8 delayed scaling, dropout: the
    recompute draws the first forward's seeds again (one slot each), so replays equal eager
    steps."""
    import cupy
    r = RECIPES["delayed"]
    data = _inputs(4)

    def make(layer):
        def fn(x, dy):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=r):
                y = tecupy.checkpoint(layer, x)
            return y, tape.gradient(y, layer, output_grad=dy)
        return fn
    eager, twin = _layer("cuda", 0.1), _layer("cuda", 0.1)
    fn_e = make(eager)
    want = [[a.get() for a in (y, *g.values())] for y, g in (fn_e(x, dy) for x, dy in data)]
    sx, sdy = cupy.array(data[0][0]), cupy.array(data[0][1])
    step = tecupy.make_graphed_step(make(twin), (sx, sdy))
    for n, (x, dy) in enumerate(data[1:], 1):
        y, g = step(x, dy)
        for i, (a, b) in enumerate(zip([y, *g.values()], want[n])):
            assert a.get().tobytes() == b.tobytes(), f"step {n + 1}, array {i} differs"


def test_capture_error_names_the_reference_op_that_ran(monkeypatch):
    """A capture refused inside a reference implementation (an op no CUDA kernel takes: its
    CuPy matmul calls cuBLAS, which a capture refuses) names that op in the error."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 4, 2, 32)).astype(np.float32)

    def refused(*args, **kwargs):
        raise NotImplementedError("calling cuBLAS API during stream capture is currently "
                                  "unsupported")
    monkeypatch.setattr(np, "matmul", refused)
    with pytest.raises(NotImplementedError) as err:
        tecupy.dot_product_attention(q, q, q)
    msg = str(graphs._capture_error(err.value))
    assert "reference implementation attention.attention_fwd" in msg, msg
    assert "could not be captured" in msg

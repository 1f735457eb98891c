"""The comm-GEMM overlap of sequence parallel (tecupy/distributed/overlap.py) on the thread
reference communicator: ThreadGroup.shift, the rings' chunk order and sums against the
collectives (int64: exact whatever the order of the sums; float64: exact at 2 ranks), and
the tensor + sequence parallel TransformerLayer with the overlap on equal to the plain
collectives' run within rounding at TP=2 and 4 (NumPy's BLAS sums a row differently for
some M, so a chunk's GEMM is not always bit for bit the full GEMM's rows here; the GPU
tests report bit-exactness), steps two and three included (FP8 with scales from the first
step), and which collectives the layer runs with the overlap on and off."""
import numpy as np
import pytest

import tecupy
from tecupy import distributed as dist
from tecupy.distributed import overlap
from tecupy.distributed.group import ProcessGroup
from tecupy.ops.activation import GATED
from tecupy.recipe import DelayedScaling


def test_shift_sends_to_the_next_rank():
    def body(g):
        x = np.full((3, 2), g.rank, np.float64)
        out = np.empty_like(x)
        assert g.shift(x, out) is out
        with pytest.raises(ValueError, match="out must have"):
            g.shift(x, np.empty((2, 2)))
        with pytest.raises(ValueError, match="must not be x"):
            g.shift(x, x)
        return out
    for n in (1, 2, 4):
        for r, out in enumerate(dist.run_threads(n, body)):
            assert (out == (r - 1) % n).all()


def test_a_group_without_shift_runs_the_collectives(monkeypatch):
    monkeypatch.setattr(overlap, "OVERLAP", True)  # (off by default: PERFLOG, session 16)

    class NoShift(ProcessGroup):
        pass
    assert not NoShift(0, 2).can_shift
    assert not overlap.enabled(NoShift(0, 2), np.zeros(2))

    def body(g):
        return g.can_shift, overlap.enabled(g, np.zeros(2))
    assert dist.run_threads(2, body) == [(True, True)] * 2


def _data(rank, shape, dtype):
    rng = np.random.default_rng(rank + 10)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-2**40, 2**40, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_gather_equals_all_gather_with_each_chunk_once(n):
    def body(g):
        x = _data(g.rank, (4, 3), np.float64)
        seen = []
        full = overlap.ring_gather(g, x, lambda c, chunk: seen.append((c, chunk.copy())))
        assert [c for c, _ in seen] == [(g.rank - j) % n for j in range(n)]
        for c, chunk in seen:
            assert np.array_equal(chunk, full[4 * c:4 * c + 4])
        return full, g.all_gather(x, 0)
    for full, want in dist.run_threads(n, body):
        assert np.array_equal(full, want)


@pytest.mark.parametrize("dtype", [np.int64, np.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_reduce_scatter_equals_reduce_scatter(n, dtype):
    def body(g):
        x = _data(g.rank, (4 * n, 5), dtype)
        asked = []

        def partial(c):
            asked.append(c)
            return x[4 * c:4 * c + 4].copy()
        got = overlap.ring_reduce_scatter(g, partial)
        assert asked == [(g.rank - j - 1) % n for j in range(n)]
        return got, g.reduce_scatter(x, 0)
    for got, want in dist.run_threads(n, body):
        if dtype == np.int64 or n <= 2:  # (2 ranks: one sum, a + b == b + a)
            assert np.array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-14, atol=1e-14)


H, FFN, HEADS, S, B = 64, 128, 4, 16, 2


def _run_overlapped(tp, body, ring):
    """dist.run_threads(tp, body) with overlap.OVERLAP set to `ring` for the run, then put
    back."""
    old = overlap.OVERLAP
    overlap.OVERLAP = ring
    try:
        return dist.run_threads(tp, body)
    finally:
        overlap.OVERLAP = old


def _layer_run(tp, fp8, ring, steps):
    """Every rank's (y, gradients) of `steps` forward + backward of a TP + SP layer."""
    x, dy = (np.random.default_rng(k).standard_normal((S, B, H)) for k in (1, 2))
    dtype = np.float32 if fp8 else np.float64
    x, dy = x.astype(dtype), (dy * 0.1).astype(dtype)
    recipe = DelayedScaling(amax_history_len=4, reduce_amax=True) if fp8 else None

    def body(g):
        layer = tecupy.nn.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0,
                                           attention_dropout=0.0, seed=5, tp_group=g,
                                           sequence_parallel=True, params_dtype=dtype,
                                           device="cpu")
        xs, dys = dist.shard(x, g, 0), dist.shard(dy, g, 0)
        params = layer.named_parameters()
        out = []
        for _ in range(steps):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                y = layer(xs)
            grads = tape.gradient(y, [xs, *params.values()], output_grad=dys)
            out.append([np.asarray(y)] + [np.asarray(a) for a in grads])
        return out
    return _run_overlapped(tp, body, ring)


@pytest.mark.parametrize("fp8", [False, True], ids=["f64", "fp8"])
@pytest.mark.parametrize("tp", [2, 4])
def test_layer_with_overlap_equals_the_collectives(tp, fp8):
    steps = 3 if fp8 else 1
    on, off = _layer_run(tp, fp8, True, steps), _layer_run(tp, fp8, False, steps)
    for r in range(tp):
        for s in range(steps):
            for k, (a, b) in enumerate(zip(on[r][s], off[r][s])):
                assert a.shape == b.shape and a.dtype == b.dtype
                err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)
                assert err < (1e-5 if fp8 else 1e-13), (r, s, k, err)


def test_overlap_runs_the_rings(monkeypatch):
    """With OVERLAP on, the TP + SP layer moves its sequence chunks by shift() (the
    forward's gathers and reduce-scatters, the backward's dgrad reduce-scatters and the
    attention proj's dy gather), and runs the collectives only around LayerNormMLP's fc2
    (act + fc2 computed in ops.blocks: nn/layers.py does not call act_then_row_parallel
    yet); with OVERLAP_DY off the proj's dy is all-gathered too; OVERLAP off, no shift."""
    calls = {True: [], False: []}

    class Spy(dist.ThreadGroup):
        def _shift(self, x, out):
            calls[overlap.OVERLAP].append(("shift", x.shape))
            return super()._shift(x, out)

        def _all_gather(self, x, axis):
            calls[overlap.OVERLAP].append(("all_gather", x.shape))
            return super()._all_gather(x, axis)

        def _reduce_scatter(self, x, axis, op):
            calls[overlap.OVERLAP].append(("reduce_scatter", x.shape))
            return super()._reduce_scatter(x, axis, op)

    def body(g):
        spy = Spy(g._world, g.rank)
        layer = tecupy.nn.TransformerLayer(H, FFN, HEADS, hidden_dropout=0.0,
                                           attention_dropout=0.0, seed=5, tp_group=spy,
                                           sequence_parallel=True, params_dtype=np.float64,
                                           device="cpu")
        x = np.ones((S // 2, B, H))
        with tecupy.Tape() as tape:
            y = layer(x)
        tape.gradient(y, [x], output_grad=np.ones_like(y))
    def kinds(got):
        return {k: sum(1 for c in got if c[0] == k) / 2 for k in
                ("shift", "all_gather", "reduce_scatter")}
    for ring in (True, False):
        monkeypatch.setattr(overlap, "OVERLAP", ring)
        dist.run_threads(2, body)
    # forward: qkv, fc1 gathers, proj and fc2 ring RS (1 step each at 2 ranks); backward:
    # qkv, fc1 dgrad ring RS, proj's and fc2's dy ring gathers
    assert kinds(calls[True]) == {"shift": 8, "all_gather": 0, "reduce_scatter": 0}
    assert not any(c[0] == "shift" for c in calls[False])
    monkeypatch.setattr(overlap, "OVERLAP", True)
    monkeypatch.setattr(overlap, "OVERLAP_DY", False)
    calls[True].clear()
    dist.run_threads(2, body)
    # without the dy rings: proj's and fc2's dy all-gathered plainly
    assert kinds(calls[True]) == {"shift": 6, "all_gather": 2, "reduce_scatter": 0}


def _act_row(tp, fp8, activation, ring):
    """Every rank's (y, dh, dfc1_bias, dfc2_weight, dfc2_bias) of act_then_row_parallel
    (two steps under FP8: the second with the first's scales)."""
    from tecupy.distributed.tensor_parallel import act_then_row_parallel
    gated = activation in GATED
    ffn, n = 32 * (2 if gated else 1), 48

    def body(g):
        rng = np.random.default_rng(g.rank + 20)
        h = rng.standard_normal((16, 2, ffn))
        b1, w2 = rng.standard_normal(ffn) * 0.1, rng.standard_normal((n, 32)) * 0.2
        b2, dy = rng.standard_normal(n) * 0.1, rng.standard_normal((16 // tp, 2, n))
        if fp8:
            h, b1, w2, b2, dy = (a.astype(np.float32) for a in (h, b1, w2, b2, dy))
        state = tecupy.FP8State(num_gemms=2)
        state.amax_group = g
        recipe = DelayedScaling(amax_history_len=4, reduce_amax=True)
        out = []
        for _ in range(2 if fp8 else 1):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                y = act_then_row_parallel(np, h, b1, activation, w2, b2, g, state, True)
            out.append([np.asarray(y)] + [np.asarray(a) for a in tape.gradient(
                y, [h, b1, w2, b2], output_grad=dy)])
        return out
    return _run_overlapped(tp, body, ring)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("fp8", [False, True], ids=["f64", "fp8"])
@pytest.mark.parametrize("tp", [2, 4])
def test_act_then_row_parallel_ring_equals_the_collective(tp, fp8, activation):
    """LayerNormMLP's activation + fc2 + reduce-scatter (tensor_parallel.act_then_row_
    parallel): the ring (fc2's GEMM per travelling chunk; FP8: the activation writes fc2's
    codes) against _act_then_linear + reduce_row_output, output and gradients."""
    on, off = _act_row(tp, fp8, activation, True), _act_row(tp, fp8, activation, False)
    for r in range(tp):
        for s, (a_step, b_step) in enumerate(zip(on[r], off[r])):
            for k, (a, b) in enumerate(zip(a_step, b_step)):
                assert a.shape == b.shape and a.dtype == b.dtype, (r, s, k)
                err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)
                assert err < (1e-5 if fp8 else 1e-13), (r, s, k, err)

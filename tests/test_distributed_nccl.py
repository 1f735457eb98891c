"""NcclGroup on real GPUs (2+, one process each, spawned): collectives against NumPy for
every dtype, split subgroups, data-parallel gradient averaging on the side stream, the
all-reduce overlapped with the backward (Tape.gradient's on_grad driving GradientReducer)
bit-identical to the all-reduce after it (bf16 and FP8 TransformerLayer), a TP=2
column -> gelu -> row MLP (nn.Linear) against the single-GPU run in high precision and
under fp8_autocast, a TP=2 TransformerLayer with and without sequence parallel against the
single GPU (float32 and FP8 with reduce_amax), a gradient of >= bucket_mb reduced with no
copy, ZeRO-1 (ZeroOptimizer) equal to plain data parallel (bit for bit on 2 ranks; with
max_grad_norm; with FP8 weights under each recipe, against the plain optimizer), a
raising rank ending every rank within 10 s, an init timeout naming the absent rank, and the
comm-GEMM overlap of sequence parallel (shift, the rings against the collectives, a TP=2
layer with the overlap on against it off). Skipped unless CuPy sees 2+ GPUs and loads NCCL.

    python -m pytest -q -s -p no:cacheprovider tests/test_distributed_nccl.py

prints one table row per check (-s shows them)."""
import contextlib
import os
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import pytest

from tecupy import distributed as dist
from tecupy._array import bfloat16


def _gpus():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import cupy
            from cupy.cuda import nccl
            return cupy.cuda.runtime.getDeviceCount() if nccl.available else 0
    except Exception:  # noqa: BLE001 - no CUDA, no NCCL: skipped
        return 0


NGPU = _gpus()
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(NGPU < 2, reason="needs 2+ GPUs visible to CuPy and NCCL")]
N = min(NGPU, 4)
DTYPES = [np.float32, np.float16, bfloat16, np.uint8, np.int32, np.int64]
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@pytest.fixture(scope="module", autouse=True)
def _table_header():
    print("\n| check | ranks | result | detail |\n| --- | --- | --- | --- |")


def row(check, ranks, result, detail=""):
    print(f"\n| {check} | {ranks} | {result} | {detail} |")


def _data(rank, dtype, shape=(12, 12)):
    rng = np.random.default_rng(rank)
    return (rng.standard_normal(shape) * 8).astype(dtype)


def _xp(g):
    """The group's array module (cupy; numpy where a test drives these with a fake NCCL)."""
    return g._job.api.xp


def _np(a):
    return a.get() if hasattr(a, "get") else np.asarray(a)


def _collectives(g):
    cupy = _xp(g)
    out = {}
    for dt in DTYPES:
        x = cupy.asarray(_data(g.rank, dt))
        res = [g.all_reduce(x.copy()), g.all_reduce(x.copy(), op="max"),
               g.all_gather(x, axis=0), g.all_gather(x[:, 1:], axis=1),
               g.reduce_scatter(x, axis=0), g.reduce_scatter(x, axis=1, op="max"),
               g.broadcast(x.copy(), root=g.size - 1)]
        out[np.dtype(dt).name] = [_np(a) for a in res]
    many = [cupy.asarray(_data(g.rank, dt)) for dt in DTYPES]  # one NCCL group
    got = g.all_reduce_many([m for m in many], "max")
    out["many"] = [_np(a) for a in got] + [_np(g.all_reduce(cupy.asarray(_data(g.rank, dt)),
                                                            op="max")) for dt in DTYPES]
    if cupy is not np:
        with pytest.raises(TypeError, match="x must be a cupy array on this rank's GPU"):
            g.all_reduce(np.ones(3, np.float32))
    with pytest.raises(TypeError, match="dtype complex64 is not supported"):
        g.all_reduce(cupy.ones(3, cupy.complex64))
    g.barrier()
    return out


def _close(got, want, exact, what):
    if exact:
        np.testing.assert_array_equal(got, want, err_msg=what)
        return 0.0
    tol = 1e-5 if got.dtype == np.float32 else 2e-2
    got, want = got.astype(np.float64), want.astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * 8, err_msg=what)
    return float(np.max(np.abs(got - want)))


def test_collectives_equal_numpy():
    """Sums bit-exact for integers and for 2 ranks (a + b commutes), else within the
    dtype's tolerance (NCCL's order is not rank order); everything else bit-exact."""
    t0 = time.perf_counter()
    got = dist.spawn(_collectives, N, timeout=120)
    for r in range(N):  # all_reduce_many (one group) = one all_reduce each (max: exact)
        many = got[r]["many"]
        for a, b in zip(many[:len(DTYPES)], many[len(DTYPES):]):
            np.testing.assert_array_equal(a, b)
    worst = 0.0
    for dt in DTYPES:
        name = np.dtype(dt).name
        xs = [_data(r, dt) for r in range(N)]
        acc = xs[0].copy()
        for x in xs[1:]:
            acc += x
        mx = np.max(xs, axis=0)
        exact = N == 2 or np.issubdtype(np.dtype(dt), np.integer)
        for r in range(N):
            s, m, g0, g1, rs, rsm, b = got[r][name]
            worst = max(worst, _close(s, acc, exact, f"{name} all_reduce rank {r}"),
                        _close(rs, np.split(acc, N, 0)[r], exact,
                               f"{name} reduce_scatter rank {r}"))
            np.testing.assert_array_equal(m, mx)
            np.testing.assert_array_equal(g0, np.concatenate(xs, 0))
            np.testing.assert_array_equal(g1, np.concatenate([x[:, 1:] for x in xs], 1))
            np.testing.assert_array_equal(rsm, np.split(mx, N, axis=1)[r])
            np.testing.assert_array_equal(b, xs[N - 1])
    row("collectives x 6 dtypes vs NumPy", N, "ok",
        f"{'bit-exact' if N == 2 else f'max float sum err {worst:.2g}'}; "
        f"{time.perf_counter() - t0:.1f} s incl. spawn")


def _splits(g):
    cupy = _xp(g)
    pair = g.split(color=0, key=-g.rank)  # every rank, order reversed
    alone = g.split(color=g.rank)
    first = g.split(color=None if g.rank else 0)
    halves = g.split(color=g.rank % 2, key=g.rank) if g.size == 4 else None
    r = [pair.rank, _np(pair.all_gather(cupy.array([g.rank]))).tolist(),
         alone.size, _np(alone.all_reduce(cupy.array([g.rank + 1.0])))[0],
         first is None]
    if halves is not None:
        r.append(_np(halves.all_reduce(cupy.array([float(g.rank)])))[0])
    return r


def test_split_subgroups():
    got = dist.spawn(_splits, N, timeout=120)
    for r, o in enumerate(got):
        assert o[:5] == [N - 1 - r, list(range(N - 1, -1, -1)), 1, r + 1.0, r != 0]
        if N == 4:
            assert o[5] == (2.0 if r % 2 == 0 else 4.0)
    row("split (commSplit): reversed, singletons", N, "ok")


def _grads(g):
    cupy = _xp(g)
    rng = np.random.default_rng(g.rank)
    host = [rng.standard_normal(s).astype(dt) for s, dt in
            (((256, 64), np.float32), ((64,), np.float32), ((128, 256), bfloat16),
             ((3000,), np.float32))]
    grads = [cupy.asarray(a) for a in host]
    dist.all_reduce_gradients(grads, g, bucket_mb=0.05)  # several buckets
    # the hook's path: gradients ready last-first, buckets all-reduced on a side stream
    again = [cupy.asarray(a) for a in host]
    reducer = dist.GradientReducer(g, again, bucket_mb=0.05)
    for i in reversed(range(len(again))):
        reducer.ready(i, again[i])
    means = reducer.finish()  # (new arrays: `again` is only read)
    return [_np(a) for a in grads], [_np(a) for a in means]


def test_all_reduce_gradients_mean():
    got = dist.spawn(_grads, N, timeout=120)
    rngs = [np.random.default_rng(r) for r in range(N)]
    shapes = [((256, 64), np.float32), ((64,), np.float32), ((128, 256), bfloat16),
              ((3000,), np.float32)]
    per = [[rng.standard_normal(s).astype(dt) for s, dt in shapes] for rng in rngs]
    for i, (_, dt) in enumerate(shapes):
        mean = np.mean([p[i].astype(np.float64) for p in per], axis=0)
        tol = 1e-6 if dt == np.float32 else 2e-2
        for r in range(N):
            after, hooked = got[r][0][i], got[r][1][i]
            np.testing.assert_allclose(after.astype(np.float64), mean, rtol=tol, atol=tol)
            np.testing.assert_array_equal(after, got[0][0][i])  # every rank the same bits
            np.testing.assert_array_equal(hooked, after)  # side stream, any order: the same
    row("all_reduce_gradients / GradientReducer", N, "ok",
        "mean; same bits on every rank and on the side stream")


def _dp_overlap(g, fp8):
    """Data parallel: twin TransformerLayers of one seed, this rank's batch, 2 steps; one
    through reducer.gradient (Tape.gradient's on_grad: each bucket all-reduced on a side
    stream while the backward goes on), the other through tape.gradient then
    all_reduce_gradients over the same buckets (the reducer's reverse order); -> per step
    the two paths' gradients (NumPy), whether a side stream ran, the bucket count. bf16 on
    the GPU; float32 on NumPy (tests/test_distributed_launch.py runs it over a fake NCCL)."""
    import tecupy
    cupy = _xp(g)
    gpu = cupy is not np
    dt = bfloat16 if gpu else np.float32
    mk = dict(params_dtype=dt, device="cuda" if gpu else "cpu", seed=0, hidden_dropout=0.0,
              attention_dropout=0.0)
    twins = [tecupy.nn.TransformerLayer(256, 1024, 4, **mk) for _ in "ab"]
    reducer = dist.GradientReducer(g, twins[0], bucket_mb=0.5)
    recipe = tecupy.recipe.DelayedScaling(amax_history_len=4) if fp8 else None
    out = []
    for step in range(2):
        rng = np.random.default_rng(100 * step + g.rank)
        x, dy = (cupy.asarray((rng.standard_normal((64, 2, 256)) * s).astype(dt))
                 for s in (1.0, 1e-2))
        res = []
        for k, layer in enumerate(twins):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                y = layer(x)
            if k == 0:
                grads = reducer.gradient(tape, y, output_grad=dy)
            else:
                grads = tape.gradient(y, layer, output_grad=dy)
                dist.all_reduce_gradients(list(grads.values())[::-1], g, bucket_mb=0.5)
            res.append({n: _np(a) for n, a in grads.items()})
        out.append(res)
    return out, reducer._stream is not None, len(reducer.buckets)


def check_dp_overlap(got, gpu):
    """Every rank, every step: the overlapped gradients bit-identical to those averaged
    after the backward, and the same bits on every rank."""
    for r, (steps, side, nbuckets) in enumerate(got):
        assert side == gpu and nbuckets > 2
        for step, (over, after) in enumerate(steps):
            assert list(over) == list(after)
            for k in after:
                np.testing.assert_array_equal(over[k], after[k],
                                              err_msg=f"{k} rank {r} step {step}")
                np.testing.assert_array_equal(after[k], got[0][0][step][1][k])
    return nbuckets


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
def test_dp_overlapped_equals_all_reduce_after_the_backward(fp8):
    t0 = time.perf_counter()
    nbuckets = check_dp_overlap(dist.spawn(_dp_overlap, N, fp8, timeout=300), gpu=True)
    row(f"DP: on_grad overlap vs after ({'fp8' if fp8 else 'bf16'})", N, "ok",
        f"bit-identical, {nbuckets} buckets, 2 steps; {time.perf_counter() - t0:.1f} s")


def _no_copy(g):
    """A (512, 256) float32 gradient (512 KiB) with 256 KiB buckets: all_reduce_gradients
    all-reduces it in place (same pointer), the reducer into a new array leaving it as it
    was; NcclGroup.all_reduce_into and the in-place all_gather_into against NumPy."""
    xp, api = _xp(g), g._job.api
    host = _no_copy_host(g.rank)
    a = [xp.array(h) for h in host]  # (copies, on NumPy too)
    ptr = api.ptr(a[0])
    dist.all_reduce_gradients(a, g, bucket_mb=0.25)
    b = [xp.array(h) for h in host]
    reducer = dist.GradientReducer(g, b, bucket_mb=0.25)
    assert reducer.direct == [False, True]  # (reverse order: the small one first)
    for i in reversed(range(2)):
        reducer.ready(i, b[i])
    means = reducer.finish()
    untouched = all(np.array_equal(_np(x), h) for x, h in zip(b, host))
    x = xp.array(host[1])
    out = g.all_reduce_into(x, xp.empty_like(x))
    full = xp.zeros(100 * g.size, np.float32)
    mine = full[g.rank * 100:(g.rank + 1) * 100]
    mine[...] = x
    g.all_gather_into(mine, full)  # NCCL's in-place all-gather
    return ([_np(v) for v in a], [_np(v) for v in means], api.ptr(a[0]) == ptr, untouched,
            _np(out), _np(full))


def _no_copy_host(rank):
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(s).astype(np.float32) for s in ((512, 256), (100,))]


def check_no_copy(got, exact):
    host = [_no_copy_host(r) for r in range(len(got))]
    for r, (inplace, means, same_ptr, untouched, out, full) in enumerate(got):
        assert same_ptr and untouched
        for i in range(2):
            np.testing.assert_array_equal(inplace[i], means[i])  # in place == into: same bits
            np.testing.assert_array_equal(means[i], got[0][1][i])  # every rank
            mean = np.mean([h[i].astype(np.float64) for h in host], axis=0)
            np.testing.assert_allclose(means[i], mean, rtol=1e-6, atol=1e-6)
        _close(out, np.sum([h[1] for h in host], axis=0, dtype=np.float32), exact,
               f"all_reduce_into rank {r}")
        np.testing.assert_array_equal(full, np.concatenate([h[1] for h in host]))


def test_large_gradients_reduced_with_no_copy():
    got = dist.spawn(_no_copy, N, timeout=120)
    check_no_copy(got, exact=N == 2)
    row("DP: a gradient >= bucket_mb reduced with no copy", N, "ok",
        "all_reduce_gradients in place, the reducer out of place (input untouched), the "
        "same bits; all_reduce_into, in-place all_gather_into")


def _zero_vs_dp(g, fp8, hidden=256, bucket_mb=0.25, clip=None):
    """ZeRO-1 vs plain data parallel: three TransformerLayers of one seed (bf16 on the GPU,
    float32 on NumPy), 2 steps of this rank's batch through (a) GradientReducer.gradient
    then AdamW over every parameter, (b) ZeroOptimizer.gradient (reduce-scatter overlapped
    with the backward) then its step, (c) tape.gradient then ZeroOptimizer.step; buckets of
    a quarter MiB at hidden 256 (bf16): qkv, fc1 and fc2 alone (no copy, their shards views
    of the parameters). clip: every optimizer's max_grad_norm.
    -> per step the three's parameters (NumPy), (b)'s count of parameters reduced alone
    (-1 unless each is a view), its state over plain's, and per step the three's
    last_grad_norm (with clip)."""
    import tecupy
    xp = _xp(g)
    gpu = xp is not np
    dt = bfloat16 if gpu else np.float32
    mk = dict(params_dtype=dt, device="cuda" if gpu else "cpu", seed=0, hidden_dropout=0.0,
              attention_dropout=0.0)
    layers = [tecupy.nn.TransformerLayer(hidden, 4 * hidden, 4, **mk) for _ in "abc"]
    opt = dict(lr=1e-3, weight_decay=0.1, max_grad_norm=clip)
    reducer = dist.GradientReducer(g, layers[0], bucket_mb=bucket_mb)
    plain = tecupy.optim.AdamW(layers[0].named_parameters(), **opt)
    zeros = [dist.ZeroOptimizer(tecupy.optim.AdamW, layer, g, bucket_mb=bucket_mb, **opt)
             for layer in layers[1:]]
    recipe = tecupy.recipe.DelayedScaling(amax_history_len=4) if fp8 else None
    out, norms = [], []
    for step in range(2):
        rng = np.random.default_rng(100 * step + g.rank)
        x, dy = (xp.asarray((rng.standard_normal((64, 2, hidden)) * s).astype(dt))
                 for s in (1.0, 1e-2))
        for k, layer in enumerate(layers):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                y = layer(x)
            if k == 0:
                plain.step(reducer.gradient(tape, y, output_grad=dy))
            elif k == 1:
                zeros[0].step(zeros[0].gradient(tape, y, output_grad=dy))
            else:
                zeros[1].step(tape.gradient(y, layer, output_grad=dy))
        out.append([{n: _np(p) for n, p in layer.named_parameters().items()}
                    for layer in layers])
        if clip:
            norms.append([float(_np(o.last_grad_norm)[0]) for o in (plain, *zeros)])
    state = sum(v.size for v in zeros[0].state_dict().values() if isinstance(v, np.ndarray))
    full = sum(v.size for v in plain.state_dict().values() if isinstance(v, np.ndarray))
    direct = [s.view for s, d in zip(zeros[0].segments, zeros[0].reducer.direct) if d]
    return out, len(direct) if all(direct) else -1, state / full, norms


def check_zero(got, exact):
    """Every rank, every step: ZeRO's parameters (overlapped and after) equal to plain data
    parallel's (bit for bit where exact, else within bf16's tolerance) and the same bits on
    every rank; qkv, fc1, fc2 (and on NumPy proj: float32) are views; the state per rank
    about 1/N."""
    n, worst = len(got), 0.0
    for r, (steps, views, share, _) in enumerate(got):
        assert views >= 3 and share < 1.0 / n + 0.01, (views, share)
        for step, runs in enumerate(steps):
            for j in (1, 2):  # ZeRO overlapped, ZeRO after
                for k, want in runs[0].items():
                    what = f"{k} rank {r} step {step} run {j}"
                    worst = max(worst, _close(runs[j][k], want, exact, what))
                    np.testing.assert_array_equal(runs[j][k], got[0][0][step][j][k], what)
    return worst


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
def test_zero_equals_plain_data_parallel(fp8):
    """2 ranks: bit for bit (a + b commutes, whatever the collective). N > 2 (4 GPUs):
    NCCL's reduce-scatter may add in another order than its all-reduce: within bf16's
    tolerance, the table says how far."""
    for n in sorted({2, N}):
        t0 = time.perf_counter()
        worst = check_zero(dist.spawn(_zero_vs_dp, n, fp8, timeout=300), exact=n == 2)
        row(f"ZeRO-1 vs plain DP ({'fp8' if fp8 else 'bf16'})", n, "ok",
            f"{'bit-identical' if worst == 0 else f'max diff {worst:.2g}'}, 2 steps, "
            f"overlapped and after; {time.perf_counter() - t0:.1f} s")


def check_zero_clipped(got):
    """max_grad_norm 0.5, far below the gradients' norm: ZeRO's last_grad_norm (the shards'
    sums of squares all-reduced) the same on every rank and equal to plain data parallel's
    to float32 rounding; the parameters within bf16's tolerance (the clip factors differ in
    the last bits: the sums run in another order)."""
    for steps, views, share, norms in got:
        assert norms == got[0][3]
        for plain, *zeros in norms:
            assert plain > 0.5 and all(abs(z - plain) <= 1e-5 * plain for z in zeros), norms
    return check_zero(got, exact=False)


def test_zero_clipped_equals_plain_data_parallel():
    for n in sorted({2, N}):
        t0 = time.perf_counter()
        worst = check_zero_clipped(dist.spawn(_zero_vs_dp, n, False, 256, 0.25, 0.5,
                                                     timeout=300))
        row("ZeRO-1 vs plain DP, max_grad_norm 0.5 (bf16)", n, "ok",
            f"max diff {worst:.2g}, the same norm on every rank; "
            f"{time.perf_counter() - t0:.1f} s")


def _zero_fp8_weights(g, recipe_name, hidden=64, bucket_mb=16 / 1024):
    """FP8 weights (quantized_model_init) under ZeRO-1 vs the plain optimizer over all of
    them: two TransformerLayers of one seed (bf16 on the GPU, float32 on NumPy) made under
    the recipe, 3 steps of this rank's batch under fp8_autocast, GradientReducer.gradient
    then AdamW vs ZeroOptimizer.gradient then its step. bucket_mb: 16 KiB puts each FP8
    weight in a bucket of its own (its codes gathered in place), 1 MiB puts them together.
    -> (each layer's {name: array, or (codes, transposed codes, scale_inv) of an FP8
    weight}, the plain optimizer's master copies of the FP8 weights, per FP8 bucket
    ([(name, offset, size)], this rank's shard of its masters), the FP8 codes at init)."""
    import tecupy
    xp = _xp(g) if hasattr(g, "_job") else np
    gpu = xp is not np
    dt = bfloat16 if gpu else np.float32
    recipe = {"delayed": tecupy.recipe.DelayedScaling(amax_history_len=4),
              "current": tecupy.recipe.Float8CurrentScaling(),
              "block": tecupy.recipe.Float8BlockScaling(  # (float32 scales: any amax shows)
                  fp8_quant_fwd_weight=tecupy.recipe.QParams(power_2_scale=False))}[recipe_name]
    mk = dict(params_dtype=dt, device="cuda" if gpu else "cpu", seed=0, hidden_dropout=0.0,
              attention_dropout=0.0)
    with tecupy.quantized_model_init(recipe=recipe):
        layers = [tecupy.nn.TransformerLayer(hidden, 4 * hidden, 4, **mk) for _ in "ab"]
    opt = dict(lr=1e-3, weight_decay=0.1)
    reducer = dist.GradientReducer(g, layers[0], bucket_mb=bucket_mb)
    plain = tecupy.optim.AdamW(layers[0].named_parameters(), **opt)
    zero = dist.ZeroOptimizer(tecupy.optim.AdamW, layers[1], g, bucket_mb=bucket_mb, **opt)
    first = {n: np.array(_np(p.data)) for n, p in layers[0].named_parameters().items()
             if isinstance(p, tecupy.FP8Weight)}
    for step in range(3):
        rng = np.random.default_rng(100 * step + g.rank)
        x, dy = (xp.asarray((rng.standard_normal((16, 2, hidden)) * s).astype(dt))
                 for s in (1.0, 1e-2))
        for layer, opt in zip(layers, (plain, zero)):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
                y = layer(x)
            grads = (reducer if opt is plain else zero).gradient(tape, y, output_grad=dy)
            opt.step(grads)
    state = [{n: tuple(_np(a) for a in (p.data, p.data_t, p.scale_inv))
              if isinstance(p, tecupy.FP8Weight) else _np(p)
              for n, p in layer.named_parameters().items()} for layer in layers]
    names = {id(p): n for n, p in layers[1].named_parameters().items()}
    sd = plain.state_dict()
    masters = {n: sd[f"master.{n}"] for n, p in layers[0].named_parameters().items()
               if isinstance(p, tecupy.FP8Weight)}
    shards = [([(names[id(w)], at, w.size) for w, at in s.members], _np(s.chunk))
              for s in zero.segments if s.fp8]
    return state, masters, shards, first


def _arrays(v):
    return v if isinstance(v, tuple) else (v,)


def check_zero_fp8_weights(got):
    """Every rank, both layers: rank 0's plain layer's parameters, FP8 codes (both copies)
    and scale_inv, bit for bit; the ranks' shards of the master copies, laid end to end,
    the plain optimizer's masters; every FP8 weight sharded; the steps moved the codes."""
    ref = got[0][0][0]
    for r, (state, _, _, _) in enumerate(got):
        for run in state:
            for k, want in ref.items():
                for a, b in zip(_arrays(want), _arrays(run[k])):
                    np.testing.assert_array_equal(b, a, err_msg=f"{k} rank {r}")
    masters, buckets, first = got[0][1], got[0][2], got[0][3]
    for b, (members, _) in enumerate(buckets):
        flat = np.concatenate([ranks[2][b][1] for ranks in got])
        for name, at, size in members:
            np.testing.assert_array_equal(flat[at:at + size], masters[name].reshape(-1),
                                          err_msg=name)
    assert sorted(n for m, _ in buckets for n, _, _ in m) == sorted(masters)
    assert any(not np.array_equal(first[k], ref[k][0]) for k in first)


@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
def test_zero_fp8_weights_equal_the_plain_optimizer(recipe):
    t0 = time.perf_counter()
    check_zero_fp8_weights(dist.spawn(_zero_fp8_weights, 2, recipe, 256, 0.25, timeout=300))
    row(f"ZeRO-1 with FP8 weights ({recipe}) vs the plain optimizer", 2, "ok",
        f"codes, scale_inv and masters bit-identical, 3 steps; "
        f"{time.perf_counter() - t0:.1f} s")


def _mlp(g, fp8):
    """TP=2 (ranks 0, 1) column -> gelu -> row MLP of nn.Linear and, on rank 0, the
    single-GPU MLP of the same seeds; -> outputs and gradients (NumPy)."""
    import tecupy
    cupy = _xp(g)
    rng = np.random.default_rng(7)
    x = cupy.asarray(rng.standard_normal((64, 256)).astype(np.float32))
    dy = cupy.asarray(rng.standard_normal((64, 256)).astype(np.float32))
    tp = g.split(color=0 if g.rank < 2 else None)
    mk = dict(params_dtype=np.float32, device="cpu" if cupy is np else "cuda")

    def run(fc1, fc2):
        ctx = tecupy.fp8_autocast(fp8_recipe=tecupy.recipe.DelayedScaling()) if fp8 else \
            contextlib.nullcontext()
        with tecupy.Tape() as tape, ctx:
            y = fc2(tecupy.gelu(fc1(x)))
        grads = tape.gradient(y, [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias],
                              output_grad=dy)
        return [_np(a) for a in [y, *grads]]
    if tp is None:
        return None
    a = tecupy.nn.Linear(256, 1024, seed=5, parallel_mode="column", tp_group=tp, **mk)
    b = tecupy.nn.Linear(1024, 256, seed=6, parallel_mode="row", tp_group=tp, **mk)
    out = {"tp": run(a, b)}
    if g.rank == 0:
        out["single"] = run(tecupy.nn.Linear(256, 1024, seed=5, **mk),
                            tecupy.nn.Linear(1024, 256, seed=6, **mk))
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
def test_tp2_mlp_equals_single_gpu(fp8):
    got = dist.spawn(_mlp, N, fp8, timeout=120)
    want = got[0]["single"]
    rtol, atol = (0.125, 0.0675) if fp8 else (1e-5, 1e-5)  # E4M3; float32 with K split
    exact, worst = [], 0.0
    names = ["y", "dx", "dw1", "db1", "dw2", "db2"]
    for r in range(2):
        for name, a, full, axis in zip(names, got[r]["tp"], want, (None, None, 0, 0, 1, None)):
            ref = full if axis is None else np.split(full, 2, axis=axis)[r]
            np.testing.assert_allclose(a, ref, rtol=rtol, atol=atol, err_msg=f"{name} rank {r}")
            worst = max(worst, float(np.max(np.abs(a - ref))))
            if np.array_equal(a, ref):
                exact.append(f"{name}@{r}")
    row(f"TP=2 MLP vs 1 GPU ({'fp8' if fp8 else 'fp32 HP'})", 2, "ok",
        f"max abs err {worst:.2g}; bit-exact: {', '.join(exact) or 'none'}")


def _cut(a, r, tp, axis, parts=None):
    """Rank r's piece of a full tensor (np.split: not tecupy's shard)."""
    if parts is None:
        return np.split(a, tp, axis=axis)[r]
    pieces = np.split(a, np.cumsum(parts)[:-1], axis=axis)
    return np.concatenate([np.split(p, tp, axis=axis)[r] for p in pieces], axis=axis)


TP_LAYER = dict(hidden=256, ffn=1024, heads=8, s=128, b=2)


def _tp_layer(g, sp, fp8, c=TP_LAYER):
    """TP=2 (ranks 0, 1) TransformerLayer, sequence parallel or not, and on rank 0 the
    single-GPU layer of the same seed; float32, or FP8 delayed scaling with reduce_amax
    (two steps: the second with the scales of the first's amaxes) -> {"tp"/"single":
    [y, {"x" and every parameter: gradient}]} (NumPy)."""
    import tecupy
    cupy = _xp(g)
    rng = np.random.default_rng(3)
    x, dy = (rng.standard_normal((c["s"], c["b"], c["hidden"])).astype(np.float32)
             for _ in range(2))
    tp = g.split(color=0 if g.rank < 2 else None)
    if tp is None:
        return None
    recipe = tecupy.recipe.DelayedScaling(amax_history_len=4, reduce_amax=True)

    def run(layer, xs, dys):
        xs, dys = cupy.asarray(xs), cupy.asarray(dys)
        params = layer.named_parameters()
        for _ in range(2 if fp8 else 1):
            ctx = tecupy.fp8_autocast(fp8_recipe=recipe) if fp8 else contextlib.nullcontext()
            with tecupy.Tape() as tape, ctx:
                y = layer(xs)
            grads = tape.gradient(y, [xs, *params.values()], output_grad=dys)
        return [_np(y), dict(zip(["x", *params], (_np(a) for a in grads)))]

    def make(group, sp):
        return tecupy.nn.TransformerLayer(c["hidden"], c["ffn"], c["heads"], hidden_dropout=0.0,
                                          attention_dropout=0.0, seed=4, tp_group=group,
                                          sequence_parallel=sp, params_dtype=np.float32,
                                          device="cpu" if cupy is np else "cuda")
    cut = (lambda a: _cut(a, tp.rank, 2, 0)) if sp else (lambda a: a)
    out = {"tp": run(make(tp, sp), cut(x), cut(dy))}
    if g.rank == 0:
        out["single"] = run(make(None, False), x, dy)
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp2_transformer_layer_equals_single_gpu(sp, fp8):
    """Every rank's output and gradients against their cuts of the single GPU's: relative
    error of each tensor (float32 GEMMs with K split over 2 ranks; FP8 with the same scales
    on both, reduce_amax, the fused single-GPU kernels against the composed TP ops)."""
    worst, count = check_tp_layer(dist.spawn(_tp_layer, N, sp, fp8, timeout=300), sp, fp8)
    row(f"TP=2 TransformerLayer{' +SP' if sp else ''} vs 1 GPU ({'fp8' if fp8 else 'fp32'})",
        2, "ok", f"worst relative error {worst:.2g} over y and {count} gradients")


def check_tp_layer(got, sp, fp8, c=TP_LAYER):
    """-> (the worst relative error, the number of gradients) of _tp_layer's ranks."""
    want_y, want = got[0]["single"]
    d = c["hidden"] // c["heads"]
    qkv = [c["heads"] * d] * 3
    worst = 0.0
    for r in range(2):
        y, grads = got[r]["tp"]
        pairs = {"y": (y, _cut(want_y, r, 2, 0) if sp else want_y)}
        for name, a in grads.items():
            full = want[name]
            if name == "x":
                full = _cut(full, r, 2, 0) if sp else full
            elif name.endswith(("qkv.weight", "qkv.bias")):
                full = _cut(full, r, 2, 0, qkv)
            elif name.endswith(("fc1_weight", "fc1_bias")):
                full = _cut(full, r, 2, 0)
            elif name.endswith(("proj.weight", "fc2_weight")):
                full = _cut(full, r, 2, 1)
            pairs[name] = (a, full)
        for name, (a, ref) in pairs.items():
            assert a.shape == ref.shape, (name, r)
            err = float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-30))
            assert err < (2.0 ** -4 if fp8 else 1e-4), (name, r, err)
            worst = max(worst, err)
    return worst, len(want)


def _rings(g):
    """NcclGroup.shift and overlap.py's rings (side stream, events) against the NCCL
    collectives, int64 (exact in any order of sums) and bf16, on every rank of g."""
    from tecupy.distributed import overlap
    cupy = _xp(g)
    out = {}
    for dt in (np.int64, bfloat16):
        x = cupy.asarray(_data(g.rank, dt, (8 * g.size, 40)))
        got = cupy.empty_like(x)
        g.shift(x, got)
        seen = []
        full = overlap.ring_gather(g, x[:8], lambda c, chunk: seen.append(c))
        rs = overlap.ring_reduce_scatter(g, lambda c: x[8 * c:8 * c + 8].copy())
        cupy.cuda.get_current_stream().synchronize()
        out[np.dtype(dt).name] = [_np(got), _np(full), seen, _np(rs),
                                  _np(g.all_gather(x[:8], 0)), _np(g.reduce_scatter(x, 0))]
    return out


def test_shift_and_rings_equal_the_collectives():
    """shift: every rank gets the previous rank's array; ring_gather: the all-gather, each
    chunk's GEMM called once, in ring order; ring_reduce_scatter: the reduce-scatter (int64
    exact; bf16 exact at 2 ranks, else within bf16 rounding: another order of sums)."""
    got = dist.spawn(_rings, N, timeout=120)
    for r in range(N):
        for name, (shifted, full, seen, rs, ag, want_rs) in got[r].items():
            dt = bfloat16 if name == "bfloat16" else np.int64
            np.testing.assert_array_equal(shifted, _data((r - 1) % N, dt, (8 * N, 40)))
            np.testing.assert_array_equal(full, ag)
            assert seen == [(r - j) % N for j in range(N)], seen
            if name == "int64" or N == 2:
                np.testing.assert_array_equal(rs, want_rs)
            else:
                np.testing.assert_allclose(rs.astype(np.float64), want_rs.astype(np.float64),
                                           rtol=2e-2, atol=0.2)
    row("shift, ring all-gather / reduce-scatter vs NCCL", N, "ok", "int64 and bf16")


OVERLAP_LAYER = dict(hidden=256, ffn=1024, heads=8, s=256, b=2)


def _overlap_layer(g, fp8, switch="OVERLAP", c=OVERLAP_LAYER):
    """The TP=2 + SP TransformerLayer (ranks 0 and 1; bf16, FP8 delayed scaling with
    reduce_amax: two steps) with overlap.<switch> (OVERLAP: the rings, against the composed
    plain path, fp8_blocks.FUSED off; BULK: the bulk overlap of the plain path; PEER:
    peer.PEER, the forward gathers as peer pushes read by the chunked GEMM) off, then on
    -> {False/True: [y, every gradient], "peer": PeerGathers made on the group} (NumPy
    float32)."""
    import tecupy
    from tecupy.distributed import fp8_blocks, overlap, peer
    cupy = _xp(g)
    tp = g.split(color=0 if g.rank < 2 else None)
    if tp is None:
        return None
    rng = np.random.default_rng(7)
    x, dy = (rng.standard_normal((c["s"], c["b"], c["hidden"])).astype(np.float32)
             for _ in range(2))
    x, dy = (cupy.asarray(_cut(a, tp.rank, 2, 0)).astype(bfloat16) for a in (x, dy * 0.1))
    recipe = tecupy.recipe.DelayedScaling(amax_history_len=4, reduce_amax=True)
    mod = peer if switch == "PEER" else overlap
    out, before, fused = {}, getattr(mod, switch), fp8_blocks.FUSED
    fp8_blocks.FUSED = switch != "OVERLAP"
    for ring in (False, True):
        setattr(mod, switch, ring)
        layer = tecupy.nn.TransformerLayer(c["hidden"], c["ffn"], c["heads"], hidden_dropout=0.0,
                                           attention_dropout=0.0, seed=4, tp_group=tp,
                                           sequence_parallel=True, params_dtype=bfloat16,
                                           device="cuda")
        params = layer.named_parameters()
        for _ in range(2 if fp8 else 1):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                y = layer(x)
            grads = tape.gradient(y, [x, *params.values()], output_grad=dy)
        out[ring] = [_np(a.astype(np.float32)) for a in [y, *grads]]
    setattr(mod, switch, before)
    fp8_blocks.FUSED = fused
    out["peer"] = sum(v is not None for v in getattr(tp, "_peer_gathers", {}).values())
    return out


def _on_vs_off(got):
    """Ranks 0 and 1's tensors with the overlap on (got[r][True]) against off: within 1e-3
    relative each; -> the table's note (how many bit for bit, the worst difference)."""
    exact = total = 0
    worst = 0.0
    for r in range(2):
        for k, (a, b) in enumerate(zip(got[r][True], got[r][False])):
            assert a.shape == b.shape, (r, k)
            err = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
            assert err < 1e-3, (r, k, err)
            worst, exact, total = max(worst, err), exact + np.array_equal(a, b), total + 1
    return f"bit-exact {exact}/{total} tensors; worst relative diff {worst:.2g}"


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_tp2_layer_overlap_equals_plain_collectives(fp8):
    """TP=2 + SP TransformerLayer with the comm-GEMM overlap (rings of send/recv on a side
    stream, chunk GEMMs) against the plain NCCL all-gather / reduce-scatter: within 1e-3
    (relative, per tensor); expected bit for bit (2 ranks: the ring's one sum commutes; the
    chunk GEMMs compute the same rows): the row says which tensors are."""
    got = dist.spawn(_overlap_layer, N, fp8, timeout=300)
    row(f"TP=2 +SP layer, overlap on vs off ({'fp8' if fp8 else 'bf16'})", 2, "ok",
        _on_vs_off(got))


def test_tp2_layer_bulk_overlap_is_bit_exact():
    """The bulk overlap (overlap.BULK: the FP8 column GEMMs' backward runs dgrad first, its
    reduce-scatter on a side stream beside wgrad, the GEMM leaving SMs free) against the
    plain order, FP8 (two steps): the same GEMMs and collectives, every tensor bit for
    bit."""
    got = dist.spawn(_overlap_layer, N, True, "BULK", timeout=300)
    note = _on_vs_off(got)
    total = 2 * len(got[0][True])
    assert note.startswith(f"bit-exact {total}/{total} "), note
    row("TP=2 +SP layer, bulk overlap on vs off (fp8)", 2, "ok", note)


def test_tp2_layer_peer_gather_is_bit_exact():
    """The FP8 sequence-parallel forward's all-gathers as copy-engine pushes into peer
    buffers, read by the chunked GEMM as they land (peer.PEER), against NCCL's all-gather
    then the GEMM (two steps): the same codes, GEMM tiles and wgrad transposes, every tensor
    bit for bit; and the peer path did run (a PeerGather on the group)."""
    got = dist.spawn(_overlap_layer, N, True, "PEER", timeout=300)
    assert all(got[r]["peer"] >= 1 for r in range(2)), [got[r]["peer"] for r in range(2)]
    note = _on_vs_off(got)
    total = 2 * len(got[0][True])
    assert note.startswith(f"bit-exact {total}/{total} "), note
    row("TP=2 +SP layer, FP8 gathers by peer pushes vs NCCL", 2, "ok", note)


def _act_row_gpu(g, fp8):
    """tensor_parallel.act_then_row_parallel (LayerNormMLP's gelu + fc2 + reduce-scatter,
    its ring form for nn/layers.py to call) on ranks 0 and 1, bf16 (FP8: two steps),
    overlap off then on -> {False/True: [y, dh, dfc1_bias, dfc2_weight, dfc2_bias]}."""
    import tecupy
    from tecupy.distributed import overlap
    from tecupy.distributed.tensor_parallel import act_then_row_parallel
    cupy = _xp(g)
    tp = g.split(color=0 if g.rank < 2 else None)
    if tp is None:
        return None
    rng = np.random.default_rng(tp.rank + 30)
    h, b1, w2, b2, dy = (cupy.asarray(a.astype(np.float32)).astype(bfloat16) for a in (
        rng.standard_normal((256, 2, 512)), rng.standard_normal(512) * 0.1,
        rng.standard_normal((256, 512)) * 0.05, rng.standard_normal(256) * 0.1,
        rng.standard_normal((128, 2, 256))))
    recipe = tecupy.recipe.DelayedScaling(amax_history_len=4, reduce_amax=True)
    out = {}
    for ring in (False, True):
        overlap.OVERLAP = ring
        state = tecupy.FP8State(num_gemms=2)
        state.amax_group = tp
        for _ in range(2 if fp8 else 1):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
                y = act_then_row_parallel(cupy, h, b1, "gelu", w2, b2, tp, state, True)
            grads = tape.gradient(y, [h, b1, w2, b2], output_grad=dy)
        out[ring] = [_np(a.astype(np.float32)) for a in [y, *grads]]
    overlap.OVERLAP = True
    return out


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_tp2_act_then_row_parallel_ring_equals_the_collective(fp8):
    """The ring form of LayerNormMLP's fc2 (LayerNormMLP's under TECUPY_TP_OVERLAP) against
    ops.blocks._act_then_linear + the NCCL reduce-scatter: within 1e-3 per tensor; the row
    says how many are bit for bit."""
    got = dist.spawn(_act_row_gpu, N, fp8, timeout=300)
    row(f"TP=2 act + fc2 ring vs reduce-scatter ({'fp8' if fp8 else 'bf16'})", 2, "ok",
        _on_vs_off(got))


def _raise_on_1(g):
    import cupy
    x = cupy.ones(1 << 20, cupy.float32)
    g.all_reduce(x)
    cupy.cuda.get_current_stream().synchronize()
    if g.rank == 1:
        raise ValueError(f"boom on rank 1 at {time.time()!r}")
    g.all_reduce(x)  # rank 1 never joins: the host waits below for ever, unaided
    cupy.cuda.get_current_stream().synchronize()
    g.barrier()


def test_raising_rank_ends_every_rank_within_10_s():
    with pytest.raises(ValueError, match="boom on rank 1 at") as e:
        dist.spawn(_raise_on_1, N, timeout=120, grace=30)
    dt = time.time() - float(str(e.value).rsplit(" ", 1)[1])
    assert dt < 10  # every rank ended (spawn waited for them) within 10 s of the raise
    notes = "\n".join(e.value.__notes__)
    for r in range(N):
        if r != 1:
            assert f"rank {r}: " in notes
    row("fault: rank 1 raises, others in NCCL", N, "ok", f"all ranks ended {dt:.1f} s after")


def _raise_on_1_in_peer_gather(g):
    """Rank 1 raises instead of its part of a sequence-parallel FP8 gather (peer.PeerGather):
    the others' chunked GEMMs wait on the GPU for its chunk, their hosts in the sync."""
    import cupy
    import tecupy
    from tecupy.distributed.peer import peer_gather
    from tecupy.fp8 import E4M3, FP8Tensor
    s = cupy.ones(1, np.float32)
    qx = FP8Tensor.made(cupy.zeros((128, 256), np.uint8), E4M3, s)
    qw = FP8Tensor.made(cupy.zeros((256, 256), np.uint8), E4M3, s)
    pg = peer_gather(g, qx.data)
    assert pg is not None, "the peer gather applies on one host"
    cupy.cuda.get_current_stream().synchronize()
    g.barrier()
    if g.rank == 1:
        raise ValueError(f"boom on rank 1 at {time.time()!r}")
    pg.gemm(qx, lambda: qw, tecupy.bfloat16, None)  # rank 1's chunk never comes
    cupy.cuda.get_current_stream().synchronize()
    g.barrier()


def test_raising_rank_ends_every_rank_waiting_in_a_peer_gather_within_10_s():
    """A dead rank's chunk never lands: the ranks whose GEMMs wait for it on the GPU still
    end within 10 s of the raise (the group's abort ends the processes; the kernel's own
    limit, gemm_chunked's limit_s, is the last resort)."""
    with pytest.raises(ValueError, match="boom on rank 1 at") as e:
        dist.spawn(_raise_on_1_in_peer_gather, N, timeout=120, grace=30)
    dt = time.time() - float(str(e.value).rsplit(" ", 1)[1])
    assert dt < 10
    notes = "\n".join(e.value.__notes__)
    for r in range(N):
        if r != 1:
            assert f"rank {r}: " in notes
    row("fault: rank 1 raises, others' GEMMs wait for its chunk", N, "ok",
        f"all ranks ended {dt:.1f} s after")


def test_init_timeout_names_the_absent_rank(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(f"""\
        import os, sys
        sys.path.insert(0, {ROOT!r})
        from tecupy import distributed as dist
        if os.environ["RANK"] == "1":
            sys.exit(0)  # never arrives
        try:
            dist.init_process_group(timeout=3)
        except dist.InitTimeout as e:
            print(e)
            sys.exit(3)
        """))
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "tecupy.distributed.launch", "--nproc", "2",
                        str(script)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    dt = time.perf_counter() - t0
    assert p.returncode == 3, p.stderr
    assert "rank(s) [1] of 2 did not arrive at the store" in p.stdout
    assert dt < 30
    row("init timeout names rank 1", 2, "ok", f"{dt:.1f} s (timeout 3 s)")

"""ZeroOptimizer (ZeRO-1) on the ThreadGroup reference, 2 and 3 ranks (sizes that do not
split evenly: padded): the parameters after each step bit-identical to plain data parallel
(the mean gradients, then the same optimizer over every parameter), after the backward and
overlapped with it (Tape.gradient's on_grad), AdamW and SGD, float32 and bf16 (master
weights); the optimizer state per rank 1/N; no copy for large parameters; state_dict per
rank; the errors. The GPU test's body (tests/test_distributed_nccl.py) also runs here in 2
processes over the fake NCCL (NcclGroup's reduce_scatter, all_reduce_into and in-place
all_gather_into)."""
import numpy as np
import pytest
from test_distributed import Spy

import tecupy
from tecupy import distributed as dist
from tecupy._array import bfloat16
from tecupy.optim import SGD, AdamW, WarmupCosine

SHAPES = [((7,), np.float32), ((5, 3), np.float32), ((33, 17), bfloat16),
          ((1001,), np.float32), ((64, 48), np.float32), ((3,), bfloat16)]
MB = 600 / 2**20  # buckets of 600 bytes: four parameters alone, two small ones together
OPTIMIZERS = {
    "adamw": (AdamW, dict(lr=1e-2, weight_decay=0.1, schedule=WarmupCosine(1e-2, 1, 10))),
    "adamw-bf16-moments": (AdamW, dict(lr=1e-2, moments_dtype=bfloat16)),
    "sgd-nesterov": (SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd": (SGD, dict(lr=0.1))}


def _params():
    rng = np.random.default_rng(0)
    return {f"p{i}": rng.standard_normal(s).astype(d) for i, (s, d) in enumerate(SHAPES)}


def _grads(rank, step):
    rng = np.random.default_rng(100 * step + rank + 1)
    return [rng.standard_normal(s).astype(d) for s, d in SHAPES]


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_zero_equals_plain_data_parallel_bit_for_bit(n, opt):
    """3 steps: all_reduce_gradients then the optimizer over every parameter vs
    ZeroOptimizer.step of the rank's own gradients (a list, and a dict by name)."""
    cls, kw = OPTIMIZERS[opt]

    def body(g):
        plain_p, zero_p, named_p = _params(), _params(), _params()
        plain = cls(plain_p, **kw)
        zero = dist.ZeroOptimizer(cls, zero_p, g, bucket_mb=MB, **kw)
        named = dist.ZeroOptimizer(cls, named_p, g, bucket_mb=MB, **kw)
        for step in range(3):
            grads = _grads(g.rank, step)
            plain.step(dist.all_reduce_gradients([a.copy() for a in grads], g, MB))
            zero.step(grads)
            named.step(dict(zip(list(named_p)[::-1], grads[::-1])))  # (any key order)
        assert zero.step_count == plain.step_count == 3
        assert zero.get_lr() == plain.get_lr()
        return plain_p, zero_p, named_p
    got = dist.run_threads(n, body)
    for r in range(n):
        for k, want in got[0][0].items():
            for run in got[r]:
                np.testing.assert_array_equal(run[k], want, err_msg=f"{k} rank {r}")
    assert not np.array_equal(got[0][0]["p4"], _params()["p4"])  # (the steps did step)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("opt", ["adamw", "sgd-nesterov"])
def test_zero_clips_by_the_whole_gradients_norm(n, opt):
    """max_grad_norm under ZeRO: each rank's shard's sum of squares, all-reduced, gives the
    norm of the whole averaged gradient: last_grad_norm on every rank equals the plain
    optimizer's (to float32 rounding: the sums run over shards, then ranks), the clipping
    is active (the norm is far above 0.5), and 3 steps give the plain step's parameters to
    float rounding (bf16 parameters: within one bf16 rounding)."""
    got = dist.run_threads(n, lambda g: _clipped_steps(g, opt, 3))
    _check_clipped(got)
    assert not np.allclose(got[0][0]["p4"], _params()["p4"])  # (the steps did step)


def _clipped_steps(g, opt="adamw", steps=2):
    """The plain optimizer (max_grad_norm 0.5) on the averaged gradients vs ZeroOptimizer,
    `steps` steps of this rank's gradients -> (plain params, zero params, [(plain norm,
    zero norm)])."""
    cls, kw = OPTIMIZERS[opt]
    plain_p, zero_p = _params(), _params()
    plain = cls(plain_p, max_grad_norm=0.5, **kw)
    zero = dist.ZeroOptimizer(cls, zero_p, g, bucket_mb=MB, max_grad_norm=0.5, **kw)
    assert np.isnan(zero.last_grad_norm[0])
    norms = []
    for step in range(steps):
        grads = _grads(g.rank, step)
        plain.step(dist.all_reduce_gradients([a.copy() for a in grads], g, MB))
        zero.step(grads)
        norms.append((float(plain.last_grad_norm[0]), float(zero.last_grad_norm[0])))
    return plain_p, zero_p, norms


def _check_clipped(got):
    for plain_p, zero_p, norms in got:
        assert norms == got[0][2]  # (the same norm on every rank)
        for want, have in norms:
            assert want > 10 and abs(have - want) <= 2e-7 * want, (want, have)
        for k, want in plain_p.items():
            rtol = 2.0 ** -7 if want.dtype == bfloat16 else 1e-5
            np.testing.assert_allclose(zero_p[k].astype(np.float32),
                                       want.astype(np.float32), rtol=rtol, atol=1e-6,
                                       err_msg=k)


def test_zero_clipping_over_fake_nccl():
    """The clipped ZeRO step in 2 processes through NcclGroup over the fake NCCL (its
    all_reduce takes the shards' sums of squares)."""
    from test_distributed_launch import FAKE
    _check_clipped(dist.spawn(_clipped_steps, 2, backend=FAKE, timeout=60))


def _layer_step(layer, rank, step, fp8):
    rng = np.random.default_rng(100 * step + rank)
    x, dy = (rng.standard_normal((8, 2, 32)).astype(np.float32) for _ in "ab")
    recipe = tecupy.recipe.DelayedScaling(amax_history_len=4) if fp8 else None
    with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
        y = layer(x)
    return tape, y, dy


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
def test_zero_overlapped_on_a_layer_equals_plain(n, fp8):
    """A TransformerLayer, 2 steps: GradientReducer.gradient + AdamW vs
    ZeroOptimizer.gradient (reduce-scatter driven by on_grad) + step vs tape.gradient +
    ZeroOptimizer.step: the same parameters on every rank."""
    kb = 4096 / 2**20

    def body(g):
        layers = [tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=3) for _ in "abc"]
        reducer = dist.GradientReducer(g, layers[0], bucket_mb=kb)
        plain = AdamW(layers[0].named_parameters(), lr=1e-2)
        zeros = [dist.ZeroOptimizer(AdamW, layer, g, bucket_mb=kb, lr=1e-2)
                 for layer in layers[1:]]
        for step in range(2):
            tape, y, dy = _layer_step(layers[0], g.rank, step, fp8)
            plain.step(reducer.gradient(tape, y, output_grad=dy))
            tape, y, dy = _layer_step(layers[1], g.rank, step, fp8)
            shards = zeros[0].gradient(tape, y, output_grad=dy)
            assert isinstance(shards, dist.ShardedGradients)
            zeros[0].step(shards)
            tape, y, dy = _layer_step(layers[2], g.rank, step, fp8)
            zeros[1].step(tape.gradient(y, layers[2], output_grad=dy))
        return [layer.named_parameters() for layer in layers]
    got = dist.run_threads(n, body)
    for r in range(n):
        for run in got[r]:
            for k, want in got[0][0].items():
                np.testing.assert_array_equal(run[k], want, err_msg=f"{k} rank {r}")


@pytest.mark.parametrize("n", [2, 3])
def test_zero_state_is_one_nth_and_large_parameters_are_not_copied(n):
    """The optimizer's arrays per rank: 1/N of the plain optimizer's (plus < n elements of
    padding a bucket); a bucket of one parameter that splits evenly is a view of it: the
    gradient itself reduce-scattered, this rank's chunk of the parameter gathered into it
    in place (all_gather_into)."""
    def body(g):
        spy = Spy(g)
        params = _params()
        zero = dist.ZeroOptimizer(AdamW, params, spy, bucket_mb=MB, lr=1e-2)
        plain = AdamW(_params(), lr=1e-2)
        size = lambda sd: sum(v.size for v in sd.values() if isinstance(v, np.ndarray))  # noqa
        share = size(zero.state_dict()) / size(plain.state_dict())
        views = [(s.view, np.shares_memory(s.full, params[zero.names[b[0]]]))
                 for s, b in zip(zero.segments, zero.reducer.buckets)]
        grads = _grads(g.rank, 0)
        zero.step(grads)
        given = {op: [x for o, x in spy.calls if o == op] for op in
                 ("reduce_scatter", "all_gather_into")}
        for b, (sent, gathered) in enumerate(zip(given["reduce_scatter"],
                                                 given["all_gather_into"])):
            i = zero.reducer.buckets[b][0]
            assert np.shares_memory(gathered, params[zero.names[i]]) == zero.segments[b].view
            assert np.shares_memory(sent, grads[i]) == zero.reducer.direct[b]
        return share, views, zero.reducer.buckets
    for share, views, buckets in dist.run_threads(n, body):
        assert 1 / n <= share < 1 / n + 0.01, share  # (padding: < n elements per bucket)
        # (64, 48) splits over 2 and 3; (33, 17) = 561 over 3; (3,) alone over 3
        want = {2: [False, True, False, False, False], 3: [True, True, False, True, False]}[n]
        assert buckets == [[5], [4], [3], [2], [1, 0]]
        assert [v for v, _ in views] == want and all(v == s for v, s in views)


def test_zero_state_dict_round_trip_per_rank():
    """Two steps, state_dict per rank after the first; a fresh ZeroOptimizer over the first
    step's parameters loads it and takes the second: the same parameters as the
    uninterrupted run. Another rank's (or group size's) state_dict is refused."""
    cls, kw = OPTIMIZERS["adamw"]

    def body(g):
        params = _params()
        zero = dist.ZeroOptimizer(cls, params, g, bucket_mb=MB, **kw)
        zero.step(_grads(g.rank, 0))
        sd = zero.state_dict()
        saved = {k: v.copy() for k, v in params.items()}
        assert sd["zero.rank"] == g.rank and sd["zero.size"] == 3
        assert sd["zero.layout"] == "p5|p4|p3|p2|p1,p0" and sd["optimizer"] == "AdamW"
        assert "exp_avg.bucket0" in sd and "master.bucket3" in sd  # (p2: bf16, a master)
        zero.step(_grads(g.rank, 1))
        again = dist.ZeroOptimizer(cls, saved, g, bucket_mb=MB, **kw).load_state_dict(sd)
        again.step(_grads(g.rank, 1))
        other = dict(sd, **{"zero.rank": (g.rank + 1) % 3})
        with pytest.raises(ValueError, match=r"nothing was loaded; each rank loads the "
                                             r"state_dict its own rank saved.*\n  zero.rank"):
            again.load_state_dict(other)
        return params, saved
    for params, saved in dist.run_threads(3, body):
        for k in params:
            np.testing.assert_array_equal(saved[k], params[k], err_msg=k)


def test_zero_errors_name_the_argument():
    def body(g):
        p = _params()
        with pytest.raises(TypeError, match="optimizer_cls must be a tecupy.optim optimizer "
                                            "class"):
            dist.ZeroOptimizer(AdamW(p), p, g)
        with pytest.raises(ValueError, match="params is empty"):
            dist.ZeroOptimizer(AdamW, [], g)
        with pytest.raises(TypeError, match=r"params\['w'\] must be a numpy or cupy array"):
            dist.ZeroOptimizer(AdamW, {"w": [1.0, 2.0]}, g)
        with pytest.raises(TypeError, match="params must be a list or dict"):
            dist.ZeroOptimizer(AdamW, np.zeros(3), g)
        zero = dist.ZeroOptimizer(AdamW, p, g, bucket_mb=MB)
        with pytest.raises(ValueError, match=r"missing \['p0'\], unexpected \['q'\]"):
            zero.step({**{k: v for k, v in p.items() if k != "p0"}, "q": p["p0"]})
        with pytest.raises(ValueError, match="one array per parameter"):
            zero.step(list(p.values())[:2])
        with pytest.raises(TypeError, match="grads must be ShardedGradients"):
            zero.step(np.zeros(3))
        with pytest.raises(ValueError, match="ShardedGradients of 1 buckets; this optimizer "
                                             "has 5"):
            zero.step(dist.ShardedGradients([np.zeros(3)]))
        with pytest.raises(ValueError, match=r"gradient 4 is \(3,\) float32; the buckets"):
            zero.step([*list(p.values())[:4], np.zeros(3, np.float32), p["p5"]])
        zero.step([np.zeros_like(a) for a in p.values()])  # (the reducer was reset)
    dist.run_threads(2, body)


def test_no_copy_body_over_fake_nccl():
    """tests/test_distributed_nccl.py's no-copy body in 2 processes through NcclGroup over
    the fake NCCL: all_reduce_gradients in place, the reducer out of place, all_reduce_into
    and the in-place all_gather_into on the process group's own path; bit for bit."""
    from test_distributed_launch import FAKE
    from test_distributed_nccl import _no_copy, check_no_copy
    check_no_copy(dist.spawn(_no_copy, 2, backend=FAKE, timeout=60), exact=True)


def test_zero_body_over_fake_nccl():
    """The GPU test's ZeRO body (hidden 64, FP8, 32 KiB buckets) in 2 processes through
    NcclGroup over the fake NCCL (reduce_scatter, the in-place all_gather_into): ZeRO
    overlapped and after equal plain data parallel bit for bit."""
    from test_distributed_launch import FAKE
    from test_distributed_nccl import _zero_vs_dp, check_zero
    got = dist.spawn(_zero_vs_dp, 2, True, 64, 32 / 1024, backend=FAKE, timeout=120)
    assert check_zero(got, exact=True) == 0.0


def test_zero_clipped_body_over_fake_nccl():
    """The GPU test's clipped ZeRO body (hidden 64, float32, 32 KiB buckets, max_grad_norm
    0.5) in 2 processes over the fake NCCL: the same norm on every rank, equal to plain data
    parallel's, and its parameters to float rounding (here bit for bit: the reference
    path sums the squares in float64)."""
    from test_distributed_launch import FAKE
    from test_distributed_nccl import _zero_vs_dp, check_zero_clipped
    got = dist.spawn(_zero_vs_dp, 2, False, 64, 32 / 1024, 0.5, backend=FAKE, timeout=120)
    check_zero_clipped(got)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("recipe", ["delayed", "current", "block"])
@pytest.mark.parametrize("kib", [16, 1024], ids=["alone", "together"])
def test_zero_fp8_weights_equal_the_plain_optimizer(n, recipe, kib):
    """FP8 weights (quantized_model_init) under ZeRO on the ThreadGroup: the GPU test's body
    (a TransformerLayer, 3 steps): codes, scale_inv and the masters' shards bit for bit the
    plain optimizer's; each FP8 weight in a bucket of its own (its codes gathered in place,
    where it splits evenly) or all of them in one. Block scaling: hidden 64, so qkv's
    [192, 64] weight has 2 blocks of rows, the first split between ranks (2 ranks: rows 0-95
    and 96-191; 3: 0-63, 64-127 and 128-191), and in one bucket the parts start and end
    within rows."""
    from test_distributed_nccl import _zero_fp8_weights, check_zero_fp8_weights
    check_zero_fp8_weights(dist.run_threads(n, _zero_fp8_weights, recipe, 64, kib / 1024))


def test_zero_fp8_weights_over_fake_nccl():
    """The same body in 2 processes through NcclGroup over the fake NCCL."""
    from test_distributed_launch import FAKE
    from test_distributed_nccl import _zero_fp8_weights, check_zero_fp8_weights
    for recipe in ("delayed", "block"):
        check_zero_fp8_weights(dist.spawn(_zero_fp8_weights, 2, recipe, 64, 16 / 1024,
                                          backend=FAKE, timeout=120))


def test_zero_fp8_weights_state_dict_round_trip():
    """FP8 weights: state_dict after the first of two steps holds this rank's shard of the
    masters (zero.fp8.bucket<b>); a fresh ZeroOptimizer over the same layer (whose masters
    start from the codes) loads it and takes the second step: the uninterrupted run's codes.
    A state_dict whose shard has another shape is refused, naming the key."""
    recipe = tecupy.recipe.Float8CurrentScaling()

    def body(g):
        with tecupy.quantized_model_init(recipe=recipe):
            layers = [tecupy.nn.Linear(48, 32, device="cpu", seed=5) for _ in "ab"]
        zeros = [dist.ZeroOptimizer(AdamW, lin, g, bucket_mb=1, lr=1e-2) for lin in layers]
        for step in range(2):
            x = np.random.default_rng(10 * step + g.rank).standard_normal((16, 48))
            for k, lin in enumerate(layers):
                with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
                    y = lin(x.astype(np.float32))
                zeros[k].step(tape.gradient(y, lin, output_grad=np.ones_like(y)))
                if step == 0 and k == 1:
                    sd = zeros[1].state_dict()
                    assert sd["zero.fp8.bucket1"].dtype == np.float32
                    zeros[1] = dist.ZeroOptimizer(AdamW, lin, g, bucket_mb=1, lr=1e-2)
                    bad = dict(sd, **{"zero.fp8.bucket1": sd["zero.fp8.bucket1"][:-1]})
                    with pytest.raises(ValueError, match=r"nothing was loaded.*\n  "
                                                         r"zero.fp8.bucket1: \(\("):
                        zeros[1].load_state_dict(bad)
                    zeros[1].load_state_dict(sd)
        return [(lin.weight.data.copy(), lin.weight.scale_inv.copy()) for lin in layers]
    for (a, sa), (b, sb) in dist.run_threads(2, body):
        np.testing.assert_array_equal(b, a)
        np.testing.assert_array_equal(sb, sa)

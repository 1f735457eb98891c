"""tecupy.optim: AdamW and SGD against plain NumPy versions in float64, clipping, the
schedule, state_dict round trips and errors on the CPU; on the GPU the fused kernels against
the reference at odd sizes and a CUDA-graph captured step against eager steps."""
import math

import numpy as np
import pytest

import tecupy
from tecupy import loader
from tecupy.optim import SGD, AdamW, WarmupCosine, kernels, warmup_cosine

from conftest import assert_within_2x_reference

gpu = pytest.mark.gpu
BF16 = tecupy.bfloat16


# ---- plain NumPy optimizers (float64), written from torch.optim's docs --------------------
def clip_grads(grads, max_norm):
    norm = math.sqrt(sum(float((g * g).sum()) for g in grads))
    c = min(1.0, max_norm / (norm + 1e-6))
    return [g * c for g in grads], norm


def numpy_adamw(params, steps, lrs, b1=0.9, b2=0.999, eps=1e-8, wd=0.01, clip=None):
    p = [a.astype(np.float64) for a in params]
    m, v = [np.zeros_like(a) for a in p], [np.zeros_like(a) for a in p]
    for t, grads in enumerate(steps, 1):
        grads = [g.astype(np.float64) for g in grads]
        if clip is not None:
            grads, _ = clip_grads(grads, clip)
        lr = lrs[t - 1]
        for i, g in enumerate(grads):
            p[i] *= 1 - lr * wd
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            denom = np.sqrt(v[i]) / math.sqrt(1 - b2 ** t) + eps
            p[i] -= lr / (1 - b1 ** t) * m[i] / denom
    return p


def numpy_sgd(params, steps, lr, momentum, wd, nesterov):
    p, buf = [a.astype(np.float64) for a in params], [None] * len(params)
    for grads in steps:
        for i, g in enumerate(grads):
            d = g + wd * p[i]
            if momentum:
                buf[i] = d.copy() if buf[i] is None else momentum * buf[i] + d
                d = d + momentum * buf[i] if nesterov else buf[i]
            p[i] -= lr * d
    return p


def make(rng, shapes=((3, 5), (7,), (1,)), dtype=np.float64, steps=10, scale=1.0):
    params = [rng.standard_normal(s).astype(dtype) for s in shapes]
    grads = [[(rng.standard_normal(s) * scale).astype(dtype) for s in shapes]
             for _ in range(steps)]
    return params, grads


# ---- CPU: the maths ---------------------------------------------------------------------
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_numpy(rng, wd):
    params, steps = make(rng)
    want = numpy_adamw(params, steps, [1e-2] * 10, wd=wd)
    opt = AdamW(params, lr=1e-2, weight_decay=wd)
    for g in steps:
        opt.step(g)
    for got, w in zip(params, want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    assert opt.step_count == 10 and opt.last_grad_norm is None


@pytest.mark.parametrize("momentum, nesterov", [(0.0, False), (0.9, False), (0.9, True)])
def test_sgd_matches_numpy(rng, momentum, nesterov):
    params, steps = make(rng)
    want = numpy_sgd(params, steps, 0.05, momentum, 0.01, nesterov)
    names = {f"w{i}": p for i, p in enumerate(params)}
    opt = SGD(names, lr=0.05, momentum=momentum, weight_decay=0.01, nesterov=nesterov)
    for g in steps:
        opt.step({f"w{i}": a for i, a in enumerate(g)})
    for got, w in zip(params, want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 1e6, math.inf])
def test_clipping(rng, max_norm):
    params, steps = make(rng, scale=3.0)
    want = numpy_adamw(params, steps, [1e-2] * 10, clip=max_norm)
    opt = AdamW(params, lr=1e-2, max_grad_norm=max_norm)
    for g in steps:
        opt.step(g)
    np.testing.assert_allclose(opt.last_grad_norm[0], clip_grads(steps[-1], 1.0)[1],
                               rtol=1e-12)
    for got, w in zip(params, want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_norm_is_no_error(rng, bad):
    """torch's clip_grad_norm_ default: no error; the coefficient is nan (inf norm: 0, and
    inf * 0 = nan), so the parameters go nan where the gradient is not finite (all of them
    for a nan norm)."""
    params, steps = make(rng, steps=1)
    steps[0][0][0, 0] = bad
    opt = AdamW(params, lr=1e-2, max_grad_norm=1.0)
    opt.step(steps[0])
    assert np.isnan(params[0][0, 0]) and not np.isfinite(opt.last_grad_norm[0])
    assert np.isnan(params[1]).all() == (bad != np.inf)


def test_schedule_values():
    s = WarmupCosine(1.0, warmup_steps=4, total_steps=14, min_lr=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0 and s(14) == s(100) == 0.1
    assert s(9) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert warmup_cosine(0, 2.0, 0, 10) == 2.0 and warmup_cosine(10, 2.0, 0, 10) == 0.0
    lrs = [warmup_cosine(i, 3e-3, 3, 20, 3e-4) for i in range(20)]
    assert max(lrs) == 3e-3 and all(a >= b for a, b in zip(lrs[3:], lrs[4:]))


def test_schedule_drives_the_optimizer(rng):
    params, steps = make(rng)
    s = WarmupCosine(1e-2, 3, 8, 1e-3)
    want = numpy_adamw(params, steps, [s(i) for i in range(10)])
    opt = AdamW(params, lr=123.0, schedule=s)
    seen = []
    for g in steps:
        opt.step(g)
        seen.append(opt.get_lr())
    assert seen == [s(i) for i in range(10)]
    for got, w in zip(params, want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)
    with pytest.raises(RuntimeError, match="follows its schedule"):
        opt.set_lr(1e-3)


def test_set_lr(rng):
    params, steps = make(rng, steps=4)
    opt = AdamW(params, lr=1e-2)
    lrs = [1e-2, 1e-2, 5e-3, 5e-3]
    want = numpy_adamw(params, steps, lrs)
    for i, g in enumerate(steps):
        if i == 2:
            opt.set_lr(5e-3)
        opt.step(g)
    for got, w in zip(params, want):
        np.testing.assert_allclose(got, w, rtol=0, atol=1e-6)


def test_master_weights_and_bf16_moments(rng):
    """bf16 parameters: a float32 master copy is updated and rounded into the parameter;
    float32 gradients are accepted; master_weights=False keeps none."""
    params, steps = make(rng, dtype=BF16, steps=3)
    opt = AdamW(params, lr=1e-2, moments_dtype=BF16)
    for g in steps:
        opt.step([a.astype(np.float32) for a in g])
    for p, m in zip(params, opt.masters):
        assert m.dtype == np.float32 and np.array_equal(p, m.astype(BF16))
    assert {a.dtype for a in opt.exp_avg + opt.exp_avg_sq} == {BF16}
    plain = AdamW(make(rng, dtype=BF16)[0], master_weights=False)
    assert plain.masters == [None] * 3 and not any(k.startswith("master.")
                                                   for k in plain.state_dict())


def _run(opt_fn, params, steps):
    opt = opt_fn(params)
    for g in steps:
        opt.step(g)
    return opt


@pytest.mark.parametrize("which", ["adamw_bf16", "sgd"])
def test_state_dict_resumes_bit_identically(rng, which):
    """10 steps == 5 steps, state_dict, a fresh optimizer on copies, load, 5 steps."""
    if which == "sgd":
        params, steps = make(rng, dtype=np.float32)

        def fn(p):
            return SGD(p, lr=0.1, momentum=0.9, nesterov=True, max_grad_norm=1.0)
    else:
        params, steps = make(rng, dtype=BF16)

        def fn(p):
            return AdamW(p, lr=1e-2, moments_dtype=BF16, max_grad_norm=1.0,
                         schedule=WarmupCosine(1e-2, 2, 8))
    whole = [p.copy() for p in params]
    _run(fn, whole, steps)
    first = _run(fn, params, steps[:5])
    sd = first.state_dict()
    for k, v in sd.items():
        assert isinstance(k, str) and (isinstance(v, np.ndarray) or v is None
                                       or type(v) in (int, float, str)), k
    resumed = fn([p.copy() for p in params])
    resumed.load_state_dict(sd)
    for g in steps[5:]:
        resumed.step(g)
    for a, b in zip(whole, resumed.params):
        assert a.tobytes() == b.tobytes()
    assert resumed.step_count == 10


def test_load_state_dict_lists_mismatches_and_loads_nothing(rng):
    params, steps = make(rng, steps=2)
    opt = _run(lambda p: AdamW(p, lr=1e-2), params, steps)
    sd = opt.state_dict()
    before = opt.state_dict()
    bad = dict(sd, **{"exp_avg.0": np.zeros((2, 2)), "exp_avg_sq.1": sd["exp_avg_sq.1"]
                      .astype(np.float32), "beta2": 1.0, "step": -1, "optimizer": "SGD",
                      "extra": 3})
    del bad["lr"]
    with pytest.raises(ValueError, match="nothing was loaded; 7 mismatch") as err:
        opt.load_state_dict(bad)
    for key in ("exp_avg.0", "exp_avg_sq.1", "beta2", "step", "optimizer", "extra", "lr"):
        assert repr(key) in str(err.value)
    after = opt.state_dict()
    assert all(np.array_equal(before[k], after[k]) for k in before)
    with pytest.raises(ValueError, match="schedule"):
        AdamW(params, schedule=WarmupCosine(1.0, 1, 2)).load_state_dict(sd)
    clipped = AdamW(params, max_grad_norm=1.0).load_state_dict(sd)  # takes the saved None
    assert clipped.max_grad_norm is None
    opt.load_state_dict(dict(sd, max_grad_norm=2.0)).step(steps[0])  # now clips
    assert opt.last_grad_norm[0] == pytest.approx(clip_grads(steps[0], 1.0)[1])


# ---- CPU: errors --------------------------------------------------------------------------
P = [np.zeros((2, 3), np.float32)]


@pytest.mark.parametrize("kwargs, err, match", [
    ({"lr": -1.0}, ValueError, "lr must be a finite number >= 0, got -1.0"),
    ({"betas": (0.9, 1.0)}, ValueError, r"betas\[1\] must be a finite number in \[0, 1\)"),
    ({"betas": 0.9}, TypeError, "betas must be a pair"),
    ({"eps": -1e-8}, ValueError, "eps must be"),
    ({"weight_decay": float("nan")}, ValueError, "weight_decay must be a finite number"),
    ({"moments_dtype": np.float16}, TypeError, "moments_dtype must be None, float32 or"),
    ({"max_grad_norm": 0.0}, ValueError, "max_grad_norm must be a finite number > 0"),
    ({"master_weights": "yes"}, TypeError, "master_weights must be None or a bool"),
    ({"schedule": lambda s: 1.0}, TypeError, "schedule must be None or a tecupy.optim"),
    ({"params": []}, ValueError, "params is empty"),
    ({"params": P[0]}, TypeError, "params must be a list of arrays"),
    ({"params": [P[0], P[0]]}, ValueError, "the same array twice"),
    ({"params": [np.zeros(3, np.int32)]}, TypeError, r"params\[0\] must be a numpy or cupy"),
    ({"params": {1: P[0]}}, TypeError, "a dict with str keys"),
])
def test_constructor_errors(kwargs, err, match):
    kwargs = {"params": P, **kwargs}
    with pytest.raises(err, match=match):
        AdamW(kwargs.pop("params"), **kwargs)


def test_sgd_and_schedule_errors():
    with pytest.raises(ValueError, match="nesterov=True needs a momentum > 0"):
        SGD(P, lr=0.1, nesterov=True)
    with pytest.raises(TypeError, match="nesterov must be True or False"):
        SGD(P, lr=0.1, momentum=0.9, nesterov="yes")
    with pytest.raises(ValueError, match="total_steps must be > warmup_steps"):
        WarmupCosine(1.0, 10, 10)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        warmup_cosine(-1, 1.0, 1, 10)


@pytest.mark.parametrize("grads, err, match", [
    ([], ValueError, r"one array per parameter \(2\), got 0"),
    ("g", TypeError, "grads must be a list of arrays"),
    ({"a": np.zeros((2, 3), np.float32)}, ValueError, r"one array per parameter \(2\)"),
    ([np.zeros((2, 3), np.float32), np.zeros(4, np.float32)], ValueError,
     r"grads\[1\] must be an array of shape \(5,\) and dtype float32"),
    ([np.zeros((2, 3), np.float16), np.zeros(5, np.float32)], ValueError,
     r"grads\[0\] must be an array of shape \(2, 3\) and dtype float32 or float32"),
    ([np.zeros((2, 3), np.float32), None], TypeError, r"grads\[1\] must be a numpy array"),
])
def test_step_errors(grads, err, match):
    opt = AdamW([np.zeros((2, 3), np.float32), np.zeros(5, np.float32)])
    with pytest.raises(err, match=match):
        opt.step(grads)
    named = AdamW({"a": np.zeros(3, np.float32)})
    with pytest.raises(ValueError, match=r"missing \['a'\], unexpected \['b'\]"):
        named.step({"b": np.zeros(3, np.float32)})


# ---- the kernels: NVRTC and the host side (no GPU needed) ----------------------------------
def test_kernels_compile_with_nvrtc():
    names = loader.declared("sm_90a")["optim.cu"]
    _, lowered = loader.compile_together("optim.cu", names, "sm_90a")
    assert len(lowered) == len(names) == 1 + 3 + 7 + 14  # (the float32 FP8 masters: +2, +4)


class _Fake:
    def __init__(self, dtype, ptr=0):
        self.dtype = np.dtype(dtype)

        class data:  # noqa: N801
            pass
        self.data = data
        data.ptr = ptr


def test_launch_groups_and_grad_pack():
    """Runs of one (param, grad) dtype pair, at most PACK tensors; the pack holds the
    gradients' addresses of one run."""
    pd = [np.dtype(np.float32)] * 3 + [BF16] * (kernels.PACK + 2)
    grads = [_Fake(np.float32, 8 * i) for i in range(3)] + [_Fake(BF16) for _ in range(4)] \
        + [_Fake(np.float32) for _ in range(kernels.PACK - 2)]
    got = [(f, c, str(p), str(g)) for f, c, p, g in kernels.groups(pd, grads)]
    assert got == [(0, 3, "float32", "float32"), (3, 4, "bfloat16", "bfloat16"),
                   (7, kernels.PACK - 2, "bfloat16", "float32")]
    pack = kernels.grad_pack(grads, 1, 2)
    assert pack.shape == (1,) and pack.nbytes == 8 * kernels.PACK
    assert pack["g"][0, :3].tolist() == [8, 16, 0]


# ---- GPU: the fused kernels against the reference, and a captured step ------------------
def _three(rng, opt_fn, dtype, sizes, steps=3, grad_dtype=None):
    """(fused optimizer, the reference on NumPy in the same precision, the reference in
    float64) after `steps` steps on the same random parameters and gradients."""
    import cupy
    from conftest import poison_gpu_pool
    params, grads = make(rng, [(n,) for n in sizes], dtype, steps)
    if grad_dtype is not None:
        grads = [[g.astype(grad_dtype) for g in gs] for gs in grads]
    poison_gpu_pool()
    fused = opt_fn([cupy.asarray(p) for p in params])
    assert fused.fused
    ref, ref64 = opt_fn([p.copy() for p in params]), opt_fn([p.astype(np.float64)
                                                              for p in params])
    for gs in grads:
        fused.step([cupy.asarray(g) for g in gs])
        ref.step(gs)
        ref64.step([g.astype(np.float64) for g in gs])
    return fused, ref, ref64


def _close(got, want, dtype, atol=1e-5):
    from conftest import asnp
    rtol = {np.dtype(np.float32): 1.3e-6, BF16: 1.6e-2}[np.dtype(dtype)]
    np.testing.assert_allclose(asnp(got).astype(np.float64), asnp(want).astype(np.float64),
                               rtol=rtol, atol=atol)


def _master_atol(opt):
    """bf16 moments: a moment rounded to the other side of a bf16 tie (float32 arithmetic
    on the GPU, float64 in the reference) moves that step's update by up to lr 2^-8 (seen on
    an H100: 4 in 10^6 elements off by 3.4e-5 at lr 1e-2): allow 2 such steps."""
    bf16 = getattr(opt, "moments_dtype", None) == BF16
    return 2 * 1e-2 * 2.0 ** -8 if bf16 else 1e-5


def _moment_atol(fused, ref_row):
    """bf16 moments: a tie rounded the other way (see _master_atol) is carried by the later
    steps, scaled by beta, while the moment itself may shrink by cancellation (seen on an
    H100: 4.6e-4 apart at a moment of 8e-3, 5.6%): two bf16 ulps of the moment's largest
    magnitude; float32 moments: 1e-5."""
    from conftest import asnp
    if getattr(fused, "moments_dtype", None) != BF16 or not ref_row.size:
        return 1e-5
    return 2 * 2.0 ** -8 * float(np.abs(asnp(ref_row).astype(np.float64)).max())


def _compare(fused, ref, ref64):
    """Masters (else params) to float32 tolerance and within 2x the same-precision
    reference's error of float64; params, moments, step, lr and the norm."""
    for i, p in enumerate(fused.params):
        main = fused.masters[i] if fused.masters[i] is not None else p
        ref_main = ref.masters[i] if ref.masters[i] is not None else ref.params[i]
        _close(main, ref_main, np.float32, _master_atol(fused))
        if main.size:
            assert_within_2x_reference(main, ref64.params[i], ref_main, f"param {i}", 1e-6)
        if fused.masters[i] is not None:  # (else p was main, checked above)
            _close(p, ref.params[i], p.dtype, _master_atol(fused))
        for slot, rows in fused._slots().items():
            if rows[i] is not None:
                want = ref._slots()[slot][i]
                _close(rows[i], want, rows[i].dtype, _moment_atol(fused, want))
    assert fused.step_count == ref.step_count  # (the schedule: double on either side)
    assert fused.get_lr() == pytest.approx(ref.get_lr(), rel=1e-7)
    if fused.last_grad_norm is not None:
        np.testing.assert_allclose(float(fused.last_grad_norm[0]),
                                   float(ref64.last_grad_norm[0]), rtol=1e-5)


SIZES = [1, 7, 1000003, 4097, 0]


@gpu
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("moments", [None, BF16])
@pytest.mark.parametrize("dtype", [np.float32, BF16])
def test_fused_adamw_matches_reference(rng, dtype, moments, clip):
    def fn(p):
        return AdamW(p, lr=1e-2, weight_decay=0.1, moments_dtype=moments, max_grad_norm=clip,
                     schedule=WarmupCosine(1e-2, 2, 10, 1e-3))
    _compare(*_three(rng, fn, dtype, SIZES))


@gpu
@pytest.mark.parametrize("dtype, nesterov", [(np.float32, False), (BF16, True)])
def test_fused_sgd_matches_reference(rng, dtype, nesterov):
    def fn(p):
        return SGD(p, lr=0.05, momentum=0.9, weight_decay=0.01, nesterov=nesterov,
                   max_grad_norm=2.0)
    _compare(*_three(rng, fn, dtype, SIZES))


@gpu
@pytest.mark.parametrize("which", ["adamw", "sgd"])
def test_fused_step_bits_do_not_depend_on_the_gradient_dtype(rng, which):
    """The same gradients in bf16 and in float32 step two copies of a layer to the same
    bits: FP8 weights' float32 masters (ZeroOptimizer's shards take float32 gradients, the
    plain optimizer bf16 ones) and bf16 parameters' masters, moments and parameters. Left to
    ptxas, p * decay was fused into AdamW's last subtraction in some unrolled copies of the
    float32-gradient kernel only: masters a few ulps apart (found on 2 H100s by
    test_distributed_nccl's ZeRO test with FP8 weights); optim.cu now rounds each operation."""
    import cupy
    from conftest import asnp

    def layer():
        with tecupy.quantized_model_init(recipe=tecupy.recipe.Float8CurrentScaling()):
            return tecupy.nn.LayerNormMLP(144, 400, params_dtype=BF16, device="cuda", seed=5)
    kw = ({"lr": 1e-3, "weight_decay": 0.1} if which == "adamw" else
          {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01, "nesterov": True})
    cls = AdamW if which == "adamw" else SGD
    opts = [cls(layer().named_parameters(), **kw) for _ in range(2)]
    names = opts[0].names
    for _ in range(3):
        gs = {n: rng.standard_normal(p.shape).astype(BF16)
              for n, p in zip(names, opts[0].params)}
        opts[0].step({n: cupy.asarray(g) for n, g in gs.items()})
        opts[1].step({n: cupy.asarray(g.astype(np.float32)) for n, g in gs.items()})
    assert opts[0]._fp8 and any(m is not None for m in opts[0].masters)
    a, b = (opt.state_dict() for opt in opts)
    for k, v in a.items():
        if hasattr(v, "shape"):
            np.testing.assert_array_equal(asnp(b[k]).view(np.uint8), asnp(v).view(np.uint8),
                                          err_msg=k)


@gpu
def test_fused_many_tensors_mixed_dtypes(rng):
    """More tensors than one launch takes, float32 and bf16 interleaved (table order groups
    them), float32 gradients for bf16 parameters, a dict of parameters."""
    import cupy
    n = kernels.PACK + 45
    sizes = rng.integers(0, 3000, n)
    dtypes = [BF16 if i % 3 else np.float32 for i in range(n)]
    host = {f"p{i}": rng.standard_normal(s).astype(d) for i, (s, d) in
            enumerate(zip(sizes, dtypes))}
    fused = AdamW({k: cupy.asarray(v) for k, v in host.items()}, lr=1e-2, max_grad_norm=1.0)
    ref = AdamW({k: v.copy() for k, v in host.items()}, lr=1e-2, max_grad_norm=1.0)
    for _ in range(2):
        g = {k: rng.standard_normal(v.shape).astype(np.float32 if i % 2 else v.dtype)
             for i, (k, v) in enumerate(host.items())}
        fused.step({k: cupy.asarray(v) for k, v in g.items()})
        ref.step(g)
    for a, b, m, rm in zip(fused.params, ref.params, fused.masters, ref.masters):
        _close(a, b, a.dtype)
        if m is not None:
            _close(m, rm, np.float32)
    np.testing.assert_allclose(float(fused.last_grad_norm[0]), float(ref.last_grad_norm[0]),
                               rtol=1e-5)


@gpu
def test_graphed_step_with_optimizer_equals_eager():
    """A step function with forward, backward and AdamW (bf16 params, master weights, bf16
    moments, clipping, a device schedule): 1 warm-up step, the capture and 4 replays on one
    block equal 5 eager steps on its twin, bit for bit (outputs, norms, parameters, state).
    An MLP block: attention's backward sums dQ with atomics, not bit-reproducible."""
    import cupy
    r = np.random.default_rng(1)
    data = [tuple(cupy.asarray((r.standard_normal((32, 2, 128)) * s).astype(BF16))
                  for s in (1.0, 1e-2)) for _ in range(5)]

    def make_step():
        layer = tecupy.nn.LayerNormMLP(128, 512, params_dtype=BF16, device="cuda", seed=0)
        opt = AdamW(layer.named_parameters(), lr=1e-3, weight_decay=0.1, max_grad_norm=0.5,
                    moments_dtype=BF16, schedule=WarmupCosine(1e-3, 2, 10, 1e-4))

        def fn(x, dy):
            with tecupy.Tape() as tape:
                y = layer(x)
            opt.step(tape.gradient(y, layer, output_grad=dy))
            return y, opt.last_grad_norm
        return fn, layer, opt
    fn_e, layer_e, opt_e = make_step()
    want = [[a.get() for a in fn_e(x, dy)] for x, dy in data]
    fn_t, layer_t, opt_t = make_step()
    step = tecupy.make_graphed_step(fn_t, (cupy.array(data[0][0]), cupy.array(data[0][1])))
    for n, (x, dy) in enumerate(data[1:], 1):
        for i, (a, b) in enumerate(zip(step(x, dy), want[n])):
            assert a.get().tobytes() == b.tobytes(), f"step {n + 1}, output {i} differs"
    sd_e, sd_t = opt_e.state_dict(), opt_t.state_dict()
    sd_e.update(layer_e.state_dict())
    sd_t.update(layer_t.state_dict())
    assert sd_e.keys() == sd_t.keys() and sd_t["step"] == 5
    for k, v in sd_e.items():
        same = v.tobytes() == sd_t[k].tobytes() if isinstance(v, np.ndarray) else v == sd_t[k]
        assert same, k

"""Tensor and sequence parallel modules on the thread-backed reference communicator (issue 25
item 3): LayerNormLinear, LayerNormMLP, MultiheadAttention and TransformerLayer split over 2
and 4 ranks equal the single-device module of the same seed, outputs and every gradient
(each rank's shard compared with its cut of the single-device tensor), to 1e-12 in float64
and within FP8 tolerance under fp8_autocast (delayed scaling, reduce_amax True and False);
the FP8 sequence-parallel gather moves uint8 codes; amax reduction; option errors."""
import threading

import numpy as np
import pytest

import tecupy
from tecupy import distributed as dist
from tecupy.recipe import DelayedScaling

F64 = dict(params_dtype=np.float64, device="cpu")
F32 = dict(params_dtype=np.float32, device="cpu")
S, B = 8, 2  # sequence, batch (float64 runs)


def _cut(a, r, tp, axis, parts=None):
    """Rank r's piece of a full tensor (the test's own slicing, not tecupy's shard)."""
    if parts is None:
        return np.split(a, tp, axis=axis)[r]
    pieces = np.split(a, np.cumsum(parts)[:-1], axis=axis)
    return np.concatenate([np.split(p, tp, axis=axis)[r] for p in pieces], axis=axis)


def _run(module, x, dy, fp8=None):
    """(y, {"x": dx, parameter name: gradient}) of one forward and backward."""
    params = module.named_parameters()
    with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8 is not None, fp8_recipe=fp8):
        y = module(x)
    grads = tape.gradient(y, [x, *params.values()], output_grad=dy)
    return np.asarray(y), dict(zip(["x", *params], (np.asarray(g) for g in grads)))


def _layout(name, heads, groups, d, ffn, gated):
    """(axis, parts) of a parameter split over the ranks, None where replicated."""
    qkv = [heads * d, groups * d, groups * d]
    if name.endswith(("qkv.weight", "qkv.bias")):
        return 0, qkv
    if name.endswith(("fc1_weight", "fc1_bias")):
        return 0, [ffn] * (2 if gated else 1)
    if name.endswith(("proj.weight", "fc2_weight")):
        return 1, None
    return None


def _compare(make, tp, sp, x, dy, layout, fp8=None, check=None):
    """Every rank's output and gradients against their cuts of the single-device run."""
    want_y, want = _run(make(None, False), x, dy, fp8)

    def body(g):
        m = make(g, sp)
        xs, dys = (_cut(x, g.rank, tp, 0), _cut(dy, g.rank, tp, 0)) if sp else (x, dy)
        y, grads = _run(m, xs, dys, fp8)
        return y, grads, m
    for r, (y, grads, m) in enumerate(dist.run_threads(tp, body)):
        assert set(grads) == set(want)
        pieces = {"_y": (y, want_y), **{k: (grads[k], want[k]) for k in grads}}
        for name, (got, full) in pieces.items():
            if name in ("_y", "x") and sp:
                full = _cut(full, r, tp, 0)
            elif name not in ("_y", "x") and layout(name) is not None:
                full = _cut(full, r, tp, *layout(name))
            (check or _exact)(got, full, name)
        if check is None:  # the shards are those of the single-device initialisation
            ref = make(None, False).named_parameters()
            for name, p in m.named_parameters().items():
                lay = layout(name)
                np.testing.assert_array_equal(p, ref[name] if lay is None else
                                              _cut(ref[name], r, tp, *lay))


def _exact(got, want, name):
    assert got.shape == want.shape, name
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=name)


def _fp8_close(got, want, name, same_scales):
    """FP8 against FP8 on one device. With the same scales (reduce_amax) the codes are the
    same: float32 rounding apart. Without, each rank's scales come from its own amaxes:
    within FP8's tolerance (E5M2's of the design notes, atol relative to the tensor's
    largest value; the whole tensor's relative error below E5M2's rounding step 2**-3:
    measured 0.09 at most, from the gradients' E5M2 casts)."""
    assert got.shape == want.shape, name
    err = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30)
    assert err < (1e-5 if same_scales else 0.125), (name, err)
    np.testing.assert_allclose(got, want, rtol=0.25, atol=0.125 * np.abs(want).max(),
                               err_msg=name)


def _inputs(shape, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(shape), rng.standard_normal(shape)


# -- float64: exact ----------------------------------------------------------------------

@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, True)])
@pytest.mark.parametrize("norm", ["LayerNorm", "RMSNorm"])
def test_layernorm_linear_equals_single_device(tp, sp, norm):
    x, _ = _inputs((S, B, 16), 1)
    dy = np.random.default_rng(2).standard_normal((S, B, 24))

    def make(g, sp):
        m = tecupy.nn.LayerNormLinear(16, 24, normalization=norm, seed=3, **F64,
                                      parallel_mode="column" if g else None, tp_group=g,
                                      sequence_parallel=sp)
        bias = np.arange(24) / 7  # nonzero: its gradient and its shard matter
        m.bias[:] = bias if g is None else _cut(bias, g.rank, tp, 0)
        m.layer_norm_weight[:] = 1 + np.arange(16) / 16
        return m
    want_y, want = _run(make(None, False), x, dy)

    def body(g):  # column parallel: the output is this rank's features of every position
        xs = _cut(x, g.rank, tp, 0) if sp else x
        return _run(make(g, sp), xs, _cut(dy, g.rank, tp, 2))
    for r, (y, grads) in enumerate(dist.run_threads(tp, body)):
        _exact(y, _cut(want_y, r, tp, 2), "y")
        _exact(grads["x"], _cut(want["x"], r, tp, 0) if sp else want["x"], "x")
        for name in ("weight", "bias"):
            _exact(grads[name], _cut(want[name], r, tp, 0), name)
        for name in ("layer_norm_weight", "layer_norm_bias"):
            if name in want:
                _exact(grads[name], want[name], name)


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, False), (4, True)])
@pytest.mark.parametrize("act", ["gelu", "swiglu"])
def test_layernorm_mlp_equals_single_device(tp, sp, act):
    x, dy = _inputs((S, B, 16), 4)

    def make(g, sp):
        m = tecupy.nn.LayerNormMLP(16, 32, activation=act, seed=5, tp_group=g,
                                   sequence_parallel=sp, **F64)
        if g is None:  # (set on the full tensors, then cut: the shards see the same values)
            m.fc1_bias[:] = np.linspace(-1, 1, m.fc1_bias.size)
            m.fc2_bias[:] = 0.25
        else:
            m.fc1_bias[:] = _cut(np.linspace(-1, 1, m.fc1_bias.size * tp), g.rank, tp, 0,
                                 [32] * (2 if act == "swiglu" else 1))
            m.fc2_bias[:] = 0.25
        return m
    _compare(make, tp, sp, x, dy, lambda n: _layout(n, 0, 0, 0, 32, act == "swiglu"))


@pytest.mark.parametrize("tp,sp,groups,ln", [(2, False, None, True), (2, True, 2, True),
                                             (4, True, 4, True), (4, False, None, True),
                                             (2, True, 2, False), (2, False, None, False)])
def test_multihead_attention_equals_single_device(tp, sp, groups, ln):
    heads, d = 4, 4
    x, dy = _inputs((S, B, 16), 6)

    def make(g, sp):
        return tecupy.nn.MultiheadAttention(16, heads, attention_dropout=0.0,
                                            num_gqa_groups=groups, input_layernorm=ln,
                                            seed=7, tp_group=g, sequence_parallel=sp, **F64)
    _compare(make, tp, sp, x, dy, lambda n: _layout(n, heads, groups or heads, d, 0, False))


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True), (4, True)])
def test_transformer_layer_equals_single_device(tp, sp):
    heads, groups, d = 4, 2 if tp == 2 else 4, 4
    x, dy = _inputs((S, B, 16), 8)

    def make(g, sp):
        return tecupy.nn.TransformerLayer(16, 32, heads, num_gqa_groups=groups,
                                          hidden_dropout=0.0, attention_dropout=0.0,
                                          seed=9, tp_group=g, sequence_parallel=sp, **F64)
    _compare(make, tp, sp, x, dy, lambda n: _layout(n, heads, groups, d, 32, False))


@pytest.mark.parametrize("sp", [False, True])
def test_transformer_layer_rope_gqa_swiglu_rmsnorm(sp):
    """RoPE on this rank's q heads and k groups (packed qkv of the local heads), GQA,
    swiglu and RMSNorm at TP=2: equal to the single device."""
    heads, groups, d = 4, 2, 4
    x, dy = _inputs((S, B, 16), 16)
    freqs = tecupy.nn.RotaryPositionEmbedding(d, device="cpu")(S)  # (the ranks run on NumPy)

    class WithRope:  # (the module, called with the frequencies)
        def __init__(self, m):
            self.m = m

        def __call__(self, x):
            return self.m(x, rotary_pos_emb=freqs)

        def named_parameters(self):
            return self.m.named_parameters()

    def make(g, sp):
        return WithRope(tecupy.nn.TransformerLayer(
            16, 32, heads, num_gqa_groups=groups, hidden_dropout=0.0, attention_dropout=0.0,
            normalization="RMSNorm", activation="swiglu", seed=17, tp_group=g,
            sequence_parallel=sp, **F64))
    _compare(make, 2, sp, x, dy, lambda n: _layout(n, heads, groups, d, 32, True))


def test_transformer_layer_dropout_tp_and_sp():
    """Hidden dropout under TP alone: the single device's masks (the same seed on every
    rank); under SP: each rank's own masks, reproducible from (seed, rank)."""
    x, dy = _inputs((S, B, 16), 10)

    def make(g, sp):
        return tecupy.nn.TransformerLayer(16, 32, 4, hidden_dropout=0.5, attention_dropout=0.0,
                                          seed=11, tp_group=g, sequence_parallel=sp, **F64)
    _compare(make, 2, False, x, dy, lambda n: _layout(n, 4, 4, 4, 32, False))

    def body(g):
        return [make(g, True)(_cut(x, g.rank, 2, 0)) for _ in range(2)]
    first, again = dist.run_threads(2, body), dist.run_threads(2, body)
    for (a, _), (b, _) in zip(first, again):
        np.testing.assert_array_equal(a, b)  # reproducible
    single = make(None, False)(x)
    # the masks differ from the single device's on rank 1 (rank 0 keeps the seed, and the
    # attention's output it adds to is that of the whole sequence: rank 0's chunk agrees)
    np.testing.assert_allclose(first[0][0], single[:S // 2], rtol=1e-12, atol=1e-12)
    assert not np.allclose(first[1][0], single[S // 2:])


# -- FP8 ---------------------------------------------------------------------------------

FP8_S, FP8_B = 32, 2


def _fp8_layer(g, sp):
    return tecupy.nn.TransformerLayer(64, 128, 4, hidden_dropout=0.0, attention_dropout=0.0,
                                      seed=12, tp_group=g, sequence_parallel=sp, **F32)


@pytest.mark.parametrize("reduce_amax", [True, False])
@pytest.mark.parametrize("tp,sp", [(2, True), (4, True), (2, False)])
def test_transformer_layer_fp8_equals_single_device(tp, sp, reduce_amax):
    """Two FP8 steps (the second with the scales the first's amaxes made): outputs and
    gradients within FP8 tolerance of the single device. With reduce_amax the ranks' forward
    scales are those of the single device (the shards' amaxes maxed over the group)."""
    x, dy = (a.astype(np.float32) for a in _inputs((FP8_S, FP8_B, 64), 13))
    recipe = DelayedScaling(amax_history_len=4, reduce_amax=reduce_amax)
    single = _fp8_layer(None, False)
    for _ in range(2):
        want_y, want = _run(single, x, dy, recipe)

    def body(g):
        m = _fp8_layer(g, sp)
        xs, dys = (_cut(x, g.rank, tp, 0), _cut(dy, g.rank, tp, 0)) if sp else (x, dy)
        for _ in range(2):
            y, grads = _run(m, xs, dys, recipe)
        return y, grads, m
    lay = lambda n: _layout(n, 4, 4, 16, 128, False)  # noqa: E731
    differs = False
    for r, (y, grads, m) in enumerate(dist.run_threads(tp, body)):
        _fp8_close(y, _cut(want_y, r, tp, 0) if sp else want_y, "y", reduce_amax)
        for name, g in grads.items():
            full = want[name]
            if name == "x" and sp:
                full = _cut(full, r, tp, 0)
            elif name != "x" and lay(name) is not None:
                full = _cut(full, r, tp, *lay(name))
            _fp8_close(g, full, name, reduce_amax)
        for key, st in (("self_attention.layernorm_qkv.", m.self_attention.layernorm_qkv),
                        ("layernorm_mlp.", m.layernorm_mlp)):
            ref = {"self_attention.layernorm_qkv.": single.self_attention.layernorm_qkv,
                   "layernorm_mlp.": single.layernorm_mlp}[key]
            got, exp = st.fp8_state.fwd.scale, ref.fp8_state.fwd.scale
            if reduce_amax:
                np.testing.assert_allclose(got, exp, rtol=1e-5, err_msg=key)
            else:
                differs |= not np.allclose(got, exp, rtol=1e-5)
    if not reduce_amax:
        assert differs  # (each rank's weight shard has its own amax: the test can tell)


@pytest.mark.parametrize("bulk", [False, True])
@pytest.mark.parametrize("kind", ["LayerNormMLP", "LayerNormLinear", "LayerNormMLP+residual"])
def test_norm_blocks_sp_fp8_are_one_node(monkeypatch, kind, bulk):
    """Under sequence parallel, FP8 delayed scaling with reduce_amax, LayerNormMLP and
    LayerNormLinear run as one node each, as on one device (fp8_blocks.py): the norm casts in
    its pass (the composed path: a bf16 norm output cast apart), the MLP's activation
    backward is cast in fc2's dgrad chunks (composed: gelu_bwd, then a cast), the norm's two
    gradients are all-reduced in one group call; within FP8 tolerance of the composed path
    (fp8_blocks off) and of the single device's gradients. bulk: dgrad reduce-scattered
    beside wgrad (the thread group takes that path when forced, as NCCL does). The MLP adds
    fc2's bias (and a residual) after its reduce-scatter in one pass; fc2's bias gradient
    comes from dy's chunk cast (no bias_grad) and is all-reduced with the norm's."""
    from tecupy import backends
    from tecupy.distributed import overlap
    import tecupy.nn.layers as layers_mod
    monkeypatch.setattr(overlap, "bulk", lambda group, *a: bulk)
    x, dy = (a.astype(np.float32) for a in _inputs((FP8_S, FP8_B, 64), 19))
    res = (x[::-1] * 0.5).copy() if kind.endswith("residual") else None
    mlp = kind.startswith("LayerNormMLP")
    if kind == "LayerNormLinear":
        dy = np.concatenate([dy, dy[..., ::-1]], axis=-1)  # (out_features 128: 64 a rank)
    recipe = DelayedScaling(amax_history_len=4, reduce_amax=True)
    seen, real = {}, backends.dispatch

    def counting(op, *a, **k):
        seen.setdefault(threading.get_ident(), []).append(op)
        return real(op, *a, **k)
    monkeypatch.setattr(backends, "dispatch", counting)

    def make(g):
        tp = dict(seed=3, tp_group=g, sequence_parallel=g is not None, **F32)
        if mlp:
            return tecupy.nn.LayerNormMLP(64, 128, **tp)
        return tecupy.nn.LayerNormLinear(64, 128, parallel_mode="column" if g else None, **tp)

    def run(m, xs, dys, rs):
        if rs is None:
            return _run(m, xs, dys, recipe)
        params = m.named_parameters()
        with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
            y = m(xs, residual=rs)
        grads = tape.gradient(y, [xs, rs, *params.values()], output_grad=dys)
        return np.asarray(y), dict(zip(["x", "residual", *params], map(np.asarray, grads)))

    def body(g):
        m = make(g)
        groups = []
        g.all_reduce_many = lambda arrays, op="sum": (
            groups.append(len(arrays)), type(g).all_reduce_many(g, arrays, op))[1]
        xs = _cut(x, g.rank, 2, 0)
        dys = _cut(dy, g.rank, 2, 0) if mlp else _cut(dy, g.rank, 2, 2)
        rs = None if res is None else _cut(res, g.rank, 2, 0)
        for _ in range(2):
            seen.pop(threading.get_ident(), None)
            groups.clear()
            y, grads = run(m, xs, dys, rs)
        return y, grads, seen.pop(threading.get_ident()), groups
    got = dist.run_threads(2, body)
    fused = "layernorm_mlp_sp" if mlp else "layernorm_linear_sp"
    monkeypatch.setattr(layers_mod, fused, lambda *a: None)
    composed = dist.run_threads(2, body)
    single = make(None)
    for _ in range(2):
        _, want = run(single, x, dy, res)
    for r, ((y, grads, ops, groups), (y_c, grads_c, ops_c, _)) in enumerate(
            zip(got, composed)):
        assert "layernorm_fwd_fp8" in ops and "layernorm_fwd" not in ops
        assert "layernorm_fwd" in ops_c and "layernorm_fwd_fp8" not in ops_c
        if mlp:
            assert "dact_cast_transpose" in ops and "dact_cast_transpose" not in ops_c
            assert "bias_grad" not in ops and "bias_grad" in ops_c
            assert ops.count("add_fwd") == 1  # bias (+ residual) after the reduce-scatter
        # amaxes (forward), the norm's weight and bias (+ fc2's bias), amaxes (backward)
        assert groups == [1, 3 if mlp else 2, 1]
        _fp8_close(y, y_c, "y", True)
        for name in grads:
            _fp8_close(grads[name], grads_c[name], name, True)
        _fp8_close(grads["x"], _cut(want["x"], r, 2, 0), "x", True)
        for name in ("layer_norm_weight", "layer_norm_bias") + (("fc2_bias",) if mlp else ()):
            _fp8_close(grads[name], want[name], name, True)
        if res is not None:
            np.testing.assert_array_equal(grads["residual"], _cut(dy, r, 2, 0))


@pytest.mark.parametrize("init", [False, True], ids=["hp-weights", "fp8-weights"])
def test_layernorm_mlp_sp_current_scaling_and_fp8_weights(init):
    """Float8CurrentScaling under sequence parallel (the gathered input's scale from the
    chunks' amaxes maxed over the group: the whole sequence's) and FP8 weights
    (quantized_model_init: each rank's shard cast on its own): within FP8 tolerance."""
    from tecupy.recipe import Float8CurrentScaling
    x, dy = (a.astype(np.float32) for a in _inputs((FP8_S, FP8_B, 64), 14))
    recipe = DelayedScaling() if init else Float8CurrentScaling()

    def make(g):
        import contextlib
        ctx = tecupy.quantized_model_init(recipe=recipe) if init else contextlib.nullcontext()
        with ctx:
            return tecupy.nn.LayerNormMLP(64, 128, seed=15, tp_group=g,
                                          sequence_parallel=g is not None, **F32)
    want_y, want = _run(make(None), x, dy, recipe)

    def body(g):
        m = make(g)
        assert type(m.fc1_weight).__name__ == ("FP8Weight" if init else "ndarray")
        return _run(m, _cut(x, g.rank, 2, 0), _cut(dy, g.rank, 2, 0), recipe)
    for r, (y, grads) in enumerate(dist.run_threads(2, body)):
        _fp8_close(y, _cut(want_y, r, 2, 0), "y", False)
        _fp8_close(grads["x"], _cut(want["x"], r, 2, 0), "x", False)
        _fp8_close(grads["layer_norm_weight"], want["layer_norm_weight"], "ln", False)


@pytest.mark.parametrize("recipe", ["current", "block"])
def test_transformer_layer_sp_current_and_block_scaling(recipe):
    """TP=2 + sequence parallel TransformerLayer under Float8CurrentScaling (dy's codes
    gathered with the chunks' amaxes maxed over the group) and Float8BlockScaling (no codes
    travel: x gathered in high precision, then quantized whole in its blocks as on one
    device; before, its per-tensor gather met the weight's block scales and the backward
    raised): output and x's gradient within FP8 tolerance of the single device."""
    from tecupy.recipe import Float8BlockScaling, Float8CurrentScaling
    recipe = Float8CurrentScaling() if recipe == "current" else Float8BlockScaling()
    x, dy = (a.astype(np.float32) for a in _inputs((FP8_S, FP8_B, 64), 17))
    want_y, want = _run(_fp8_layer(None, False), x, dy, recipe)

    def body(g):
        return _run(_fp8_layer(g, True), _cut(x, g.rank, 2, 0), _cut(dy, g.rank, 2, 0), recipe)
    for r, (y, grads) in enumerate(dist.run_threads(2, body)):
        _fp8_close(y, _cut(want_y, r, 2, 0), "y", False)
        _fp8_close(grads["x"], _cut(want["x"], r, 2, 0), "x", False)


@pytest.mark.parametrize("ring", [False, True], ids=["all_gather", "ring"])
def test_sequence_parallel_fp8_gathers_uint8_codes(ring, monkeypatch):
    """Under fp8_autocast the sequence-parallel gather moves the activation's uint8 codes
    (half of bf16's bytes) and no high-precision activation; outside it, the activation.
    With the comm-GEMM overlap (ring) the same chunks travel by shift(), one step each."""
    from tecupy.distributed import overlap
    monkeypatch.setattr(overlap, "OVERLAP", ring)
    seen = []

    class Spy(dist.ThreadGroup):
        def _all_gather(self, x, axis):
            seen.append((self.rank, x.dtype, x.shape))
            return super()._all_gather(x, axis)

        def _shift(self, x, out):
            seen.append((self.rank, x.dtype, x.shape))
            return super()._shift(x, out)

    def body(g):
        spy = Spy(g._world, g.rank)
        m = tecupy.nn.LayerNormLinear(64, 32, seed=1, parallel_mode="column", tp_group=spy,
                                      sequence_parallel=True, **F32)
        x = np.random.default_rng(g.rank).standard_normal((16, 2, 64)).astype(np.float32)
        with tecupy.fp8_autocast(fp8_recipe=DelayedScaling()):
            m(x)
        m(x)
    dist.run_threads(2, body)
    assert sorted(dt.name for r, dt, _ in seen if r == 0) == ["float32", "uint8"]
    want = (32, 64) if ring else (16, 2, 64)
    assert all(shape == (want if dt == np.float32 else (32, 64)) for r, dt, shape in seen)


def test_sequence_parallel_fp8_backward_gathers_dy_codes(monkeypatch):
    """Under fp8_autocast the row-parallel GEMMs (proj, fc2) reduce-scatter inside their FP8
    node, and their backward all-gathers dy as uint8 codes cast with the group's one scale
    (TE's FP8 gather of dy), not dy in float: no float array is all-gathered in a step; two
    steps give the same bits as the unfused path (reduce-scatter node, dy gathered in
    float, then cast whole) under reduce_amax: the same scale, codes and amaxes."""
    import importlib
    fp8_gather = importlib.import_module("tecupy.distributed.fp8_gather")
    x, dy = (a.astype(np.float32) for a in _inputs((FP8_S, FP8_B, 64), 16))
    recipe = DelayedScaling(amax_history_len=4, reduce_amax=True)
    seen = []

    class Spy(dist.ThreadGroup):
        def _all_gather(self, a, axis):
            seen.append(a.dtype.name)
            return super()._all_gather(a, axis)

    def body(g):
        spy = Spy(g._world, g.rank)
        m = _fp8_layer(spy, True)
        for _ in range(2):
            y, grads = _run(m, _cut(x, g.rank, 2, 0), _cut(dy, g.rank, 2, 0), recipe)
        return y, grads
    fused = dist.run_threads(2, body)
    assert seen and set(seen) == {"uint8"}, seen
    monkeypatch.setattr(fp8_gather.SequenceReduce, "takes", staticmethod(lambda q: False))
    seen.clear()
    unfused = dist.run_threads(2, body)
    assert "float32" in seen  # (the unfused path gathers dy in float: the test can tell)
    for (y, grads), (y0, grads0) in zip(fused, unfused):
        np.testing.assert_array_equal(y, y0)
        for name in grads0:
            np.testing.assert_array_equal(grads[name], grads0[name], err_msg=name)


def test_amax_reduction_only_with_a_group_and_reduce_amax():
    """FP8State.amax_group: the forward amaxes are maxed over it before the update when the
    recipe's reduce_amax is on; off, or with no group, each rank keeps its own."""
    def body(g, reduce_amax, group):
        st = tecupy.FP8State(1)
        st.amax_group = g if group else None
        w = np.full((16, 16), 1.0 + g.rank, np.float32)  # rank r's weight amax: r + 1
        x = np.ones((16, 16), np.float32)
        with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=DelayedScaling(
                amax_history_len=2, reduce_amax=reduce_amax)):
            tecupy.linear(x, w, fp8_state=st)
        return np.asarray(st.fwd.scale[1]), np.asarray(st.fwd.amax_history[1, 1])
    for reduce_amax, group, want in ((True, True, [2, 2]), (False, True, [1, 2]),
                                     (True, False, [1, 2])):
        out = dist.run_threads(2, body, reduce_amax, group)
        np.testing.assert_array_equal([h for _, h in out], want)
        np.testing.assert_allclose([s for s, _ in out], [448.0 / a for a in want])


# -- option errors ------------------------------------------------------------------------

def test_tp_option_errors():
    def body(g):
        with pytest.raises(ValueError, match=r"num_attention_heads \(3\) must be a multiple "
                                              r"of tp_size \(2\)"):
            tecupy.nn.MultiheadAttention(12, 3, tp_group=g, **F64)
        with pytest.raises(ValueError, match=r"num_gqa_groups \(1\) must be a multiple"):
            tecupy.nn.TransformerLayer(16, 32, 4, num_gqa_groups=1, tp_group=g, **F64)
        with pytest.raises(ValueError, match=r"ffn_hidden_size \(33\) must be a multiple"):
            tecupy.nn.TransformerLayer(16, 33, 4, tp_group=g, **F64)
        with pytest.raises(ValueError, match=r"ffn_hidden_size \(33\) splits over tp_size 2"):
            tecupy.nn.LayerNormMLP(16, 33, tp_group=g, **F64)
        with pytest.raises(ValueError, match="attn_input_format must be 'sbhd' with "
                                             "sequence_parallel"):
            tecupy.nn.TransformerLayer(16, 32, 4, attn_input_format="bshd", tp_group=g,
                                       sequence_parallel=True, **F64)
        with pytest.raises(ValueError, match="parallel_mode must be one of 'column'"):
            tecupy.nn.LayerNormLinear(16, 16, parallel_mode="row", tp_group=g, **F64)
        with pytest.raises(ValueError, match=r"splits out_features \(15\) over tp_size 2"):
            tecupy.nn.LayerNormLinear(16, 15, parallel_mode="column", tp_group=g, **F64)
        with pytest.raises(ValueError, match="does not split into 2 equal parts"):
            dist.shard(np.ones((7, 2, 16)), g, 0)  # a sequence that does not split
    dist.run_threads(2, body)
    for make in (lambda: tecupy.nn.LayerNormMLP(16, 32, sequence_parallel=True, **F64),
                 lambda: tecupy.nn.TransformerLayer(16, 32, 4, sequence_parallel=True, **F64),
                 lambda: tecupy.nn.Linear(16, 16, parallel_mode="row",
                                          sequence_parallel=True, **F64)):
        with pytest.raises(ValueError, match="sequence_parallel=True needs a tp_group"):
            make()
    for make in (lambda: tecupy.nn.LayerNormMLP(16, 32, tp_group="g", **F64),
                 lambda: tecupy.nn.MultiheadAttention(16, 4, tp_group=object(), **F64)):
        with pytest.raises(TypeError, match="tp_group must be None or a tecupy.distributed"):
            make()
    with pytest.raises(ValueError, match="tp_size must be None or the size of tp_group"):
        tecupy.nn.TransformerLayer(16, 32, 4, tp_size=2, **F64)


def test_bench_tp_step_on_threads(capsys):
    """python -m tecupy.bench distributed's part 4 on ThreadGroup ranks: tp_build cuts the
    single-device bench layer's input (tecupy.__main__.build, same seed) into sequence
    chunks, and tp_step's gradients are those of the single step (float32; the replicated
    norm weights whole, fc2's columns); the table's ratio is TP step / single-GPU step."""
    from tecupy.__main__ import build
    from tecupy.bench.distributed_tp import print_tp, tp_build, tp_step
    shape = (32, 64, 4, 8, 2)  # hidden, ffn, heads, seq, batch
    layer, x, dy = build(shape, "cpu")
    want = tp_step(layer, x, dy, None)()

    def body(g):
        tl, tx, tdy = tp_build(shape, g, "cpu")
        np.testing.assert_array_equal(tx, _cut(x, g.rank, 2, 0))
        return tp_step(tl, tx, tdy, None)()
    for r, got in enumerate(dist.run_threads(2, body)):
        for name in ("layernorm_mlp.layer_norm_weight", "self_attention.proj.bias"):
            np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got["layernorm_mlp.fc2_weight"],
                                   _cut(want["layernorm_mlp.fc2_weight"], r, 2, 1),
                                   rtol=1e-4, atol=1e-6)
    steps = {"HP": {"single": (10.0, 1.0)}, "FP8": {"single": (8.0, 1.0)}}
    print_tp({"HP": {False: (5.5, 2.0), True: (5.0, 2.0)},
              "FP8": {False: (5.0, 2.0), True: (4.6, 2.0)}}, steps, 2, "full")
    out = capsys.readouterr().out
    assert "target: <= 0.60x" in out and "(4096, 16384, 32, 2048, 4)" in out
    assert "| HP | off | 10.00 | 5.50 | 2.00 | 0.55x | met |" in out
    assert "| HP | on | 10.00 | 5.00 | 2.00 | 0.50x | met |" in out
    assert "| FP8 | off | 8.00 | 5.00 | 2.00 | 0.62x | missed |" in out
    assert "| FP8 | on | 8.00 | 4.60 | 2.00 | 0.57x | met |" in out


def _small_tp_bench(monkeypatch, rate):
    """Part 4 of the distributed bench on a small CPU layer, rate(step, xp) timing it."""
    import cupy

    from tecupy.bench import distributed_tp as bench
    from tecupy.bench import layer as bench_layer
    real_build = bench.tp_build
    monkeypatch.setattr(bench, "tp_build",
                        lambda shape, g, device: real_build((32, 64, 4, 8, 2), g, "cpu"))
    monkeypatch.setattr(bench_layer, "_rate", rate)
    monkeypatch.setattr(cupy, "get_default_memory_pool",
                        lambda: type("Pool", (), {"free_all_blocks": lambda self: None})())


def test_bench_tp_rows_time_overlap_off_and_on(monkeypatch):
    """Part 4's _tp_rows on ThreadGroup ranks (a small CPU layer, the timing faked): one
    row per precision and overlap setting, each step run with OVERLAP as its row says,
    OVERLAP restored after."""
    from tecupy.bench import distributed_tp as bench
    from tecupy.distributed import overlap
    seen, before = [], overlap.OVERLAP

    def rate(step, xp):
        seen.append(overlap.OVERLAP)
        step()
        return (1.0 + overlap.OVERLAP, 0.5)
    _small_tp_bench(monkeypatch, rate)
    got = dist.run_threads(2, bench._tp_rows, "small")
    assert got[0] == {"HP": {False: (1.0, 0.5), True: (2.0, 0.5)},
                      "FP8": {False: (1.0, 0.5), True: (2.0, 0.5)}}
    assert seen.count(False) == seen.count(True) == 4
    assert overlap.OVERLAP is before  # (restored)


def test_bench_tp_rows_keep_the_plain_rows_when_the_overlap_raises(monkeypatch, capsys):
    """An overlapped step that raises (on every rank) leaves its rows out with the reason;
    the plain rows come back and the table says so."""
    from tecupy.bench import distributed_tp as bench
    from tecupy.distributed import overlap

    def rate(step, xp):
        if overlap.OVERLAP:
            raise RuntimeError("no send")
        return (1.0, 0.5)
    _small_tp_bench(monkeypatch, rate)
    got = dist.run_threads(2, bench._tp_rows, "small")[0]
    assert got == {"HP": {False: (1.0, 0.5)}, "FP8": {False: (1.0, 0.5)},
                   "error": "HP with the overlap: RuntimeError: no send"}
    bench.print_tp(got, {"HP": {"single": (2.0, 1.0)}, "FP8": {"single": (2.0, 1.0)}}, 2,
                   "full")
    out = capsys.readouterr().out
    assert "| FP8 | off | 2.00 | 1.00 | 0.50 | 0.50x | met |" in out
    assert "overlap rows left out: HP with the overlap: RuntimeError: no send" in out


def test_bench_tp_rows_graphed_rows_and_their_failure(monkeypatch, capsys):
    """The plain TP step is timed in a CUDA graph too (a "graphed" row, compared with the
    single-GPU step graphed); a capture that raises leaves those rows out and the table
    says why, the eager rows stay."""
    from tecupy.bench import distributed_tp as bench

    def rate(g, layer_size, recipe, graphed=False):
        if graphed and recipe is not None:
            raise RuntimeError("not capturable")
        return (0.5, 0.25) if graphed else (1.0, 0.5)
    monkeypatch.setattr(bench, "_tp_rate", rate)
    got = dist.run_threads(2, bench._tp_rows, "small")[0]
    assert got == {"HP": {False: (1.0, 0.5), "graphed": (0.5, 0.25), True: (1.0, 0.5)},
                   "FP8": {False: (1.0, 0.5), True: (1.0, 0.5)},
                   "graphed error": "FP8 graphed: RuntimeError: not capturable"}
    steps = {"HP": {"single": (2.0, 1.0), "single graphed": (2.5, 1.0)},
             "FP8": {"single": (2.0, 1.0), "single graphed": (2.5, 1.0)}}
    bench.print_tp(got, steps, 2, "full")
    out = capsys.readouterr().out
    assert "| HP | off, graphed | 2.50 | 0.50 | 0.25 | 0.20x | met |" in out
    assert "| FP8 | off | 2.00 | 1.00 | 0.50 | 0.50x | met |" in out
    assert "graphed rows left out: FP8 graphed: RuntimeError: not capturable" in out


@pytest.mark.parametrize("how", ["checkpoint", "retain_graph"])
def test_sp_fp8_blocks_under_checkpoint_and_retain_graph(monkeypatch, how):
    """The one-node sequence-parallel FP8 blocks (fp8_blocks.py) recomputed by
    tecupy.checkpoint, or run with retain_graph=True (their saved codes left in place):
    two steps bit for bit the plain steps' outputs and gradients, on each rank."""
    from tecupy.distributed import fp8_blocks
    calls, real = [], fp8_blocks._mlp_sp_fp8
    x, dy = (a.astype(np.float32) for a in _inputs((FP8_S, FP8_B, 64), 23))
    recipe = DelayedScaling(amax_history_len=4, reduce_amax=True)

    def body(g, variant):
        m = _fp8_layer(g, True)
        xs, dys = _cut(x, g.rank, 2, 0), _cut(dy, g.rank, 2, 0)
        for _ in range(2):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
                y = tecupy.checkpoint(m, xs) if variant == "checkpoint" else m(xs)
            grads = tape.gradient(y, dict(m.named_parameters(), x=xs), output_grad=dys,
                                  retain_graph=variant == "retain_graph")
        return np.asarray(y), {k: np.asarray(v) for k, v in grads.items()}
    monkeypatch.setattr(fp8_blocks, "_mlp_sp_fp8", lambda *a: calls.append(1) or real(*a))
    plain = dist.run_threads(2, lambda g: body(g, None))
    assert calls  # (the one-node MLP ran)
    other = dist.run_threads(2, lambda g: body(g, how))
    for (y, grads), (y2, grads2) in zip(plain, other):
        assert y.tobytes() == y2.tobytes()
        for k in grads:
            assert grads[k].tobytes() == grads2[k].tobytes(), k

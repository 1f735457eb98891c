"""Finite-difference gradient checks, in float64, for every differentiable tecupy op.

Each check builds the scalar objective L = sum(out * R) for a fixed random R (passed to
`Tape.gradient` as output_grad) and compares the analytic gradient of L with respect to
every input against central differences on a few randomly chosen entries per input (all
entries when the input is small). Data are fresh random numbers on every run.
"""
import numpy as np
import pytest

import tecupy
from tecupy import Tape
from tecupy._array import xp_of
from tecupy.activation_table import TABLE
from tecupy.ops.attention import MASKS

from conftest import asnp

FD_STEP = 1e-6
# Central differences in float64 with h = 1e-6: truncation ~h^2 |f'''| ~ 1e-12, roundoff
# ~1e-16 |out| / h ~ 1e-10 per output element (the difference out(+h) - out(-h) is taken
# before the reduction with R, which keeps cancellation small). Observed errors are at
# most ~4e-8 absolute and ~2% of these bounds; a wrong backward misses by far more.
RTOL, ATOL = 1e-5, 1e-7


def _entries(shape, rng, n):
    size = int(np.prod(shape))
    flat = np.arange(size) if size <= n else rng.choice(size, n, replace=False)
    return [tuple(int(i) for i in np.unravel_index(int(k), shape)) for k in flat]


def fd_check(f, inputs, rng, module=None, n=16, step=FD_STEP, rtol=RTOL, atol=ATOL):
    """Check tape gradients of L = sum(f() * R) against central differences.

    f: no-argument callable running tecupy ops on the arrays in `inputs` (it may return one
    array or a tuple of arrays). inputs: dict name -> array (or a list), the arrays to
    differentiate and perturb (in place, restored afterwards). module: when given, the
    gradients of its parameters come from `tape.gradient(out, module, ...)` (a dict by
    parameter name, which must be exactly the module's parameters); inputs not among them
    (e.g. the module's input "x") are asked for separately. n: entries checked per input
    (all when the input has at most n). Returns (outputs, analytic gradients dict)."""
    if not isinstance(inputs, dict):
        inputs = {f"input{i}": a for i, a in enumerate(inputs)}
    xp = xp_of(next(iter(inputs.values())))

    def outputs():
        out = f()
        return (list(out), True) if isinstance(out, (list, tuple)) else ([out], False)

    with Tape() as tape:
        outs, many = outputs()
    rs = [xp.asarray(rng.standard_normal(np.shape(o))) for o in outs]
    og = rs if many else rs[0]
    wrt_outs = outs if many else outs[0]
    if module is None:
        grads = tape.gradient(wrt_outs, inputs, output_grad=og)
    else:
        grads = tape.gradient(wrt_outs, module, output_grad=og, retain_graph=True)
        assert set(grads) == set(module.named_parameters())
        rest = {k: v for k, v in inputs.items() if k not in grads}
        if rest:
            grads.update(tape.gradient(wrt_outs, rest, output_grad=og))
    assert set(grads) == set(inputs)

    def snapshot():  # copies: some ops return views of their input
        return [xp.array(o, dtype=np.float64, copy=True) for o in outputs()[0]]

    bad = []
    for name, a in inputs.items():
        g = asnp(grads[name])
        assert g.shape == tuple(a.shape), (name, g.shape, a.shape)
        assert g.dtype == a.dtype, (name, g.dtype, a.dtype)
        assert np.all(np.isfinite(g)), name
        for idx in _entries(a.shape, rng, n):
            orig = float(a[idx])
            a[idx] = orig + step
            plus = snapshot()
            a[idx] = orig - step
            minus = snapshot()
            a[idx] = orig
            num = sum(float(((p - m) * r).sum()) for p, m, r in zip(plus, minus, rs)) / (2 * step)
            ana = float(g[idx])
            if not abs(ana - num) <= atol + rtol * abs(num):
                bad.append(f"{name}{list(idx)}: analytic {ana:.10g}, numeric {num:.10g}, "
                           f"diff {ana - num:.3g}")
    assert not bad, "gradient mismatch:\n" + "\n".join(bad)
    return (outs if many else outs[0]), grads


def randn(xp, rng, *shape, scale=1.0):
    return xp.asarray(rng.standard_normal(shape) * scale)


# ---- the fd_check helper itself ----------------------------------------------------------

def test_fd_check_catches_a_wrong_gradient(xp, rng):
    """The checker must fail on a deliberately wrong backward (guards against a vacuous
    helper)."""
    from tecupy.tape import record
    x = randn(xp, rng, 3, 4)

    def wrong_square(a):
        y = a * a
        record(lambda dy: (dy * a,), (a,), (y,))  # should be 2 * a * dy
        return y
    with pytest.raises(AssertionError, match="gradient mismatch"):
        fd_check(lambda: wrong_square(x), {"x": x}, rng)


# ---- linear ------------------------------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear(xp, rng, bias):
    x, w = randn(xp, rng, 2, 5, 7), randn(xp, rng, 9, 7)
    b = randn(xp, rng, 9) if bias else None
    inputs = {"x": x, "weight": w}
    if bias:
        inputs["bias"] = b
    y, _ = fd_check(lambda: tecupy.linear(x, w, b), inputs, rng)
    assert y.shape == (2, 5, 9)
    ref = np.einsum("bsk,nk->bsn", asnp(x), asnp(w)) + (asnp(b) if bias else 0)
    np.testing.assert_allclose(asnp(y), ref, rtol=1e-12, atol=1e-12)


# ---- normalization -----------------------------------------------------------------------

@pytest.mark.parametrize("zcg", [False, True], ids=["gamma", "zero_centered"])
def test_layernorm(xp, rng, zcg):
    x = randn(xp, rng, 2, 5, 7, scale=2.0) + 0.5
    w, b = randn(xp, rng, 7), randn(xp, rng, 7)
    fd_check(lambda: tecupy.layernorm(x, w, b, 1e-5, zcg), {"x": x, "weight": w, "bias": b},
             rng)


@pytest.mark.parametrize("zcg", [False, True], ids=["gamma", "zero_centered"])
def test_rmsnorm(xp, rng, zcg):
    x = randn(xp, rng, 3, 12) + 0.3
    w = randn(xp, rng, 12)
    fd_check(lambda: tecupy.rmsnorm(x, w, 1e-5, zcg), {"x": x, "weight": w}, rng)


# ---- activations -------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(TABLE))
def test_activation(xp, rng, name):
    x = randn(xp, rng, 3, 5, 14, scale=1.5)
    # every point at least 0.05 away from 0 (relu's kink; nothing changes for smooth ones)
    x = xp.where(xp.abs(x) < 0.05, xp.sign(x) * 0.05 + x, x)
    y, _ = fd_check(lambda: tecupy.activation(x, name), {"x": x}, rng, n=32)
    assert y.shape == ((3, 5, 7) if TABLE[name].gated else (3, 5, 14))


# ---- softmax -----------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["plain", "mask", "causal", "mask_causal", "masked_row"])
def test_softmax(xp, rng, case):
    x = randn(xp, rng, 2, 3, 5, 6, scale=2.0)
    mask = None
    if case in ("mask", "mask_causal", "masked_row"):
        mask = rng.random((1, 3, 5, 6)) < 0.3  # broadcast over the batch axis
        if case == "masked_row":
            mask[0, 1, 2, :] = True            # one fully masked row -> zeros
        mask = xp.asarray(mask)
    causal = case in ("causal", "mask_causal")
    y, _ = fd_check(lambda: tecupy.softmax(x, 0.7, mask, causal), {"x": x}, rng, n=32)
    y = asnp(y)
    if case == "masked_row":
        assert np.all(y[:, 1, 2, :] == 0)
    if causal:
        assert np.all(np.triu(y, k=1) == 0)


# ---- dropout -----------------------------------------------------------------------------

@pytest.mark.parametrize("offset", [0, 5])
def test_dropout(xp, rng, offset):
    x = randn(xp, rng, 4, 5, 7)
    seed = int(rng.integers(0, 2**62))
    y, _ = fd_check(lambda: tecupy.dropout(x, 0.3, seed, True, offset), {"x": x}, rng, n=32)
    y, xs = asnp(y), asnp(x)
    kept = y != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(y[kept], xs[kept] / 0.7, rtol=1e-14)


# ---- add / reshape / split ---------------------------------------------------------------

@pytest.mark.parametrize("shapes", [((4, 5), (5,)), ((4, 5), (4, 1)), ((2, 4, 5), (2, 4, 5)),
                                    ((5,), (3, 4, 5)), ((3, 1, 5), (1, 4, 1))],
                         ids=lambda s: f"{s[0]}+{s[1]}")
def test_add(xp, rng, shapes):
    a, b = randn(xp, rng, *shapes[0]), randn(xp, rng, *shapes[1])
    y, _ = fd_check(lambda: tecupy.add(a, b), {"a": a, "b": b}, rng, n=24)
    assert y.shape == np.broadcast_shapes(*shapes)


@pytest.mark.parametrize("with_residual", [False, True], ids=["", "residual"])
def test_add_bias(xp, rng, with_residual):
    """x + bias row (+ residual): the tensor-parallel row GEMM's bias and residual."""
    x, b = randn(xp, rng, 2, 3, 5), randn(xp, rng, 5)
    inputs = {"x": x, "bias": b}
    if with_residual:
        inputs["residual"] = randn(xp, rng, 2, 3, 5)
    fd_check(lambda: tecupy.add_bias(x, b, inputs.get("residual")), inputs, rng, n=24)


@pytest.mark.parametrize("shape", [(12, 5), (3, 2, 2, 5), (-1,)])
def test_reshape(xp, rng, shape):
    x = randn(xp, rng, 3, 4, 5)
    # reshape then a non-linear op, so the reshape's gradient meets something shaped
    fd_check(lambda: tecupy.gelu(tecupy.reshape(x, shape)), {"x": x}, rng)


@pytest.mark.parametrize("axis,sizes", [(-1, [2, 5, 3]), (0, [1, 3]), (1, [3, 1, 1])])
def test_split(xp, rng, axis, sizes):
    x = randn(xp, rng, 4, 5, 10)
    outs = tecupy.split(x, sizes, axis)
    assert [o.shape[axis] for o in outs] == sizes
    fd_check(lambda: tecupy.split(x, sizes, axis), {"x": x}, rng, n=24)


def test_split_unused_piece_gets_zero_gradient(xp, rng):
    """Only some pieces reach the output: the tape fills zeros for the others."""
    x = randn(xp, rng, 3, 10)

    def f():
        a, _, c = tecupy.split(x, [2, 5, 3])
        return tecupy.gelu(a), c
    _, grads = fd_check(f, {"x": x}, rng, n=30)
    assert np.all(asnp(grads["x"])[:, 2:7] == 0)


def test_shared_input_accumulates(xp, rng):
    """x feeds two branches (residual): the tape must sum both contributions."""
    x, w = randn(xp, rng, 5, 7), randn(xp, rng, 7, 7, scale=0.5)
    g, b = randn(xp, rng, 7), randn(xp, rng, 7)
    fd_check(lambda: tecupy.add(tecupy.linear(tecupy.gelu(tecupy.layernorm(x, g, b)), w), x),
             {"x": x, "w": w, "g": g, "b": b}, rng)


# ---- dot_product_attention ---------------------------------------------------------------

# name: (fmt, b, sq, skv, h, hk, d, seqlens_q, seqlens_kv, dropout, scale); each case runs
# under every mask type in MASKS, the lengths only under the padding ones
ATTN_CASES = {
    "bshd": ("bshd", 3, 5, 5, 2, 2, 4, [5, 3, 1], None, 0.0, None),
    "sq_ne_skv_bshd": ("bshd", 2, 3, 7, 2, 2, 5, [3, 1], [4, 7], 0.0, None),
    "sq_ne_skv_mqa_sbhd": ("sbhd", 2, 6, 4, 3, 1, 3, [6, 2], [3, 4], 0.0, None),
    "gqa_sbhd": ("sbhd", 3, 5, 5, 4, 2, 3, [3, 5, 4], [2, 5, 4], 0.0, None),
    "mqa_scale_bshd": ("bshd", 2, 5, 5, 3, 1, 4, [5, 2], None, 0.0, 0.9),
    "empty_seq_bshd": ("bshd", 2, 5, 5, 2, 2, 3, [0, 4], [0, 2], 0.0, None),
    "dropout_gqa_bshd": ("bshd", 2, 5, 5, 4, 2, 3, [5, 3], None, 0.25, None),
    "dropout_mqa_sbhd": ("sbhd", 2, 5, 7, 3, 1, 3, [5, 2], [7, 3], 0.3, 0.5),
}


def _attn_case(case, mask):
    """(fmt, shape, seqlens_q, seqlens_kv as lists or None, dropout, scale) of a case under
    a mask type: lengths only for padding masks."""
    fmt, *shape, lq, lkv, p, scale = ATTN_CASES[case]
    if not MASKS[mask].padding:
        lq = lkv = None
    return fmt, shape, lq, lkv, p, scale


def _attn_inputs(xp, rng, fmt, b, sq, skv, h, hk, d):
    def make(s, heads):
        shape = (b, s, heads, d) if fmt == "bshd" else (s, b, heads, d)
        return randn(xp, rng, *shape)
    return make(sq, h), make(skv, hk), make(skv, hk)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("case", list(ATTN_CASES))
def test_dot_product_attention(xp, rng, case, mask):
    fmt, shape, lq, lkv, p, scale = _attn_case(case, mask)
    q, k, v = _attn_inputs(xp, rng, fmt, *shape)
    lq = None if lq is None else xp.asarray(np.array(lq, dtype=np.int32))
    lkv = None if lkv is None else xp.asarray(np.array(lkv, dtype=np.int64))
    seed = int(rng.integers(0, 2**62)) if p else None

    def f():
        return tecupy.dot_product_attention(q, k, v, mask, fmt, scale, p, lq, lkv, seed)
    o, grads = fd_check(f, {"q": q, "k": k, "v": v}, rng, n=32)
    assert o.shape == q.shape
    if MASKS[mask].padding:  # padded query rows give zero output and zero gradient
        ob = asnp(o) if fmt == "bshd" else asnp(o).transpose(1, 0, 2, 3)
        dq = asnp(grads["q"]) if fmt == "bshd" else asnp(grads["q"]).transpose(1, 0, 2, 3)
        for i, n in enumerate(asnp(lq)):
            assert np.all(ob[i, n:] == 0) and np.all(dq[i, n:] == 0)


def _attention_naive(q, k, v, mask, fmt, scale, lq, lkv):
    """Plain NumPy attention (no dropout), bshd maths; independent of tecupy's kernels.
    mask: a Mask (causal, padding)."""
    if fmt == "sbhd":
        q, k, v = (t.transpose(1, 0, 2, 3) for t in (q, k, v))
    b, sq, h, d = q.shape
    skv, hk = k.shape[1], k.shape[2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    lkv = lq if lkv is None else lkv
    out = np.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            s = scale * q[bi, :, hi] @ k[bi, :, hi // (h // hk)].T
            keep = np.ones((sq, skv), bool)
            if mask.causal:
                keep &= np.tril(np.ones((sq, skv), bool))
            if mask.padding:
                keep[lq[bi]:] = False
                keep[:, lkv[bi]:] = False
            for i in range(sq):
                if keep[i].any():
                    e = np.exp(s[i, keep[i]] - s[i, keep[i]].max())
                    out[bi, i, hi] = (e / e.sum()) @ v[bi, keep[i], hi // (h // hk)]
    return out if fmt == "bshd" else out.transpose(1, 0, 2, 3)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("case", [c for c in ATTN_CASES if not ATTN_CASES[c][9]])
def test_dot_product_attention_forward(xp, rng, case, mask):
    """The forward the gradients are checked against is itself right."""
    fmt, shape, lq, lkv, p, scale = _attn_case(case, mask)
    q, k, v = _attn_inputs(xp, rng, fmt, *shape)
    lqa = None if lq is None else xp.asarray(np.array(lq))
    lkva = None if lkv is None else xp.asarray(np.array(lkv))
    o = tecupy.dot_product_attention(q, k, v, mask, fmt, scale, 0.0, lqa, lkva)
    ref = _attention_naive(asnp(q), asnp(k), asnp(v), MASKS[mask], fmt, scale, lq, lkv)
    np.testing.assert_allclose(asnp(o), ref, rtol=1e-12, atol=1e-12)


# ---- fused blocks ------------------------------------------------------------------------

@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("bias,zcg", [(True, False), (False, True)],
                         ids=["bias", "nobias_zcg"])
def test_layernorm_linear(xp, rng, normalization, bias, zcg):
    x = randn(xp, rng, 2, 5, 7) + 0.2
    g = randn(xp, rng, 7)
    beta = randn(xp, rng, 7) if normalization == "LayerNorm" else None
    w, b = randn(xp, rng, 9, 7), (randn(xp, rng, 9) if bias else None)
    inputs = {"x": x, "ln_weight": g, "weight": w}
    inputs.update({k: a for k, a in (("ln_bias", beta), ("bias", b)) if a is not None})
    y, _ = fd_check(lambda: tecupy.layernorm_linear(x, g, beta, w, b, 1e-5, zcg,
                                                    normalization), inputs, rng)
    assert y.shape == (2, 5, 9)


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
@pytest.mark.parametrize("activation", list(TABLE))
def test_layernorm_mlp(xp, rng, activation, normalization):
    hidden, ffn = 7, 5
    fc1_out = 2 * ffn if TABLE[activation].gated else ffn
    x = randn(xp, rng, 3, 4, hidden)
    g = randn(xp, rng, hidden)
    beta = randn(xp, rng, hidden) if normalization == "LayerNorm" else None
    w1, b1 = randn(xp, rng, fc1_out, hidden), randn(xp, rng, fc1_out)
    w2, b2 = randn(xp, rng, hidden, ffn), randn(xp, rng, hidden)
    inputs = {"x": x, "ln_weight": g, "fc1_weight": w1, "fc1_bias": b1, "fc2_weight": w2,
              "fc2_bias": b2}
    if beta is not None:
        inputs["ln_bias"] = beta
    zcg = normalization == "RMSNorm"  # cover zero_centered_gamma too
    # relu's kink: a perturbation of 1e-6 crosses it only if an fc1 output lies within
    # ~1e-5 of 0, which has probability ~1e-5 per entry with these O(1) values.
    y, _ = fd_check(lambda: tecupy.layernorm_mlp(x, g, beta, w1, b1, w2, b2, 1e-5, zcg,
                                                 normalization, activation), inputs, rng)
    assert y.shape == (3, 4, hidden)


# ---- cross_entropy -----------------------------------------------------------------------

@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_cross_entropy(xp, rng, reduction, label_smoothing, ignore_index):
    vocab = 11
    logits = randn(xp, rng, 3, 5, vocab, scale=2.0)
    target = rng.integers(0, vocab, size=(3, 5))
    target[0, 1] = target[2, 4] = ignore_index
    if ignore_index == 3:
        target[1, 2] = 3
    target_x = xp.asarray(target)
    loss, grads = fd_check(lambda: tecupy.cross_entropy(logits, target_x, reduction,
                                                        ignore_index, label_smoothing),
                           {"logits": logits}, rng, n=32)
    ignored = target == ignore_index
    assert np.all(asnp(grads["logits"])[ignored] == 0)
    # forward against a direct formula
    lg = asnp(logits)
    lse = np.log(np.exp(lg).sum(-1))
    picked = np.take_along_axis(lg, np.where(ignored, 0, target)[..., None], -1)[..., 0]
    per = np.where(ignored, 0, lse - (1 - label_smoothing) * picked
                   - label_smoothing * lg.mean(-1))
    want = {"none": per, "sum": per.sum(), "mean": per.sum() / (~ignored).sum()}[reduction]
    np.testing.assert_allclose(asnp(loss), want, rtol=1e-12, atol=1e-12)

"""tecupy.nn modules in float64: output shapes, forward against the functional ops composed
with the module's own parameters, finite-difference checks of the gradients that
`tape.gradient(y, module, output_grad=R)` returns by parameter name (and of the input's),
and train()/eval() switching dropout."""
import numpy as np
import pytest

import tecupy
from tecupy import nn
from tecupy.activation_table import TABLE
from tecupy.ops.attention import MASKS

from conftest import asnp
from test_gradients import fd_check

S, B = 5, 2  # sequence length and batch


def device_of(xp):
    return "cpu" if xp is np else "cuda"


def make(cls, xp, rng, *args, **kwargs):
    """A float64 module on xp's device, parameters redrawn at random (biases and gains are
    zeros/ones at init, which would make their checks weak)."""
    m = cls(*args, params_dtype=np.float64, device=device_of(xp),
            seed=int(rng.integers(0, 2**62)), **kwargs)
    for name, p in m.named_parameters().items():
        assert p.dtype == np.float64 and isinstance(p, xp.ndarray), name
        p[...] = xp.asarray(rng.standard_normal(p.shape) * 0.5)
    return m


def randn(xp, rng, *shape):
    return xp.asarray(rng.standard_normal(shape))


def seq_shape(fmt, hidden):
    return (S, B, hidden) if fmt == "sbhd" else (B, S, hidden)


def close(a, b):
    np.testing.assert_allclose(asnp(a), asnp(b), rtol=1e-13, atol=1e-13)


def check_module(m, x, rng, *args, n=10, **kwargs):
    """FD-check the module's parameter gradients (by name) and the input's."""
    inputs = dict(m.named_parameters())
    inputs["x"] = x
    return fd_check(lambda: m(x, *args, **kwargs), inputs, rng, module=m, n=n)


# ---- Linear / LayerNorm / RMSNorm --------------------------------------------------------

@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear(xp, rng, bias):
    m = make(nn.Linear, xp, rng, 7, 9, bias=bias)
    assert set(m.named_parameters()) == ({"weight", "bias"} if bias else {"weight"})
    assert m.weight.shape == (9, 7)
    x = randn(xp, rng, B, S, 7)
    y, _ = check_module(m, x, rng)
    assert y.shape == (B, S, 9)
    close(y, tecupy.linear(x, m.weight, m.bias))
    ref = asnp(x) @ asnp(m.weight).T + (asnp(m.bias) if bias else 0)
    np.testing.assert_allclose(asnp(y), ref, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("zcg", [False, True], ids=["gamma", "zero_centered"])
@pytest.mark.parametrize("cls", ["LayerNorm", "RMSNorm"])
def test_norm(xp, rng, cls, zcg):
    m = nn.LayerNorm if cls == "LayerNorm" else nn.RMSNorm
    # the init is the identity gain: ones, or zeros with zero_centered_gamma
    fresh = m(12, zero_centered_gamma=zcg, params_dtype=np.float64, device=device_of(xp))
    assert np.all(asnp(fresh.weight) == (0.0 if zcg else 1.0))
    m = make(m, xp, rng, 12, eps=1e-5, zero_centered_gamma=zcg)
    x = randn(xp, rng, S, B, 12) + 0.3
    y, _ = check_module(m, x, rng)
    assert y.shape == x.shape
    if cls == "LayerNorm":
        assert set(m.named_parameters()) == {"weight", "bias"}
        close(y, tecupy.layernorm(x, m.weight, m.bias, 1e-5, zcg))
    else:
        assert set(m.named_parameters()) == {"weight"}
        close(y, tecupy.rmsnorm(x, m.weight, 1e-5, zcg))


# ---- LayerNormLinear / LayerNormMLP ------------------------------------------------------

@pytest.mark.parametrize("normalization,zcg,bias", [("LayerNorm", False, True),
                                                    ("RMSNorm", True, True),
                                                    ("LayerNorm", True, False)])
def test_layernorm_linear(xp, rng, normalization, zcg, bias):
    m = make(nn.LayerNormLinear, xp, rng, 7, 11, eps=1e-5, bias=bias,
             normalization=normalization, zero_centered_gamma=zcg)
    want = {"layer_norm_weight", "weight"} | ({"bias"} if bias else set())
    want |= {"layer_norm_bias"} if normalization == "LayerNorm" else set()
    assert set(m.named_parameters()) == want
    x = randn(xp, rng, S, B, 7)
    y, _ = check_module(m, x, rng)
    assert y.shape == (S, B, 11)
    close(y, tecupy.layernorm_linear(x, m.layer_norm_weight, m.layer_norm_bias, m.weight,
                                     m.bias, 1e-5, zcg, normalization))


def test_layernorm_linear_return_layernorm_output(xp, rng):
    m = make(nn.LayerNormLinear, xp, rng, 7, 11, return_layernorm_output=True)
    x = randn(xp, rng, B, S, 7)
    y, ln_out = m(x)
    assert y.shape == (B, S, 11) and ln_out.shape == x.shape
    close(ln_out, tecupy.layernorm(x, m.layer_norm_weight, m.layer_norm_bias))
    close(y, tecupy.linear(ln_out, m.weight, m.bias))


# every activation under both norms, with and without zero-centred gamma and biases
@pytest.mark.parametrize("normalization,zcg,bias", [("LayerNorm", False, True),
                                                    ("RMSNorm", True, False)])
@pytest.mark.parametrize("activation", list(TABLE))
def test_layernorm_mlp(xp, rng, activation, normalization, zcg, bias):
    hidden, ffn = 7, 5
    m = make(nn.LayerNormMLP, xp, rng, hidden, ffn, eps=1e-5, bias=bias,
             normalization=normalization, activation=activation, zero_centered_gamma=zcg)
    gated = TABLE[activation].gated
    assert m.fc1_weight.shape == ((2 if gated else 1) * ffn, hidden)
    assert m.fc2_weight.shape == (hidden, ffn)
    x = randn(xp, rng, S, B, hidden)
    y, _ = check_module(m, x, rng)
    assert y.shape == x.shape
    close(y, tecupy.layernorm_mlp(x, m.layer_norm_weight, m.layer_norm_bias, m.fc1_weight,
                                  m.fc1_bias, m.fc2_weight, m.fc2_bias, 1e-5, zcg,
                                  normalization, activation))


# ---- DotProductAttention -----------------------------------------------------------------

PADDING_MASKS = [name for name, mask in MASKS.items() if mask.padding]


def mask_lengths(xp, mask, seqlens):
    """seqlens as an int array [B] under a padding mask type, else None (no lengths)."""
    return xp.asarray(np.array(seqlens, dtype=np.int32)) if MASKS[mask].padding else None


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("fmt,heads,groups,seqlens", [
    ("sbhd", 3, None, [2, 5]),
    ("bshd", 4, 2, [5, 3]),
    ("sbhd", 4, 1, [4, 1]),
])
def test_dot_product_attention(xp, rng, fmt, heads, groups, seqlens, mask):
    d = 3
    m = nn.DotProductAttention(heads, d, num_gqa_groups=groups, attention_dropout=0.0,
                               qkv_format=fmt, attn_mask_type=mask, params_dtype=np.float64,
                               device=device_of(xp), seed=int(rng.integers(0, 2**62)))
    assert m.named_parameters() == {}
    assert m.attn_mask_type == mask and m.mask == MASKS[mask]
    hk = groups or heads

    def t(h):
        return randn(xp, rng, *((S, B, h, d) if fmt == "sbhd" else (B, S, h, d)))
    q, k, v = t(heads), t(hk), t(hk)
    lens = mask_lengths(xp, mask, seqlens)
    y, _ = fd_check(lambda: m(q, k, v, None, lens, lens), {"q": q, "k": k, "v": v}, rng,
                    module=m, n=24)
    assert y.shape == q.shape[:2] + (heads * d,)
    ref = tecupy.dot_product_attention(q, k, v, mask, fmt, None, 0.0, lens, lens)
    close(y, asnp(ref).reshape(y.shape))
    # the call-time mask type overrides the constructor's
    y2 = m(q, k, v, "no_mask")
    close(y2, asnp(tecupy.dot_product_attention(q, k, v, "no_mask", fmt)).reshape(y.shape))


# ---- MultiheadAttention ------------------------------------------------------------------

def mha_reference(cfg, m, x, mask, seqlens):
    """MultiheadAttention from the functional ops and the module's parameters, with the
    documented QKV layout [q heads | k heads | v heads] x kv_channels."""
    h, g, d = cfg["heads"], cfg["groups"] or cfg["heads"], cfg["kv_channels"]
    if cfg["input_layernorm"]:
        p = m.layernorm_qkv
        qkv = tecupy.layernorm_linear(x, p.layer_norm_weight, p.layer_norm_bias, p.weight,
                                      p.bias, cfg["eps"], cfg["zcg"], cfg["normalization"])
    else:
        qkv = tecupy.linear(x, m.qkv.weight, m.qkv.bias)
    qkv = qkv.reshape(qkv.shape[:2] + (h + 2 * g, d))
    q, k, v = qkv[:, :, :h], qkv[:, :, h:h + g], qkv[:, :, h + g:]
    ctx = tecupy.dot_product_attention(q, k, v, mask, cfg["fmt"], None, 0.0, seqlens, seqlens)
    ctx = ctx.reshape(ctx.shape[:2] + (h * d,))
    return tecupy.linear(ctx, m.proj.weight, m.proj.bias)


MHA_CASES = {  # each runs under every mask type; seqlens: the lengths padding masks take
    "plain_sbhd": dict(hidden=12, heads=4, groups=None, kv_channels=3, fmt="sbhd",
                       input_layernorm=False, normalization="LayerNorm", zcg=False, bias=True,
                       seqlens=[5, 2]),
    "ln_gqa_bshd": dict(hidden=12, heads=4, groups=2, kv_channels=3, fmt="bshd",
                        input_layernorm=True, normalization="LayerNorm", zcg=False, bias=True,
                        seqlens=[2, 5]),
    "rms_zcg_mqa_sbhd": dict(hidden=9, heads=3, groups=1, kv_channels=3, fmt="sbhd",
                             input_layernorm=True, normalization="RMSNorm", zcg=True,
                             bias=False, seqlens=[4, 5]),
    "kv_channels_bshd": dict(hidden=10, heads=2, groups=None, kv_channels=3, fmt="bshd",
                             input_layernorm=True, normalization="LayerNorm", zcg=True,
                             bias=True, seqlens=[3, 5]),
    "gqa_sbhd": dict(hidden=12, heads=4, groups=2, kv_channels=3, fmt="sbhd",
                     input_layernorm=False, normalization="LayerNorm", zcg=False, bias=True,
                     seqlens=[5, 2]),
}


def make_mha(xp, rng, cfg, mask, attention_dropout=0.0):
    cfg = dict(cfg, eps=1e-5)
    kv = None if cfg["heads"] * cfg["kv_channels"] == cfg["hidden"] else cfg["kv_channels"]
    m = make(nn.MultiheadAttention, xp, rng, cfg["hidden"], cfg["heads"], kv_channels=kv,
             attention_dropout=attention_dropout, layernorm_epsilon=cfg["eps"],
             attn_mask_type=mask, num_gqa_groups=cfg["groups"],
             input_layernorm=cfg["input_layernorm"], normalization=cfg["normalization"],
             bias=cfg["bias"], zero_centered_gamma=cfg["zcg"], qkv_format=cfg["fmt"])
    return m, cfg


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_multihead_attention(xp, rng, case, mask):
    m, cfg = make_mha(xp, rng, MHA_CASES[case], mask)
    h, g, d = cfg["heads"], cfg["groups"] or cfg["heads"], cfg["kv_channels"]
    qkv_w = m.layernorm_qkv.weight if cfg["input_layernorm"] else m.qkv.weight
    assert qkv_w.shape == ((h + 2 * g) * d, cfg["hidden"])
    assert m.proj.weight.shape == (cfg["hidden"], h * d)
    x = randn(xp, rng, *seq_shape(cfg["fmt"], cfg["hidden"]))
    lens = mask_lengths(xp, mask, cfg["seqlens"])
    y, grads = check_module(m, x, rng, None, lens)
    assert y.shape == x.shape
    close(y, mha_reference(cfg, m, x, mask, lens))
    assert set(grads) == set(m.named_parameters()) | {"x"}


# ---- TransformerLayer --------------------------------------------------------------------

TL_CASES = {  # each runs under every mask type (seqlens: the lengths padding masks take);
    # override: the layer keeps its default mask type and the call passes the case's
    "default_sbhd": dict(hidden=12, ffn=7, heads=4, groups=None, fmt="sbhd",
                         normalization="LayerNorm", activation="gelu", zcg=False, bias=True,
                         seqlens=[5, 3], override=False),
    "gqa_rms_swiglu_zcg_bshd": dict(hidden=12, ffn=5, heads=4, groups=2, fmt="bshd",
                                    normalization="RMSNorm", activation="swiglu", zcg=True,
                                    bias=True, seqlens=[2, 5], override=False),
    "geglu_mqa_sbhd": dict(hidden=9, ffn=7, heads=3, groups=1, fmt="sbhd",
                           normalization="LayerNorm", activation="geglu", zcg=True,
                           bias=False, seqlens=[5, 3], override=False),
    "override_relu_bshd": dict(hidden=12, ffn=7, heads=2, groups=None, fmt="bshd",
                               normalization="LayerNorm", activation="relu", zcg=False,
                               bias=True, seqlens=[2, 5], override=True),
}


def make_tl(xp, rng, cfg, mask, hidden_dropout=0.0, attention_dropout=0.0):
    """mask None: the constructor's default mask type."""
    kw = {} if mask is None else dict(self_attn_mask_type=mask)
    return make(nn.TransformerLayer, xp, rng, cfg["hidden"], cfg["ffn"], cfg["heads"],
                num_gqa_groups=cfg["groups"], layernorm_epsilon=1e-5,
                hidden_dropout=hidden_dropout, attention_dropout=attention_dropout,
                normalization=cfg["normalization"], activation=cfg["activation"],
                bias=cfg["bias"], zero_centered_gamma=cfg["zcg"], attn_input_format=cfg["fmt"],
                **kw)


def tl_reference(cfg, m, x, mask, seqlens):
    """pre-norm attention and MLP blocks with residuals, from the functional ops."""
    mcfg = dict(hidden=cfg["hidden"], heads=cfg["heads"], groups=cfg["groups"],
                kv_channels=cfg["hidden"] // cfg["heads"], fmt=cfg["fmt"],
                input_layernorm=True, normalization=cfg["normalization"], zcg=cfg["zcg"],
                eps=1e-5)
    h = tecupy.add(mha_reference(mcfg, m.self_attention, x, mask, seqlens), x)
    p = m.layernorm_mlp
    mlp = tecupy.layernorm_mlp(h, p.layer_norm_weight, p.layer_norm_bias, p.fc1_weight,
                               p.fc1_bias, p.fc2_weight, p.fc2_bias, 1e-5, cfg["zcg"],
                               cfg["normalization"], cfg["activation"])
    return tecupy.add(mlp, h)


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize("case", list(TL_CASES))
def test_transformer_layer(xp, rng, case, mask):
    cfg = TL_CASES[case]
    m = make_tl(xp, rng, cfg, None if cfg["override"] else mask)
    x = randn(xp, rng, *seq_shape(cfg["fmt"], cfg["hidden"]))
    lens = mask_lengths(xp, mask, cfg["seqlens"])
    y, grads = check_module(m, x, rng, mask if cfg["override"] else None, lens, n=6)
    assert y.shape == x.shape
    close(y, tl_reference(cfg, m, x, mask, lens))
    names = set(m.named_parameters())
    assert any(n.startswith("self_attention.layernorm_qkv.") for n in names)
    assert any(n.startswith("layernorm_mlp.") for n in names)


@pytest.mark.parametrize("mask", PADDING_MASKS)
def test_transformer_layer_padding_ignores_padded_tokens(xp, rng, mask):
    """With a padding mask, what sits in the padded positions of a sequence cannot change
    the valid positions' outputs."""
    cfg = TL_CASES["geglu_mqa_sbhd"]
    m = make_tl(xp, rng, cfg, mask)
    x = randn(xp, rng, *seq_shape(cfg["fmt"], cfg["hidden"]))
    lens = mask_lengths(xp, mask, cfg["seqlens"])
    y1 = asnp(m(x, None, lens))
    x2 = x.copy()
    x2[3:, 1] = xp.asarray(rng.standard_normal(x2[3:, 1].shape))  # batch 1 has length 3
    y2 = asnp(m(x2, None, lens))
    np.testing.assert_allclose(y2[:3], y1[:3], rtol=1e-13, atol=1e-13)
    assert not np.allclose(y2[3:, 1], y1[3:, 1])


# ---- train() / eval() --------------------------------------------------------------------

def _dropout_modules(xp, rng):
    d = nn.DotProductAttention(3, 4, attention_dropout=0.4, qkv_format="bshd",
                               params_dtype=np.float64, device=device_of(xp),
                               seed=int(rng.integers(0, 2**62)))
    q = randn(xp, rng, B, S, 3, 4)
    mcfg = MHA_CASES["ln_gqa_bshd"]
    mha, _ = make_mha(xp, rng, mcfg, "causal", attention_dropout=0.4)
    tcfg = TL_CASES["gqa_rms_swiglu_zcg_bshd"]
    tl = make_tl(xp, rng, tcfg, None, hidden_dropout=0.3, attention_dropout=0.3)
    tl_hidden_only = make_tl(xp, rng, tcfg, None, hidden_dropout=0.3, attention_dropout=0.0)
    xm = randn(xp, rng, B, S, mcfg["hidden"])
    xt = randn(xp, rng, B, S, tcfg["hidden"])
    return {
        "DotProductAttention": (d, lambda: d(q, q, q),
                                lambda: tecupy.dot_product_attention(q, q, q, "causal", "bshd")
                                .reshape(B, S, 12)),
        "MultiheadAttention": (mha, lambda: mha(xm),
                               lambda: mha_reference(dict(mcfg, eps=1e-5), mha, xm,
                                                     "causal", None)),
        "TransformerLayer": (tl, lambda: tl(xt), lambda: tl_reference(tcfg, tl, xt, "causal",
                                                                       None)),
        "TransformerLayer_hidden_dropout": (
            tl_hidden_only, lambda: tl_hidden_only(xt),
            lambda: tl_reference(tcfg, tl_hidden_only, xt, "causal", None)),
    }


@pytest.mark.parametrize("name", ["DotProductAttention", "MultiheadAttention",
                                  "TransformerLayer", "TransformerLayer_hidden_dropout"])
def test_train_eval_switches_dropout(xp, rng, name):
    m, call, reference = _dropout_modules(xp, rng)[name]
    assert m.training
    a, b = asnp(call()), asnp(call())
    assert a.shape == b.shape and not np.allclose(a, b), "train mode: dropout should differ"
    assert m.eval() is m
    children = [c for c in vars(m).values() if isinstance(c, nn.Module)]
    assert not m.training and all(not c.training for c in children)
    a, b = asnp(call()), asnp(call())
    np.testing.assert_array_equal(a, b)
    close(a, reference())  # eval: no dropout anywhere
    m.train()
    assert m.training and all(c.training for c in children)
    assert not np.allclose(asnp(call()), a)


def test_seed_reproducible(xp, rng):
    seed = int(rng.integers(0, 2**62))
    kw = dict(params_dtype=np.float64, device=device_of(xp))
    a = nn.TransformerLayer(12, 7, 4, seed=seed, **kw)
    b = nn.TransformerLayer(12, 7, 4, seed=seed, **kw)
    c = nn.TransformerLayer(12, 7, 4, seed=seed + 1, **kw)
    pa, pb, pc = a.named_parameters(), b.named_parameters(), c.named_parameters()
    assert set(pa) == set(pb) == set(pc)
    for k in pa:
        np.testing.assert_array_equal(asnp(pa[k]), asnp(pb[k]))
    assert not np.array_equal(asnp(pa["layernorm_mlp.fc1_weight"]),
                              asnp(pc["layernorm_mlp.fc1_weight"]))
    x = randn(xp, rng, S, B, 12)
    np.testing.assert_array_equal(asnp(a(x)), asnp(b(x)))  # same dropout seeds too


def test_constructors_take_numpy_scalars_and_edge_values(rng):
    """The option checks (tests/test_bad_inputs.py has the refusals) accept NumPy ints and
    floats and the edges of each range, and store the checked values."""
    kw = dict(params_dtype=np.float64, device="cpu")
    layer = nn.TransformerLayer(np.int64(12), np.int32(7), np.int64(4), num_gqa_groups=2,
                                layernorm_epsilon=np.float32(1e-6), hidden_dropout=1.0,
                                attention_dropout=0.0, kv_channels=np.int64(5),
                                seed=2**64 - 1, **kw)
    assert layer.hidden_dropout == 1.0
    core = layer.self_attention.core_attention
    assert (core.num_attention_heads, core.kv_channels, core.num_gqa_groups) == (4, 5, 2)
    assert nn.LayerNorm(np.int16(3), eps=np.float64(1e-3), **kw).eps == 1e-3
    dpa = nn.DotProductAttention(4, 8, num_gqa_groups=np.int64(1), softmax_scale=-0.5,
                                 attention_dropout=np.float32(0.25), **kw)
    assert dpa.num_gqa_groups == 1 and dpa.attention_dropout == 0.25
    x = randn(np, rng, S, B, 12)
    assert layer.eval()(x).shape == x.shape


@pytest.mark.parametrize("mask", PADDING_MASKS)
def test_padding_masks_take_seqlens_through_the_modules(rng, mask):
    m = nn.TransformerLayer(8, 16, 2, self_attn_mask_type=mask,
                            params_dtype=np.float64, device="cpu", seed=1).eval()
    x = randn(np, rng, S, B, 8)
    y = m(x, seqlens=np.array([S, 2]))
    assert y.shape == x.shape and np.all(np.isfinite(y))

"""Rotary position embedding: RotaryPositionEmbedding's freqs, apply_rotary_pos_emb (and the
packed-qkv form MultiheadAttention uses) against float64 maths written here, gradients
against finite differences, the rotary_pos_emb argument of the attention modules, errors
naming the argument. GPU (marked): the kernels against float64 on odd sizes, strided inputs
and poisoned outputs."""
import numpy as np
import pytest

import tecupy
from tecupy import Tape, backends
from tecupy._array import bfloat16
from tecupy.nn import MultiheadAttention, RotaryPositionEmbedding, TransformerLayer
from tecupy.ops import apply_rotary_pos_emb_qkv

from conftest import asnp, assert_within_2x_reference, poison_gpu_pool
from test_gradients import fd_check


def _freqs64(s, d2, base=10000.0, offset=0, factor=1.0):
    """TE's angles in float64: position p, column j -> p * base ** (-2 (j mod d2/2) / d2)."""
    inv = base ** (-np.arange(0, d2, 2) / d2)
    f = np.outer((np.arange(s) + offset) / factor, inv)
    return np.concatenate([f, f], -1).reshape(s, 1, 1, d2)


def _rope64(t, freqs, fmt="sbhd"):
    """TE's formula column by column, in float64: with angles a = freqs[p, j] and h = d2/2,
    y[j] = t[j] cos a - t[j + h] sin a (j < h), t[j] cos a + t[j - h] sin a (h <= j < d2),
    t[j] beyond d2. (For cat(f, f) angles: each pair (t[j], t[j + h]) turned by f[j].)"""
    t = t.astype(np.float64)
    s, d2 = t.shape[0 if fmt == "sbhd" else 1], freqs.shape[-1]
    a = freqs[:s, 0, 0, :].astype(np.float64)
    a = a[:, None, None, :] if fmt == "sbhd" else a[None, :, None, :]
    h, r = d2 // 2, t[..., :d2]
    partner = np.concatenate([-r[..., h:], r[..., :h]], -1)
    return np.concatenate([r * np.cos(a) + partner * np.sin(a), t[..., d2:]], -1)


def _turn64(t, freqs):
    """The same for cat(f, f) angles, as complex products (t[j] + i t[j + h]) e^(i f[j])."""
    d2 = freqs.shape[-1]
    z = (t[..., : d2 // 2] + 1j * t[..., d2 // 2: d2]) * np.exp(1j * freqs[:, :, :, : d2 // 2])
    return np.concatenate([z.real, z.imag, t[..., d2:]], -1)


def _rand(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


# ---- RotaryPositionEmbedding -------------------------------------------------------------

@pytest.mark.parametrize("dim,pct", [(16, 1.0), (64, 0.5), (10, 0.8)])
def test_freqs(dim, pct):
    r = RotaryPositionEmbedding(dim, rotary_percent=pct, rotary_base=500.0, device="cpu")
    d2 = int(dim * pct)
    f = r(37)
    assert f.shape == (37, 1, 1, d2) and f.dtype == np.float32
    np.testing.assert_allclose(f, _freqs64(37, d2, 500.0), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(r(9, offset=5), _freqs64(9, d2, 500.0, offset=5), rtol=2e-6)


def test_freqs_interpolation():
    r = RotaryPositionEmbedding(8, seq_len_interpolation_factor=4, device="cpu")
    np.testing.assert_allclose(r(20), _freqs64(20, 8, factor=4), rtol=2e-6)
    r = RotaryPositionEmbedding(8, seq_len_interpolation_factor=2,
                                pretrained_max_position_embeddings=5, device="cpu")
    np.testing.assert_allclose(r(10), _freqs64(10, 8, factor=2), rtol=2e-6)  # 10 <= 5 x 2
    np.testing.assert_allclose(r(20), _freqs64(20, 8, factor=4), rtol=2e-6)  # dynamic: 20/5


def test_freqs_bad_arguments():
    for kwargs, name in (({"dim": 0}, "dim"), ({"dim": 8, "rotary_percent": 0.0},
                                               "rotary_percent"),
                         ({"dim": 8, "rotary_percent": 0.1}, "rotary_percent"),
                         ({"dim": 8, "rotary_base": -1.0}, "rotary_base"),
                         ({"dim": 8, "device": "tpu"}, "device")):
        with pytest.raises(ValueError, match=f"RotaryPositionEmbedding: {name} must be"):
            RotaryPositionEmbedding(**kwargs)
    with pytest.raises(ValueError, match="RotaryPositionEmbedding: max_seq_len must be"):
        RotaryPositionEmbedding(8, device="cpu")(0)


# ---- apply_rotary_pos_emb: reference against float64 maths -------------------------------

@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("d,d2", [(8, 8), (12, 6), (10, 2)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32, bfloat16], ids=str)
def test_apply_matches_float64(rng, fmt, d, d2, dtype):
    s, b, h = 7, 3, 2
    t = _rand(rng, *((s, b) if fmt == "sbhd" else (b, s)), h, d, dtype=dtype)
    freqs = _freqs64(s + 4, d2)  # longer than the sequence: its first rows are used
    y = tecupy.apply_rotary_pos_emb(t, freqs.astype(np.float32), fmt)
    assert y.shape == t.shape and y.dtype == t.dtype
    want = _rope64(t, freqs.astype(np.float32).astype(np.float64), fmt)
    tol = {np.dtype(np.float64): 1e-6, np.dtype(np.float32): 1e-5}.get(np.dtype(dtype), 3e-2)
    np.testing.assert_allclose(y.astype(np.float64), want, rtol=tol, atol=tol)
    assert y[..., d2:].tobytes() == t[..., d2:].tobytes()  # partial rotary: untouched
    if fmt == "sbhd":
        np.testing.assert_allclose(want, _turn64(t.astype(np.float64), freqs[:s].astype(
            np.float32).astype(np.float64)), rtol=1e-12, atol=1e-12)


def test_rotation_keeps_relative_positions(rng):
    """<rope(q, m), rope(k, n)> depends on m - n only (the point of RoPE), and rope keeps
    every pair's norm."""
    d = 16
    freqs = _freqs64(40, d)
    q, k = _rand(rng, 1, 1, 1, d), _rand(rng, 1, 1, 1, d)
    qs, ks = np.repeat(q, 40, 0), np.repeat(k, 40, 0)
    rq, rk = tecupy.apply_rotary_pos_emb(qs, freqs), tecupy.apply_rotary_pos_emb(ks, freqs)
    dots = [float((rq[m] * rk[m - 5]).sum()) for m in range(5, 40)]
    np.testing.assert_allclose(dots, dots[0], rtol=1e-10)
    pair = rq[..., :8] ** 2 + rq[..., 8:] ** 2
    np.testing.assert_allclose(pair, np.broadcast_to(q[..., :8] ** 2 + q[..., 8:] ** 2,
                                                     pair.shape), rtol=1e-12)


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_gradient_finite_differences(xp, rng, fmt):
    t = xp.asarray(_rand(rng, 5, 3, 2, 10))
    freqs = xp.asarray(_rand(rng, 6, 1, 1, 6))  # any angles: the backward is the transpose
    fd_check(lambda: tecupy.apply_rotary_pos_emb(t, freqs, fmt), {"t": t}, rng, n=60)


def test_qkv_form_rotates_q_and_k_and_copies_v(rng):
    s, b, hq, hk, d = 6, 2, 4, 2, 8
    qkv = _rand(rng, s, b, hq + 2 * hk, d)
    fq, fk = _rand(rng, s, 1, 1, 6), _rand(rng, s, 1, 1, 6)
    y = apply_rotary_pos_emb_qkv(qkv, (fq, fk), hq, hk)
    np.testing.assert_allclose(y[:, :, :hq], _rope64(qkv[:, :, :hq], fq), rtol=1e-12,
                               atol=1e-12)
    np.testing.assert_allclose(y[:, :, hq:hq + hk], _rope64(qkv[:, :, hq:hq + hk], fk),
                               rtol=1e-12, atol=1e-12)
    assert y[:, :, hq + hk:].tobytes() == qkv[:, :, hq + hk:].tobytes()


def test_qkv_form_gradient(xp, rng):
    qkv = xp.asarray(_rand(rng, 4, 2, 5, 6))  # 1 + 2 x 2 heads
    fq, fk = xp.asarray(_rand(rng, 4, 1, 1, 4)), xp.asarray(_rand(rng, 4, 1, 1, 4))
    fd_check(lambda: apply_rotary_pos_emb_qkv(qkv, (fq, fk), 1, 2, "bshd"), {"qkv": qkv},
             rng, n=60)


# ---- errors ------------------------------------------------------------------------------

def test_bad_arguments_are_named(rng):
    t, f = _rand(rng, 5, 2, 3, 8), _freqs64(5, 8)
    apply = tecupy.apply_rotary_pos_emb
    cases = [((t, f, "thd"), ValueError, "tensor_format must be one of"),
             ((t[0], f), ValueError, "t must be a 4-D array"),
             ((t.astype(np.int32), f), TypeError, "t has dtype int32"),
             ((t, f[:4]), ValueError, r"freqs must be an array \[s2 >= 5"),
             ((t, _freqs64(5, 10)), ValueError, "d2 even, 2 <= d2 <= 8"),
             ((t, f[..., :3]), ValueError, "d2 even"),
             ((t, f[:, 0]), ValueError, r"freqs must be an array \[s2, 1, 1, d2\]"),
             ((t, [1.0]), TypeError, "freqs must be")]
    for args, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            apply(*args)
    with pytest.raises(ValueError, match="apply_rotary_pos_emb_qkv: q_pos_emb and k_pos_emb"):
        apply_rotary_pos_emb_qkv(_rand(rng, 5, 2, 5, 8), (f, _freqs64(5, 6)), 1, 2)
    with pytest.raises(TypeError, match="rotary_pos_emb must be an array or a pair"):
        apply_rotary_pos_emb_qkv(_rand(rng, 5, 2, 5, 8), (f, f, f), 1, 2)
    with pytest.raises(ValueError, match=r"qkv must be an array with 3 \+ 2 x 1 heads"):
        apply_rotary_pos_emb_qkv(_rand(rng, 5, 2, 4, 8), f, 3, 1)


# ---- the attention modules' rotary_pos_emb -----------------------------------------------

def _mha_by_hand(m, x, freqs, fmt):
    """The projection, q and k rotated by apply_rotary_pos_emb, attention, the output
    projection: what rotary_pos_emb must do inside MultiheadAttention."""
    qkv = m.qkv(x)
    qkv = qkv.reshape(qkv.shape[:2] + (m.heads + 2 * m.groups, m.kv_channels))
    q, k, v = np.split(qkv, [m.heads, m.heads + m.groups], axis=2)
    q, k = (tecupy.apply_rotary_pos_emb(a, freqs, fmt) for a in (q, k))
    o = tecupy.dot_product_attention(q, k, v, "causal", fmt)
    return m.proj(o.reshape(o.shape[:2] + (-1,)))


@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
def test_multihead_attention_applies_rope_to_q_and_k(rng, fmt):
    m = MultiheadAttention(24, 4, attention_dropout=0.0, num_gqa_groups=2, qkv_format=fmt,
                           params_dtype=np.float64, device="cpu", seed=1)
    x = _rand(rng, 7, 2, 24)
    freqs = RotaryPositionEmbedding(6, rotary_percent=2 / 3, device="cpu")(9)
    y = m(x, rotary_pos_emb=freqs)
    np.testing.assert_allclose(y, _mha_by_hand(m, x, freqs, fmt), rtol=1e-12, atol=1e-12)
    assert not np.allclose(y, m(x))  # (the test above is not vacuous)
    np.testing.assert_allclose(m(x, rotary_pos_emb=np.zeros((7, 1, 1, 6))), m(x),
                               rtol=1e-14, atol=1e-14)  # angle 0: no rotation


def test_transformer_layer_with_rope_gradients(xp, rng):
    layer = TransformerLayer(16, 24, 2, hidden_dropout=0.0, attention_dropout=0.0,
                             params_dtype=np.float64, device="cpu" if xp is np else "cuda",
                             seed=4)
    x = xp.asarray(_rand(rng, 5, 2, 16))
    freqs = RotaryPositionEmbedding(8, device="cpu" if xp is np else "cuda")(5)
    inputs = dict(layer.named_parameters())
    inputs["x"] = x
    fd_check(lambda: layer(x, rotary_pos_emb=freqs), inputs, rng, module=layer, n=6)


# ---- GPU: kernels against float64, strided inputs, poisoned outputs ----------------------

def _strict_gpu(op, *args):
    import os
    import cupy
    assert backends.chosen(op, *args) == "cuda"
    poison_gpu_pool()
    os.environ["TECUPY_STRICT"] = "1"
    try:
        return backends.dispatch(op, *args)
    finally:
        os.environ.pop("TECUPY_STRICT")
        cupy.cuda.Device().synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["sbhd", "bshd"])
@pytest.mark.parametrize("dtype", [np.float32, bfloat16, np.float16], ids=str)
@pytest.mark.parametrize("partial", [False, True])
def test_kernels_against_float64(rng, fmt, dtype, partial):
    """Forward and backward on a packed qkv's slices (strided, as attention leaves them):
    within 2x the error of the same-precision reference; v copied bit for bit."""
    import cupy
    s, b, hq, hk = (int(rng.integers(lo, hi)) for lo, hi in ((33, 200), (1, 5), (1, 9),
                                                              (1, 4)))
    hk = hk if hq % hk == 0 else 1
    d = int(rng.choice([32, 64, 80, 128]))
    d2 = int(rng.choice([2, d // 4 * 2 - 2])) if partial else d
    lead = (s, b) if fmt == "sbhd" else (b, s)
    qkv = _rand(rng, *lead, hq + 2 * hk, d, dtype=dtype)
    freqs = (_freqs64(s + 3, d2) + rng.uniform(0, 1, (s + 3, 1, 1, d2))).astype(np.float32)
    g_qkv, g_freqs = cupy.asarray(qkv), cupy.asarray(freqs)
    for op, transpose in (("rope_fwd", False), ("rope_bwd", True)):
        args = (freqs, None, hq, hk, fmt)
        got = _strict_gpu(op, g_qkv, g_freqs, None, hq, hk, fmt)
        want = backends.dispatch(op, qkv.astype(np.float64), freqs.astype(np.float64),
                                 *args[1:])
        ref_lp = backends.dispatch(op, qkv, *args)
        assert_within_2x_reference(got, want, ref_lp, f"{op} {fmt}", atol=1e-6)
        assert asnp(got)[:, :, hq + hk:].tobytes() == qkv[:, :, hq + hk:].tobytes()
        if not transpose:  # also a strided q slice on its own
            q = g_qkv[:, :, :hq]
            got_q = _strict_gpu(op, q, g_freqs, None, hq, 0, fmt)
            assert asnp(got_q).tobytes() == asnp(got)[:, :, :hq].tobytes()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.float32, bfloat16], ids=str)
def test_layer_with_rope_on_gpu_matches_cpu(rng, dtype):
    import cupy
    x_host, outs = _rand(rng, 37, 3, 128, dtype=dtype), []
    for device in ("cpu", "cuda"):
        layer = TransformerLayer(128, 256, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                 params_dtype=dtype, device=device, seed=4)
        xp = layer.xp
        x = xp.asarray(x_host)
        freqs = RotaryPositionEmbedding(64, device=device)(37)
        with Tape() as tape:
            y = layer(x, rotary_pos_emb=freqs)
        dx = tape.gradient(y, x, output_grad=xp.ones(y.shape, y.dtype))
        outs.append((asnp(y).astype(np.float64), asnp(dx).astype(np.float64)))
    cupy.cuda.Device().synchronize()
    tol = 2e-3 if dtype == np.float32 else 5e-2
    for a, b in zip(*outs):
        np.testing.assert_allclose(b, a, rtol=tol, atol=tol * np.abs(a).max())

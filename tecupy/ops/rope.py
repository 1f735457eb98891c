"""Rotary position embedding (RoPE) as Transformer Engine applies it (maths in
reference/rope.py): apply_rotary_pos_emb on one tensor, and the fused form that
MultiheadAttention uses on its packed QKV projection (q and k rotated, v copied, in one
kernel whose output stays packed, so attention's backward writes dq, dk, dv into one
buffer and the split before it needs no concatenation).

Non-interleaved (rotate_half) layout only; freqs [s2, 1, 1, d2] as RotaryPositionEmbedding
gives (float32; other float dtypes are converted), s2 >= the sequence length (its first
rows are used), d2 even and <= the head dim (the columns past d2 are left as they are).
"""
from .. import _check, backends
from .._array import array_module, check_float
from ..tape import record

TENSOR_FORMATS = ("sbhd", "bshd")


def _check_freqs(op, name, freqs, s, d):
    if getattr(freqs, "ndim", None) != 4 or freqs.shape[1:3] != (1, 1):
        _check.fail(op, name, "an array [s2, 1, 1, d2] (RotaryPositionEmbedding's output)",
                    freqs, TypeError if getattr(freqs, "ndim", None) is None else ValueError)
    check_float(op, **{name: freqs})
    s2, d2 = freqs.shape[0], freqs.shape[3]
    if s2 < s or d2 < 2 or d2 % 2 or d2 > d:
        _check.fail(op, name, f"an array [s2 >= {s}, 1, 1, d2] with d2 even, 2 <= d2 <= {d} "
                    "(the sequence length and head dim of the input)", freqs)


def _check_t(op, name, t, tensor_format):
    _check.choice(op, "tensor_format", tensor_format, TENSOR_FORMATS)
    check_float(op, **{name: t})
    if t.ndim != 4:
        _check.fail(op, name, f"a 4-D array ({tensor_format})", t)
    return t.shape[0 if tensor_format == "sbhd" else 1], t.shape[3]


def _rope(t, freqs_q, freqs_k, nq, nk, tensor_format):
    """The recorded op behind both public forms: heads [0, nq) rotate with freqs_q, the
    next nk with freqs_k, the rest pass through."""
    args = (freqs_q, freqs_k, nq, nk, tensor_format)
    y = backends.dispatch("rope_fwd", t, *args)
    record(lambda dy: (backends.dispatch("rope_bwd", dy, *args),), (t,), (y,))
    return y


def apply_rotary_pos_emb(t, freqs, tensor_format="sbhd"):
    """Rotate every head of t [s, b, h, d] (sbhd) or [b, s, h, d] (bshd) by the angles of
    its position: y = t cos(freqs) + rotate_half(t) sin(freqs) on the first d2 columns.
    Differentiable in t (freqs are constants)."""
    op = "apply_rotary_pos_emb"
    array_module(op, t=t, freqs=freqs)
    s, d = _check_t(op, "t", t, tensor_format)
    _check_freqs(op, "freqs", freqs, s, d)
    return _rope(t, freqs, None, t.shape[2], 0, tensor_format)


def _pair(op, rotary_pos_emb):
    """(q freqs, k freqs or None) of one array or a pair of them."""
    if not isinstance(rotary_pos_emb, (tuple, list)):
        return rotary_pos_emb, None
    if len(rotary_pos_emb) != 2:
        _check.fail(op, "rotary_pos_emb", "an array or a pair (q_pos_emb, k_pos_emb)",
                    rotary_pos_emb, TypeError)
    return tuple(rotary_pos_emb)


def apply_rotary_pos_emb_qkv(qkv, rotary_pos_emb, num_heads, num_kv_heads,
                             tensor_format="sbhd"):
    """The packed projection qkv [s, b, hq + 2 hk, d] (or bshd) with q's hq heads and k's
    hk heads rotated and v's copied. rotary_pos_emb: one freqs array for q and k, or a
    pair (q_pos_emb, k_pos_emb) of one rotary dim, as Transformer Engine takes."""
    op = "apply_rotary_pos_emb_qkv"
    fq, fk = _pair(op, rotary_pos_emb)
    array_module(op, qkv=qkv, q_pos_emb=fq, k_pos_emb=fk)
    s, d = _check_t(op, "qkv", qkv, tensor_format)
    if qkv.shape[2] != num_heads + 2 * num_kv_heads:
        _check.fail(op, "qkv", f"an array with {num_heads} + 2 x {num_kv_heads} heads", qkv)
    _check_freqs(op, "rotary_pos_emb", fq, s, d)
    if fk is not None:
        _check_freqs(op, "rotary_pos_emb", fk, s, d)
        if fk.shape[3] != fq.shape[3]:
            raise ValueError(f"{op}: q_pos_emb and k_pos_emb must have one rotary dim, got "
                             f"{fq.shape[3]} and {fk.shape[3]}")
    return _rope(qkv, fq, fk, num_heads, num_kv_heads, tensor_format)

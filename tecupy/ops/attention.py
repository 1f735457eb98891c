"""dot_product_attention: softmax(scale * Q K^T, masked) V, forward and backward.

Layouts (qkv_format): "bshd" = [batch, seq, heads, dim], "sbhd" = [seq, batch, heads, dim].
The kernels work in bshd; sbhd inputs are viewed as bshd and the output comes back sbhd.
Maths: reference/attention.py. Mask types are read here only (parse_mask): the kernels,
the reference and the modules below the public call take a Mask, never the name.
"""
from dataclasses import dataclass

import numpy as np

from .. import _check, backends
from .._array import array_module, check_float
from ..graphs import fresh_seed
from ..tape import record

QKV_FORMATS = ("bshd", "sbhd")


@dataclass(frozen=True)
class Mask:
    """What a mask type means to the kernels and the reference: causal keeps key j <= query
    i (top-left aligned); padding keeps i < seqlens_q[b] and j < seqlens_kv[b]."""
    causal: bool
    padding: bool

    def __post_init__(self):  # plain bools: the kernels' template arguments come from them
        for name in ("causal", "padding"):
            object.__setattr__(self, name, _check.flag("Mask", name, getattr(self, name)))

    @property
    def name(self):
        """The mask type's name, for messages (every Mask has one in MASKS)."""
        return next(n for n, m in MASKS.items() if m == self)


# Transformer Engine's attn_mask_type names. Not taken (TE has them): causal_bottom_right
# and padding_causal_bottom_right (the diagonal ends at the last key, j <= i + skv - sq,
# per sequence with padding: one more field, a diagonal offset in the kernels' causal
# test), and arbitrary (a user's boolean array: another kernel argument).
MASKS = {
    "no_mask": Mask(causal=False, padding=False),
    "causal": Mask(causal=True, padding=False),
    "padding": Mask(causal=False, padding=True),
    "padding_causal": Mask(causal=True, padding=True),
}


def parse_mask(op, name, value):
    """The one place a mask type's name is read: value (a name in MASKS, or a Mask, which
    passes through: modules hand theirs down parsed) -> its Mask."""
    if isinstance(value, Mask):
        return value
    return MASKS[_check.choice(op, name, value, MASKS)]


def _to_bshd(t, fmt):
    return t if fmt == "bshd" else t.transpose(1, 0, 2, 3)


def _check_args(q, k, v, mask_type, fmt, seqlens_q, seqlens_kv):
    """-> (Mask, seqlens_q, seqlens_kv); the lengths are None without a padding mask."""
    op = "dot_product_attention"
    xp = array_module(op, q=q, k=k, v=v, seqlens_q=seqlens_q, seqlens_kv=seqlens_kv)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            _check.fail(op, name, "an array", None, TypeError)
    check_float(op, q=q, k=k, v=v)
    mask = parse_mask(op, "attn_mask_type", mask_type)
    _check.choice(op, "qkv_format", fmt, QKV_FORMATS)
    if q.ndim != 4 or k.ndim != 4 or v.shape != k.shape:
        raise ValueError(f"{op}: q, k, v must be 4-D ({fmt}) with k and v of one shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    qb, kb = _to_bshd(q, fmt).shape, _to_bshd(k, fmt).shape
    if qb[0] != kb[0] or qb[3] != kb[3] or kb[2] == 0 or qb[2] % kb[2]:
        raise ValueError(f"{op}: q {qb} and k {kb} (as bshd) need the same batch and head dim, "
                         "and q's heads a multiple of k's heads (GQA/MQA)")
    if not mask.padding:
        return mask, None, None
    return (mask,) + _check_seqlens(xp, qb, kb, seqlens_q, seqlens_kv, mask)


def _check_seqlens(xp, qb, kb, seqlens_q, seqlens_kv, mask):
    op = "dot_product_attention"
    if seqlens_q is None:
        _check.fail(op, "seqlens_q", f"an int array [batch] with {mask.name!r}", None)
    seqlens_kv = seqlens_q if seqlens_kv is None else seqlens_kv
    out = []
    for name, lens, s in (("seqlens_q", seqlens_q, qb[1]), ("seqlens_kv", seqlens_kv, kb[1])):
        if lens.shape != (qb[0],) or lens.dtype.kind not in "iu":
            raise ValueError(f"{op}: {name} must be an int array of shape ({qb[0]},), got "
                             f"{lens.dtype} {tuple(lens.shape)}")
        if xp is np and (lens.min() < 0 or lens.max() > s):  # no host sync on the GPU
            raise ValueError(f"{op}: {name} must lie in [0, {s}], got {lens.tolist()}")
        out.append(lens)
    return tuple(out)


def dot_product_attention(q, k, v, attn_mask_type="causal", qkv_format="bshd",
                          softmax_scale=None, attention_dropout=0.0, seqlens_q=None,
                          seqlens_kv=None, dropout_seed=None):
    """Attention over q [b, sq, h, d], k and v [b, skv, hk, d] (or sbhd); returns o shaped
    as q. attn_mask_type: a name in MASKS (no_mask, causal (top-left), padding,
    padding_causal) or a Mask; padding takes per-sequence lengths seqlens_q / seqlens_kv
    (int arrays [b]; kv defaults to q).
    softmax_scale defaults to 1/sqrt(d). attention_dropout (in [0, 1)) uses Philox with
    dropout_seed (an int in [0, 2**64); drawn at random when None)."""
    op = "dot_product_attention"
    p = _check.real(op, "attention_dropout", attention_dropout, 0, 1, high_open=True)
    dropout_seed = _check.seed(op, "dropout_seed", dropout_seed)
    mask, lq, lkv = _check_args(q, k, v, attn_mask_type, qkv_format, seqlens_q, seqlens_kv)
    scale = (1 / np.sqrt(q.shape[-1]) if softmax_scale is None
             else _check.real(op, "softmax_scale", softmax_scale))
    if p > 0 and dropout_seed is None:
        dropout_seed = fresh_seed()
    qb, kb, vb = (_to_bshd(t, qkv_format) for t in (q, k, v))
    args = (scale, mask, lq, lkv, p, dropout_seed)
    ob, lse = backends.dispatch("attention_fwd", qb, kb, vb, *args)
    o = _to_bshd(ob, qkv_format)

    def backward(do):
        return backends.dispatch("attention_bwd", _to_bshd(do, qkv_format), qb, kb, vb, ob,
                                 lse, *args)
    record(lambda do: tuple(_to_bshd(g, qkv_format) for g in backward(do)), (q, k, v), (o,))
    return o

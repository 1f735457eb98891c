"""Reference (unfused) scaled dot-product attention, forward and backward, layout bshd.

q [b, sq, h, d], k and v [b, skv, hk, d] with h % hk == 0 (GQA/MQA: query head i uses KV
head i // (h // hk)). S = scale * Q K^T; masked entries are excluded from the softmax. The
mask is a Mask of two booleans (ops/attention.py parses the mask type's name): causal keeps
j <= i (top-left aligned), padding keeps i < seqlens_q[b] and j < seqlens_kv[b]; a fully
masked row (a padded query) gives an output of zero.
P = softmax(S); with dropout, P is multiplied by keep / (1 - p), the keep mask drawn from
Philox over the flat index of [b, h, sq, skv]. O = P V. The forward saves
lse = log(sum exp S) per row [b, h, sq] (float32), which the backward uses to rebuild P,
as a fused kernel does.
"""
import numpy as np

from .. import backends
from .._array import compute_dtype, xp_of
from .dropout import keep_mask as dropout_keep
from .softmax import masked_softmax

def _heads_first(t, ct):
    return t.astype(ct).transpose(0, 2, 1, 3)  # [b, s, h, d] -> [b, h, s, d]


def _keep(xp, b, sq, skv, mask, seqlens_q, seqlens_kv):
    keep = xp.ones((1, 1, sq, skv), dtype=bool)
    if mask.causal:
        keep = keep & (xp.arange(skv)[None, :] <= xp.arange(sq)[:, None])
    if mask.padding:
        qk = xp.arange(sq)[None, :] < seqlens_q[:, None]      # [b, sq]
        kk = xp.arange(skv)[None, :] < seqlens_kv[:, None]    # [b, skv]
        keep = keep & (qk[:, None, :, None] & kk[:, None, None, :])
    return keep


def _probs(q, k, scale, mask, seqlens_q, seqlens_kv):
    """(Qh, Kh, P, lse): heads-first float copies with K repeated for GQA."""
    xp, ct = xp_of(q), compute_dtype(q.dtype)
    group = q.shape[2] // k.shape[2]
    qh, kh = _heads_first(q, ct), xp.repeat(_heads_first(k, ct), group, axis=1)
    s = xp.matmul(qh, kh.transpose(0, 1, 3, 2)) * ct.type(scale)
    keep = _keep(xp, q.shape[0], q.shape[1], k.shape[1], mask, seqlens_q, seqlens_kv)
    p, lse = masked_softmax(s, keep, xp)
    return qh, kh, p, lse.astype(np.float32)


def _dropout_factor(xp, shape, p, seed, ct):
    if p == 0:
        return None
    return dropout_keep(xp, shape, p, seed, 0).astype(ct) * ct.type(1 / (1 - p))


@backends.register("attention_fwd", "reference")
def attention_fwd(q, k, v, scale, mask, seqlens_q, seqlens_kv, dropout_p, seed):
    """-> (o [b, sq, h, d] in q's dtype, lse [b, h, sq] float32)."""
    xp, ct = xp_of(q), compute_dtype(q.dtype)
    group = q.shape[2] // k.shape[2]
    _, _, p, lse = _probs(q, k, scale, mask, seqlens_q, seqlens_kv)
    z = _dropout_factor(xp, p.shape, dropout_p, seed, ct)
    vh = xp.repeat(_heads_first(v, ct), group, axis=1)
    o = xp.matmul(p if z is None else p * z, vh)
    return o.transpose(0, 2, 1, 3).astype(q.dtype), lse


@backends.register("attention_bwd", "reference")
def attention_bwd(do, q, k, v, o, lse, scale, mask, seqlens_q, seqlens_kv, dropout_p,
                  seed):
    """-> (dq, dk, dv) in the layouts and dtype of q, k, v. dS = P * (dP - rowsum(dO * O))."""
    xp, ct = xp_of(q), compute_dtype(q.dtype)
    b, skv, hk, d = k.shape
    group = q.shape[2] // hk
    qh, kh, p, _ = _probs(q, k, scale, mask, seqlens_q, seqlens_kv)
    z = _dropout_factor(xp, p.shape, dropout_p, seed, ct)
    vh = xp.repeat(_heads_first(v, ct), group, axis=1)
    doh, oh = _heads_first(do, ct), _heads_first(o, ct)
    dp = xp.matmul(doh, vh.transpose(0, 1, 3, 2))
    pz = p if z is None else p * z
    dp = dp if z is None else dp * z
    ds = p * (dp - (doh * oh).sum(axis=-1, keepdims=True)) * ct.type(scale)
    dq = xp.matmul(ds, kh)
    dk = xp.matmul(ds.transpose(0, 1, 3, 2), qh)
    dv = xp.matmul(pz.transpose(0, 1, 3, 2), doh)

    def back(t, like):  # [b, h, s, d] -> sum over the GQA group -> [b, s, hk, d]
        t = t.reshape(b, hk, group, t.shape[2], d).sum(axis=2)
        return t.transpose(0, 2, 1, 3).astype(like.dtype)
    return dq.transpose(0, 2, 1, 3).astype(q.dtype), back(dk, k), back(dv, v)

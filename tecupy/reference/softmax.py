"""Reference scaled, masked softmax over the last axis (the unfused attention path).

y = softmax(scale * x) with masked entries excluded; `mask` is boolean, True = masked out
(Transformer Engine's convention), broadcast against x; `causal` masks j > i (top-left
aligned). A row with every entry masked gives zeros (not NaN).
"""
import numpy as np

from .. import backends
from .._array import compute_dtype, xp_of


def keep_mask(xp, shape, mask, causal):
    """Boolean 'keep' array broadcastable to `shape` (..., sq, sk), or None for no mask."""
    keep = None
    if mask is not None:
        keep = ~mask.astype(bool)
    if causal:
        sq, sk = shape[-2], shape[-1]
        tri = xp.arange(sk)[None, :] <= xp.arange(sq)[:, None]
        keep = tri if keep is None else keep & tri
    return keep


def masked_softmax(s, keep, xp):
    """softmax over the last axis of float array s where keep; fully masked rows -> 0.
    Returns (p, lse) with lse = +inf on fully masked rows."""
    if keep is not None:
        s = xp.where(keep, s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)
    e = xp.exp(s - m)
    denom = e.sum(axis=-1, keepdims=True)
    p = e / xp.where(denom > 0, denom, 1)
    lse = xp.where(denom > 0, m + xp.log(xp.where(denom > 0, denom, 1)), np.inf)
    return p, lse[..., 0]


@backends.register("softmax_fwd", "reference")
def softmax_fwd(x, scale, mask, causal):
    xp, ct = xp_of(x), compute_dtype(x.dtype)
    s = x.astype(ct) * ct.type(scale)
    p, _ = masked_softmax(s, keep_mask(xp, x.shape, mask, causal), xp)
    return p.astype(x.dtype)


@backends.register("softmax_bwd", "reference")
def softmax_bwd(dy, y, scale):
    """dx = scale * y * (dy - sum(dy * y)); masked entries have y = 0, so dx = 0 there."""
    ct = compute_dtype(y.dtype)
    yf, dyf = y.astype(ct), dy.astype(ct)
    dx = ct.type(scale) * yf * (dyf - (dyf * yf).sum(axis=-1, keepdims=True))
    return dx.astype(y.dtype)

"""Reference cross entropy over the last axis, with label smoothing and ignore_index.

Per token t with target c: loss = lse - (1 - eps) * x[c] - eps * mean_j x[j], where
lse = log sum_j exp x[j]; tokens whose target is ignore_index get loss 0 and gradient 0.
Gradient: dx = dloss * (softmax(x) - (1 - eps) * onehot(c) - eps / V).
A target outside [0, V) that is not ignore_index gives a NaN loss and a NaN gradient row
(ops/loss.py raises first on NumPy; on CuPy the NaN is how it shows, with no host sync).
"""
import numpy as np

from .. import backends
from .._array import compute_dtype, xp_of


def _onehot_pick(xp, xf, target, ignore_index):
    """(valid, bad, safe, picked): valid = not ignored; bad = valid but out of [0, V);
    safe = the target where valid and in range, else 0 (never an index out of range)."""
    valid = target != ignore_index
    bad = valid & ((target < 0) | (target >= xf.shape[-1]))
    safe = xp.where(valid & ~bad, target, 0).astype(np.int64)
    picked = xp.take_along_axis(xf, safe[..., None], axis=-1)[..., 0]
    return valid, bad, safe, picked


@backends.register("cross_entropy_fwd", "reference")
def cross_entropy_fwd(logits, target, ignore_index, label_smoothing):
    """-> (loss per token, lse per token), both in float32 (float64 for float64 logits)."""
    xp, ct = xp_of(logits), compute_dtype(logits.dtype)
    xf = logits.astype(ct)
    m = xf.max(axis=-1, keepdims=True)
    lse = (m + xp.log(xp.exp(xf - m).sum(axis=-1, keepdims=True)))[..., 0]
    valid, bad, _, picked = _onehot_pick(xp, xf, target, ignore_index)
    eps = ct.type(label_smoothing)
    loss = lse - (1 - eps) * picked - eps * xf.mean(axis=-1)
    loss = xp.where(bad, ct.type(np.nan), xp.where(valid, loss, 0))
    return loss.astype(ct), lse


@backends.register("cross_entropy_bwd", "reference")
def cross_entropy_bwd(dloss, logits, target, lse, ignore_index, label_smoothing):
    xp, ct = xp_of(logits), compute_dtype(logits.dtype)
    xf = logits.astype(ct)
    valid, bad, safe, _ = _onehot_pick(xp, xf, target, ignore_index)
    eps = ct.type(label_smoothing)
    g = xp.exp(xf - lse[..., None]) - eps / xf.shape[-1]
    onehot = xp.arange(xf.shape[-1])[None, :] == safe.reshape(-1, 1)
    g = g - (1 - eps) * onehot.reshape(g.shape)
    w = xp.where(bad, ct.type(np.nan), xp.where(valid, dloss.astype(ct), 0))
    g = g * w[..., None]
    return g.astype(logits.dtype)

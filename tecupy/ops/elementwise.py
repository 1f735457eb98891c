"""Residual add, softmax, dropout, and the view ops (reshape, split) the tape must see."""
import numpy as np

from .. import backends
from .._array import array_module, check_float
from ..tape import record


def add(a, b):
    """a + b with NumPy broadcasting (the residual connection); gradients are summed back
    to each input's shape."""
    array_module("add", a=a, b=b)
    check_float("add", a=a, b=b)
    y = backends.dispatch("add_fwd", a, b)
    record(lambda dy: (dy, dy), (a, b), (y,))
    return y


def reshape(x, shape):
    """x.reshape(shape), recorded on the tape."""
    y = x.reshape(shape)
    record(lambda dy: (dy.reshape(x.shape),), (x,), (y,))
    return y


def split(x, sizes, axis=-1):
    """Split x along `axis` into pieces of the given sizes (a list of ints), recorded."""
    xp = array_module("split", x=x)
    if sum(sizes) != x.shape[axis]:
        raise ValueError(f"split: sizes {list(sizes)} sum to {sum(sizes)}, but axis {axis} of x "
                         f"has {x.shape[axis]}")
    outs = tuple(xp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=axis))
    record(lambda *gs: (_join(xp, gs, axis, x.shape),), (x,), outs)
    return outs


def _join(xp, gs, axis, shape):
    """concatenate(gs, axis); no copy when the pieces already are the adjacent slices of one
    C-contiguous CuPy array (the attention backward's dq, dk, dv of a packed qkv)."""
    g0 = gs[0]
    if xp is not np and all(g.dtype == g0.dtype and g.data.mem is g0.data.mem for g in gs):
        full = xp.ndarray(shape, g0.dtype, g0.data)  # C-contiguous, starting at piece 0
        off, axis = 0, axis % len(shape)
        for g in gs:
            piece = full[(slice(None),) * axis + (slice(off, off + g.shape[axis]),)]
            if (piece.shape, piece.strides, piece.data.ptr) != (g.shape, g.strides, g.data.ptr):
                break
            off += g.shape[axis]
        else:
            end = g0.data.mem.ptr + g0.data.mem.size
            if full.data.ptr + full.nbytes <= end:
                return full
    return xp.concatenate(gs, axis=axis)


def softmax(x, scale=1.0, mask=None, causal=False):
    """softmax(scale * x) over the last axis. `mask` (bool, True = masked out, broadcast
    against x) and `causal` (mask j > i over the last two axes) exclude entries; a row with
    every entry masked gives zeros."""
    array_module("softmax", x=x, mask=mask)
    check_float("softmax", x=x)
    if causal and x.ndim < 2:
        raise ValueError("softmax: causal needs at least 2 dimensions (..., sq, sk)")
    y = backends.dispatch("softmax_fwd", x, float(scale), mask, bool(causal))
    record(lambda dy: (backends.dispatch("softmax_bwd", dy, y, float(scale)),), (x,), (y,))
    return y


def dropout(x, p, seed=None, training=True, offset=0, residual=None):
    """Zero each element with probability p and scale the rest by 1/(1-p); with `residual`
    (same shape as x) return dropout(x) + residual in one pass. The mask comes from Philox
    keyed by `seed` (an int; drawn at random when None) and `offset`, so the same seed
    reproduces it on NumPy, CuPy and the CUDA kernel."""
    array_module("dropout", x=x, residual=residual)
    check_float("dropout", x=x, residual=residual)
    if not 0 <= p <= 1:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"dropout: residual has shape {tuple(residual.shape)}, x has "
                         f"{tuple(x.shape)}; they must match")
    if not training or p == 0:
        return x if residual is None else add(x, residual)
    if seed is None:
        seed = int(np.random.default_rng().integers(0, 2**63))
    y, keep = backends.dispatch("dropout_fwd", x, float(p), int(seed), int(offset), residual)

    def backward(dy):
        return backends.dispatch("dropout_bwd", dy, keep, float(p)), dy
    record(backward, (x, residual), (y,))
    return y

"""Residual add, softmax, dropout, and the view ops (reshape, split) the tape must see."""
import math

import numpy as np

from .. import _check, backends
from .._array import array_module, check_float, row_of
from ..graphs import fresh_seed
from ..tape import record


def add(a, b):
    """a + b with NumPy broadcasting (the residual connection, a bias); gradients are summed
    back to each input's shape: a row b (a bias over a's rows) gets the float32 column sums
    of dy rounded once (bias_grad, one kernel on the GPU)."""
    array_module("add", a=a, b=b)
    check_float("add", a=a, b=b)
    _check.broadcast_shapes("add", "a", a.shape, "b", b.shape)
    y = backends.dispatch("add_fwd", a, b)
    if row_of(a, b):
        record(lambda dy: (dy, _row_grad(dy, b)), (a, b), (y,))
    else:
        record(lambda dy: (dy, dy), (a, b), (y,))
    return y


def _row_grad(dy, row):
    """The gradient of a row broadcast over dy's rows: dy's float32 column sums rounded once
    to the row's dtype (bias_grad: one kernel on the GPU)."""
    return backends.dispatch("bias_grad", dy.reshape(-1, row.size), row.dtype).reshape(row.shape)


def add_bias(x, bias, residual=None):
    """x + bias (a row of x's last dimension, broadcast over its rows), then + residual
    (x's shape) where given: one pass on the GPU, each sum rounded as add(add(x, bias),
    residual) rounds it (a row-parallel GEMM's bias and residual after its reduction)."""
    array_module("add_bias", x=x, bias=bias, residual=residual)
    check_float("add_bias", x=x, bias=bias, residual=residual)
    if not row_of(x, bias):
        _check.fail("add_bias", "bias", f"a row of x's last dimension ({x.shape[-1]},) "
                    f"(x has shape {tuple(x.shape)})", bias)
    if residual is not None and residual.shape != x.shape:
        _check.fail("add_bias", "residual", f"an array of x's shape {tuple(x.shape)}", residual)
    y = backends.dispatch("add_fwd", x, bias, residual)
    record(lambda dy: (dy, _row_grad(dy, bias), dy), (x, bias, residual), (y,))
    return y


def _check_reshape(x, shape):
    array_module("reshape", x=x)
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    if not (isinstance(shape, (tuple, list)) and all(_check.is_int(d) for d in shape)):
        _check.fail("reshape", "shape", "a tuple of ints", shape, TypeError)
    known = math.prod(d for d in shape if d != -1)
    free = sum(d == -1 for d in shape)
    if (any(d < -1 for d in shape) or free > 1 or (free == 0 and known != x.size)
            or (free == 1 and (known == 0 or x.size % known))):
        _check.fail("reshape", "shape", f"a shape of {x.size} elements (x has shape "
                    f"{tuple(x.shape)}; at most one -1)", tuple(shape))
    return tuple(shape)


def reshape(x, shape):
    """x.reshape(shape), recorded on the tape."""
    shape = _check_reshape(x, shape)
    y = x.reshape(shape)
    record(lambda dy: (dy.reshape(x.shape),), (x,), (y,))
    return y


def split(x, sizes, axis=-1):
    """Split x along `axis` into pieces of the given sizes (a list of ints), recorded."""
    xp = array_module("split", x=x)
    if x.ndim == 0:
        _check.fail("split", "x", "an array of at least 1 dimension", x)
    axis = _check.integer("split", "axis", axis, -x.ndim, x.ndim)
    if isinstance(sizes, np.ndarray) and sizes.ndim == 1:
        sizes = sizes.tolist()
    if not (isinstance(sizes, (tuple, list)) and sizes and all(map(_check.is_int, sizes))):
        _check.fail("split", "sizes", "a non-empty list of ints", sizes, TypeError)
    if min(sizes) < 0:
        _check.fail("split", "sizes", "a list of ints >= 0", sizes)
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
    """softmax(scale * x) over the last axis. `mask` (a bool array, True = masked out, that
    broadcasts to x's shape) and `causal` (mask j > i over the last two axes) exclude
    entries; a row with every entry masked gives zeros."""
    array_module("softmax", x=x, mask=mask)
    check_float("softmax", x=x)
    scale = _check.real("softmax", "scale", scale)
    causal = _check.flag("softmax", "causal", causal)
    if mask is not None:
        _check_mask(x, mask)
    if causal and x.ndim < 2:
        _check.fail("softmax", "x", "an array of at least 2 dimensions (..., sq, sk) with "
                    "causal=True", x)
    y = backends.dispatch("softmax_fwd", x, scale, mask, causal)
    record(lambda dy: (backends.dispatch("softmax_bwd", dy, y, scale),), (x,), (y,))
    return y


def _check_mask(x, mask):
    """Only bool masks (True = masked out, Transformer Engine's convention): a 0/1 float or
    int mask is ambiguous (a 'keep' mask would be silently inverted)."""
    if mask.dtype != np.bool_:
        _check.fail("softmax", "mask", "a bool array (True = masked out)", mask, TypeError)
    _check.broadcast_to("softmax", "mask", mask.shape, x.shape, "x")


def dropout(x, p, seed=None, training=True, offset=0, residual=None):
    """Zero each element with probability p and scale the rest by 1/(1-p); with `residual`
    (same shape as x) return dropout(x) + residual in one pass. The mask comes from Philox
    keyed by `seed` (an int in [0, 2**64); drawn at random when None) and `offset` (an int
    in [0, 2**64)), so the same seed reproduces it on NumPy, CuPy and the CUDA kernel."""
    array_module("dropout", x=x, residual=residual)
    check_float("dropout", x=x, residual=residual)
    p = _check.real("dropout", "p", p, 0, 1)
    seed = _check.seed("dropout", "seed", seed)
    offset = _check.integer("dropout", "offset", offset, 0, _check.SEED_LIMIT)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"dropout: residual has shape {tuple(residual.shape)}, x has "
                         f"{tuple(x.shape)}; they must match")
    if not _check.flag("dropout", "training", training) or p == 0:
        return x if residual is None else add(x, residual)
    if seed is None:
        seed = fresh_seed()
    y, keep = backends.dispatch("dropout_fwd", x, p, seed, offset, residual)

    def backward(dy):
        return backends.dispatch("dropout_bwd", dy, keep, float(p)), dy
    record(backward, (x, residual), (y,))
    return y

"""Reference dropout with a Philox4x32-10 counter-based generator.

Element i of a tensor draws word (i % 4) of philox(counter=(i // 4, offset), key=seed);
u = (word >> 8) * 2**-24 is uniform in [0, 1); the element is kept when u >= p and scaled
by 1 / (1 - p). The same (seed, offset) gives the same mask on NumPy, CuPy and the CUDA
kernel. seed and offset are ints in [0, 2**64): Philox takes 64-bit keys and counters, and
a wider value would silently wrap to another seed's mask (ops/elementwise.py checks them at
the public boundary; uniform() refuses them too). The residual add of a transformer block
is fused in (y = dropout(x) + residual).
Arithmetic is on uint64 holding 32-bit values, so it runs on any array module.
"""
import numpy as np

from .. import backends
from .._array import compute_dtype, xp_of

_M0, _M1 = 0xD2511F53, 0xCD9E8D57   # Philox multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85   # Weyl key increments
_LO = 0xFFFFFFFF


def philox4x32(xp, counter, offset, seed):
    """Four uint32 words (as uint64 arrays) per element of `counter` (a uint64 array)."""
    c0, c1 = counter & _LO, counter >> 32
    c2 = xp.full_like(counter, offset & _LO)
    c3 = xp.full_like(counter, (offset >> 32) & _LO)
    k0, k1 = seed & _LO, (seed >> 32) & _LO
    for r in range(10):
        p0, p1 = np.uint64(_M0) * c0, np.uint64(_M1) * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ np.uint64(k0), p1 & _LO,
                          (p0 >> 32) ^ c3 ^ np.uint64(k1), p0 & _LO)
        k0, k1 = (k0 + _W0) & _LO, (k1 + _W1) & _LO
    return c0, c1, c2, c3


def uniform(xp, n, seed, offset):
    """n floats in [0, 1) from Philox, in float32."""
    seed, offset = int(seed), int(offset)
    if not (0 <= seed < 2**64 and 0 <= offset < 2**64):
        raise ValueError(f"dropout: seed and offset must be ints in [0, 2**64), got seed={seed}, "
                         f"offset={offset}")
    counter = xp.arange((n + 3) // 4, dtype=np.uint64)
    words = xp.stack(philox4x32(xp, counter, offset, seed), axis=-1).reshape(-1)[:n]
    return (words >> 8).astype(np.float32) * np.float32(2.0 ** -24)


def keep_mask(xp, shape, p, seed, offset):
    return (uniform(xp, int(np.prod(shape)), seed, offset) >= np.float32(p)).reshape(shape)


@backends.register("dropout_fwd", "reference")
def dropout_fwd(x, p, seed, offset, residual=None):
    """-> (y, keep mask) with y = dropout(x) (+ residual, same shape). p == 1 drops all."""
    xp, ct = xp_of(x), compute_dtype(x.dtype)
    keep = keep_mask(xp, x.shape, p, seed, offset)
    factor = ct.type(0 if p >= 1 else 1 / (1 - p))
    y = x.astype(ct) * keep * factor
    if residual is not None:
        y = y + residual.astype(ct)
    return y.astype(x.dtype), keep


@backends.register("dropout_bwd", "reference")
def dropout_bwd(dy, keep, p):
    ct = compute_dtype(dy.dtype)
    factor = ct.type(0 if p >= 1 else 1 / (1 - p))
    return (dy.astype(ct) * keep * factor).astype(dy.dtype)

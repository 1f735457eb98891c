"""CUDA LayerNorm and RMSNorm, forward and backward: cuda/norm.cu."""
import itertools

import numpy as np

from .. import backends, loader
from .._array import is_cupy
from .common import CTYPE, LOW_PRECISION, cbool, set_smem, sm_count, vec_width

FILE = "norm.cu"
MAX_HIDDEN = 24576  # backward keeps 2 * hidden floats of partial sums in shared memory
_TYPES = [CTYPE[d] for d in LOW_PRECISION]
loader.declare(FILE, [f"norm_{d}<{t}, {v}, {r}>" for d, t, v, r in itertools.product(
    ("fwd", "bwd"), _TYPES, (1, 4, 8), ("false", "true")) if not (t == "float" and v == 8)]
    + [f"norm_bwd_reduce<{t}>" for t in _TYPES])


def supported(x, *args, **kwargs):
    return is_cupy(x) and x.dtype in LOW_PRECISION and 0 < x.shape[-1] <= MAX_HIDDEN


def _threads(hidden, vec):
    """About four VEC-wide chunks per thread, a multiple of 32, at most 1024."""
    chunks = -(-hidden // vec)
    return int(min(1024, max(32, 32 * -(-chunks // 128))))


def _fwd(x, gamma, beta, eps, zero_centered_gamma, rms):
    import cupy
    hidden = x.shape[-1]
    rows = x.size // hidden
    x, gamma = cupy.ascontiguousarray(x), cupy.ascontiguousarray(gamma)
    beta = gamma if rms else cupy.ascontiguousarray(beta)
    y = cupy.empty_like(x)
    mu, rsigma = cupy.empty(rows, np.float32), cupy.empty(rows, np.float32)
    vec = vec_width(x.dtype, hidden)
    k = loader.function(FILE, f"norm_fwd<{CTYPE[x.dtype]}, {vec}, {cbool(rms)}>")
    set_smem(k, hidden * 4)
    if rows:
        k((rows,), (_threads(hidden, vec),), (x, gamma, beta, y, mu, rsigma, np.int32(hidden),
          np.float32(eps), np.int32(zero_centered_gamma)), shared_mem=hidden * 4)
    shape = x.shape[:-1]
    return (y, rsigma.reshape(shape)) if rms else (y, mu.reshape(shape), rsigma.reshape(shape))


def _bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, rms):
    import cupy
    hidden = x.shape[-1]
    rows = x.size // hidden
    dy, x, gamma = (cupy.ascontiguousarray(t) for t in (dy, x, gamma))
    rsigma = cupy.ascontiguousarray(rsigma, np.float32)
    mu = rsigma if rms else cupy.ascontiguousarray(mu, np.float32)
    nblocks = max(1, min(rows, 4 * sm_count()))
    part = cupy.empty((nblocks, 2 * hidden), np.float32)
    dx, dgamma = cupy.empty_like(x), cupy.empty_like(gamma)
    dbeta = dgamma if rms else cupy.empty_like(gamma)
    vec = vec_width(x.dtype, hidden)
    k = loader.function(FILE, f"norm_bwd<{CTYPE[x.dtype]}, {vec}, {cbool(rms)}>")
    set_smem(k, 2 * hidden * 4)
    k((nblocks,), (_threads(hidden, vec),), (dy, x, mu, rsigma, gamma, dx, part,
      np.int64(rows), np.int32(hidden), np.int32(zero_centered_gamma)),
      shared_mem=2 * hidden * 4)
    r = loader.function(FILE, f"norm_bwd_reduce<{CTYPE[x.dtype]}>")
    r((-(-hidden // 256),), (256,), (part, np.int32(nblocks), np.int32(hidden), dgamma, dbeta,
      np.int32(not rms)))
    return (dx, dgamma) if rms else (dx, dgamma, dbeta)


@backends.register("layernorm_fwd", "cuda", supports=supported)
def layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma):
    return _fwd(x, gamma, beta, eps, zero_centered_gamma, rms=False)


@backends.register("layernorm_bwd", "cuda", supports=supported)
def layernorm_bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma):
    return _bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, rms=False)


@backends.register("rmsnorm_fwd", "cuda", supports=supported)
def rmsnorm_fwd(x, gamma, eps, zero_centered_gamma):
    return _fwd(x, gamma, None, eps, zero_centered_gamma, rms=True)


@backends.register("rmsnorm_bwd", "cuda", supports=supported)
def rmsnorm_bwd(dy, x, rsigma, gamma, zero_centered_gamma):
    return _bwd(dy, x, None, rsigma, gamma, zero_centered_gamma, rms=True)

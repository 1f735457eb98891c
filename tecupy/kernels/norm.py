"""CUDA LayerNorm and RMSNorm, forward and backward: cuda/norm.cu."""
import itertools

import numpy as np

from .. import backends, loader
from .._array import is_cupy
from .common import CTYPE, FP8TYPE, LOW_PRECISION, cbool, sm_count, vec_width

FILE = "norm.cu"
CHUNKS = (1, 2, 4, 8)  # VEC-wide chunks each thread keeps in registers
WARP_CHUNKS = (1, 2, 4, 8, 16)  # the same for the warp-per-row forward
FWD_WARP = True  # forward: one warp per row (else one block per row; PERFLOG.md)
_VECS = {"float": (1, 4), "__half": (1, 8), "__nv_bfloat16": (1, 8)}
_BOOLS = ("false", "true")
_FP8 = tuple(FP8TYPE.values())


def _outs(t, v):
    """Output types of the forward: T itself, and FP8 codes on the vectorized path only."""
    return (t,) + (_FP8 if v > 1 else ())


loader.declare(FILE, [f"{k}<{t}, {v}, {c}, {r}, {o}>" for k, cs in (
    ("norm_fwd", CHUNKS), ("norm_fwd_warp", WARP_CHUNKS)) for t, c, r in itertools.product(
    _VECS, cs, _BOOLS) for v in _VECS[t] for o in _outs(t, v)]
    + [f"norm_bwd<{t}, {v}, {c}, {r}, {a}, {q}>" for t, c, r, a, q in itertools.product(
        _VECS, CHUNKS, _BOOLS, _BOOLS, (1, 2)) for v in _VECS[t]]
    + [f"norm_bwd_reduce<{t}>" for t in _VECS])


MAX_THREADS = 512      # __launch_bounds__ of the kernels
THREADS_PER_ROW = 256  # preferred block size (tuned in PERFLOG.md)
FWD_THREADS_PER_SM, BWD_THREADS_PER_SM = 2048, 512  # resident threads the grid aims at
BWD_ACC_SMEM = False     # True: dgamma/dbeta sums in shared memory (slower, PERFLOG.md)
MAX_ACC_SMEM = 192 << 10
BWD_ROWS = 2  # rows per backward iteration (loads of both in flight, one barrier pair)


def supported(x, *args, **kwargs):
    if not (is_cupy(x) and x.dtype in LOW_PRECISION and x.shape[-1] > 0):
        return False
    return x.shape[-1] <= vec_width(x.dtype, x.shape[-1]) * CHUNKS[-1] * MAX_THREADS


def _shape(hidden, vec):
    """(threads, chunks per thread) for the block-per-row kernels: at most 2 chunks within
    THREADS_PER_ROW threads, else the fewest chunks within MAX_THREADS (more chunks per
    thread spill registers: PERFLOG.md)."""
    n = -(-hidden // vec)
    fits = [(c, limit) for limit, cs in ((THREADS_PER_ROW, (1, 2)), (MAX_THREADS, CHUNKS))
            for c in cs if -(-n // c) <= limit]
    if not fits:
        raise ValueError(f"hidden size {hidden} is too large for norm.cu")
    c = fits[0][0]
    return int(max(32, 32 * -(-n // (32 * c)))), c


def _grid(rows, threads, per_sm):
    return int(max(1, min(rows, sm_count() * max(1, per_sm // threads))))


def _fwd(x, gamma, beta, eps, zero_centered_gamma, rms, scale=None, fmt=None):
    """y (x's dtype), or with `fmt` the FP8 codes of y * scale and amax of y."""
    import cupy
    hidden = x.shape[-1]
    rows = x.size // hidden
    x, gamma = cupy.ascontiguousarray(x), cupy.ascontiguousarray(gamma)
    beta = gamma if rms else cupy.ascontiguousarray(beta)
    y = cupy.empty(x.shape, np.uint8 if fmt else x.dtype)
    amax = cupy.zeros((1,), np.float32)
    mu, rsigma = cupy.empty(rows, np.float32), cupy.empty(rows, np.float32)
    vec = vec_width(x.dtype, hidden)
    wchunks = -(-hidden // (32 * vec))
    types = f"{CTYPE[x.dtype]}, {vec}, {{}}, {cbool(rms)}, " + (
        FP8TYPE[fmt.name] if fmt else CTYPE[x.dtype])
    if FWD_WARP and wchunks <= WARP_CHUNKS[-1]:
        chunks = next(c for c in WARP_CHUNKS if c >= wchunks)
        k = loader.function(FILE, f"norm_fwd_warp<{types.format(chunks)}>")
        grid, threads = _grid(-(-rows // 4), 128, FWD_THREADS_PER_SM), 128
    else:
        threads, chunks = _shape(hidden, vec)
        k = loader.function(FILE, f"norm_fwd<{types.format(chunks)}>")
        grid = _grid(rows, threads, FWD_THREADS_PER_SM)
    if rows:
        k((grid,), (threads,), (x, gamma, beta, y, mu, rsigma, np.int64(rows),
          np.int32(hidden), np.float32(eps), np.int32(zero_centered_gamma),
          amax if scale is None else scale, amax))
    out = _outputs(y, mu, rsigma, x.shape[:-1], rms)
    return out + (amax,) if fmt else out


def _outputs(y, mu, rsigma, shape, rms):
    return (y, rsigma.reshape(shape)) if rms else (y, mu.reshape(shape), rsigma.reshape(shape))


def _bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, rms):
    import cupy
    hidden = x.shape[-1]
    rows = x.size // hidden
    dy, x, gamma = (cupy.ascontiguousarray(t) for t in (dy, x, gamma))
    rsigma = cupy.ascontiguousarray(rsigma, np.float32)
    mu = rsigma if rms else cupy.ascontiguousarray(mu, np.float32)
    vec = vec_width(x.dtype, hidden)
    threads, chunks = _shape(hidden, vec)
    # Each block writes a [2, hidden] partial that norm_bwd_reduce reads back: fewer blocks
    # measured faster (PERFLOG.md: 2 blocks of 256 per SM beat 4 and 8).
    nblocks = _grid(rows, threads, BWD_THREADS_PER_SM)
    part = cupy.empty((nblocks, 2 * hidden), np.float32)
    dx, dgamma = cupy.empty_like(x), cupy.empty_like(gamma)
    dbeta = dgamma if rms else cupy.empty_like(gamma)
    # Sums in shared memory when asked, or when 4+ chunks per thread would spill registers.
    use_smem = (BWD_ACC_SMEM or chunks > 2) and 8 * hidden <= MAX_ACC_SMEM
    smem = 8 * hidden if use_smem else 0
    rows_at_once = BWD_ROWS if chunks <= 2 else 1  # more chunks: registers are full
    k = loader.function(FILE, f"norm_bwd<{CTYPE[x.dtype]}, {vec}, {chunks}, {cbool(rms)}, "
                              f"{cbool(smem)}, {rows_at_once}>")
    if smem > 48 << 10 and k.max_dynamic_shared_size_bytes < smem:
        k.max_dynamic_shared_size_bytes = smem  # opt in beyond the default 48 KB
    k((nblocks,), (threads,), (dy, x, mu, rsigma, gamma, dx, part, np.int64(rows),
      np.int32(hidden), np.int32(zero_centered_gamma)), shared_mem=smem)
    r = loader.function(FILE, f"norm_bwd_reduce<{CTYPE[x.dtype]}>")
    r((-(-2 * hidden // 32),), (32, 8), (part, np.int32(nblocks), np.int32(hidden), dgamma, dbeta,
      np.int32(not rms)))
    return (dx, dgamma) if rms else (dx, dgamma, dbeta)


@backends.register("layernorm_fwd", "cuda", supports=supported)
def layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma):
    return _fwd(x, gamma, beta, eps, zero_centered_gamma, rms=False)


def supported_fp8(x, *args):
    return supported(x) and vec_width(x.dtype, x.shape[-1]) > 1


@backends.register("layernorm_fwd_fp8", "cuda", supports=supported_fp8)
def layernorm_fwd_fp8(x, gamma, beta, eps, zero_centered_gamma, scale, fmt):
    return _fwd(x, gamma, beta, eps, zero_centered_gamma, False, scale, fmt)


@backends.register("rmsnorm_fwd_fp8", "cuda", supports=supported_fp8)
def rmsnorm_fwd_fp8(x, gamma, eps, zero_centered_gamma, scale, fmt):
    return _fwd(x, gamma, None, eps, zero_centered_gamma, True, scale, fmt)


@backends.register("layernorm_bwd", "cuda", supports=supported)
def layernorm_bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma):
    return _bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, rms=False)


@backends.register("rmsnorm_fwd", "cuda", supports=supported)
def rmsnorm_fwd(x, gamma, eps, zero_centered_gamma):
    return _fwd(x, gamma, None, eps, zero_centered_gamma, rms=True)


@backends.register("rmsnorm_bwd", "cuda", supports=supported)
def rmsnorm_bwd(dy, x, rsigma, gamma, zero_centered_gamma):
    return _bwd(dy, x, None, rsigma, gamma, zero_centered_gamma, rms=True)

"""CUDA LayerNorm and RMSNorm, forward and backward: cuda/norm_fwd.cu, cuda/norm_bwd.cu
(the per-row maths they share: cuda/norm.cuh).

Each kernel choice below is the fastest measured for some GPU and shape (PERFLOG.md); the
variants kept only for comparison left in the commit recorded at PERFLOG.md's end. The
declared instantiations are exactly the ones the choices can reach (tests/
test_kernels_norm.py walks every hidden size through _fwd_kernel and _bwd_kernel)."""
import functools
import itertools
import os

import numpy as np

from .. import backends, loader
from .._array import is_cupy
from .cast import scale_inv_arg
from .dtypes import CTYPE, FP8TYPE, LOW_PRECISION, cbool, vec_width
from .launch import (Launcher, balanced_grid, hopper, launch, opt_in_smem, planned,
                     resident_blocks, sm_count)
from .pools import amax_args, ring_counters
from .ring import (RING_GROUPS, RING_WARP_BYTES, ring_group, ring_launch, ring_plan,
                   ring_portion, ring_settings)

FWD_FILE, BWD_FILE = "norm_fwd.cu", "norm_bwd.cu"
CHUNKS = (1, 2, 4, 8)  # VEC-wide chunks each thread of the block-per-row kernels keeps
WARP_CHUNKS = (1, 2, 4, 8, 16)  # the same for norm_fwd_warp's lanes
_VECS = {"float": (1, 4), "__half": (1, 8), "__nv_bfloat16": (1, 8)}  # 1, or 16 bytes
_BOOLS = ("false", "true")
_FP8 = tuple(FP8TYPE.values())

# Forward: "stream" runs norm_fwd_stream on Hopper for 16-byte rows of at least
# STREAM_MIN_ROW_BYTES (G warps per row, rows streamed through per-warp rings of shared
# memory by bulk copies, ring.ring_launch); every other case, and "warp" everywhere, takes
# norm_fwd_warp (a warp per row from registers: up to 16 chunks per lane) or, for longer
# rows, norm_fwd (a block per row). Shorter rows fit the warp kernel's registers with many
# warps per SM, which measured faster (H200, PERFLOG.md: 1024 bf16 93% of copy against 65%).
FWD_VARIANTS = ("stream", "warp")
FWD_VARIANT = os.environ.get("TECUPY_NORM_FWD", "stream")
STREAM_MIN_ROW_BYTES = 4096
# bytes of a row per warp (ring.ring_group): an FP8 output does more work per byte and
# takes 4096 (H200 8192 x 4096: 65% of copy against 61% at 2048; bf16 out 85% against 81%)
STREAM_WARP_BYTES = {False: RING_WARP_BYTES, True: 4096}
# at most 2 slots per warp (H200, LayerNorm with an FP8 output at 8192 x 4096: 70 -> 74-75%
# of copy against 3 slots; bf16 outputs equal or better; PERFLOG.md)
STREAM_MAX_SLOTS = 2

# Backward: "grp" runs norm_bwd_grp on Hopper for 16-byte rows within 2 chunks per thread
# (groups of threads per block, up to 8, each with its own ring of GRP_STAGES row slots
# filled by bulk copies; one block per SM); elsewhere, and with "ring4" everywhere, those
# rows take norm_bwd_ring (a block per row, the next RING_STAGES - 1 rows streamed into
# shared memory by cp.async); every other row takes norm_bwd. Then norm_bwd_reduce_vec
# (even hidden) or norm_bwd_reduce sums the blocks' dgamma/dbeta partials.
BWD_VARIANTS = ("grp", "ring4")
BWD_VARIANT = os.environ.get("TECUPY_NORM_BWD", "grp")
GRP_STAGES, RING_STAGES = 3, 4  # (H200: 3 slots beat 4 by 1-2 points, PERFLOG.md session 6)
BWD_SMEM = 200 << 10  # shared bytes the grp rings may take per block

MAX_THREADS = 512      # __launch_bounds__ of the block-per-row kernels
THREADS_PER_ROW = 256  # preferred block size (tuned in PERFLOG.md)
FWD_THREADS_PER_SM, BWD_THREADS_PER_SM = 2048, 512  # resident threads the grid aims at
MAX_ACC_SMEM = 192 << 10  # norm_bwd keeps dgamma/dbeta in shared memory up to this


def _outs(t):
    """Output types of the forward: T itself and FP8 codes, on every path (an odd hidden
    size has no FP8 GEMM after it, but the op must still run on the GPU)."""
    return (t,) + _FP8


def _declare():
    """The instantiations _fwd_kernel and _bwd_kernel can reach, for some hidden size and
    GPU, and no others."""
    fwd, bwd = [], []
    for t, vecs in _VECS.items():
        v16 = vecs[-1]
        for v, r, o in itertools.product(vecs, _BOOLS, _outs(t)):
            fwd += [f"norm_fwd_warp<{t}, {v}, {c}, {r}, {o}>" for c in WARP_CHUNKS]
            # rows past the warp kernel's 16 chunks per lane: 2+ chunks per thread
            fwd += [f"norm_fwd<{t}, {v}, {c}, {r}, {o}>" for c in CHUNKS[1:]]
        for r, o, g, p in itertools.product(_BOOLS, _outs(t), RING_GROUPS, sorted({"float", t})):
            # rows of >= STREAM_MIN_ROW_BYTES take at least this many warps each
            if g >= ring_group(STREAM_MIN_ROW_BYTES, STREAM_WARP_BYTES[o != t]):
                fwd.append(f"norm_fwd_stream<{t}, {v16}, {r}, {o}, {g}, {p}>")
        for r in _BOOLS:
            # rows of one chunk per thread (<= 256 threads) fit 4-8 groups of 1024 threads,
            # rows of two (<= 512 threads) 1-2 groups of 512
            bwd += [f"norm_bwd_grp<{t}, {v16}, {c}, {r}, {GRP_STAGES}, {g}>"
                    for c, g in ((1, 4), (1, 8), (2, 1), (2, 2))]
            bwd += [f"norm_bwd_ring<{t}, {v16}, {c}, {r}, {RING_STAGES}>" for c in (1, 2)]
            for v, c in itertools.product(vecs, CHUNKS):
                if c <= 2 and v == 1:  # (16-byte rows of 1-2 chunks take ring or grp)
                    bwd.append(f"norm_bwd<{t}, {v}, {c}, {r}, false, 2>")
                elif c > 2:  # sums in shared memory up to MAX_ACC_SMEM, then registers
                    bwd.append(f"norm_bwd<{t}, {v}, {c}, {r}, true, 1>")
                    if 8 * v * c * MAX_THREADS > MAX_ACC_SMEM:
                        bwd.append(f"norm_bwd<{t}, {v}, {c}, {r}, false, 1>")
        bwd += [f"norm_bwd_reduce<{t}>", f"norm_bwd_reduce_vec<{t}>"]
    loader.declare(FWD_FILE, fwd)
    loader.declare(BWD_FILE, bwd)


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
        raise ValueError(f"hidden size {hidden} is too large for the norm kernels")
    c = fits[0][0]
    return int(max(32, 32 * -(-n // (32 * c)))), c


def _grid(rows, threads, per_sm):
    return int(max(1, min(rows, sm_count() * max(1, per_sm // threads))))


def _fwd(x, gamma, beta, eps, zero_centered_gamma, rms, scale=None, fmt=None, amax_out=None,
         scale_inv_out=None):
    """y (x's dtype), or with `fmt` the FP8 codes of y * scale and amax of y (maxed into
    amax_out where given: pools.amax_args), and 1 / scale written into scale_inv_out where
    given (float32 (1,): the codes' dequantizing factor, by the kernel, no launch of its
    own)."""
    import cupy
    hidden = x.shape[-1]
    rows = x.size // hidden
    x, gamma = cupy.ascontiguousarray(x), cupy.ascontiguousarray(gamma)
    beta = gamma if rms else cupy.ascontiguousarray(beta)
    y = cupy.empty(x.shape, np.uint8 if fmt else x.dtype)
    # amax only for an FP8 output (the kernels read scale, amax and slot then only)
    amax, slot = amax_args(amax_out, rows) if fmt else (y, y)
    mu, rsigma = cupy.empty(rows, np.float32), cupy.empty(rows, np.float32)
    inv = scale_inv_arg(scale, scale_inv_out, rows) if fmt else _NULL
    if rows:
        name = fmt and fmt.name
        run, scalars, rings = planned(
            _plans, _fwd_key(eps, rows, hidden, x.dtype, name, rms, zero_centered_gamma),
            _fwd_plan, rows, hidden, x.dtype, name, rms, zero_centered_gamma, eps)
        if rings and rings[0] is None:  # rows taken from counters: a zeroed set per launch
            rings = (ring_counters(), rings[1])
        s = amax if scale is None else scale
        run((x, gamma, beta, y, mu, rsigma) + scalars + (s, amax, slot, inv) + rings)
    out = _outputs(y, mu, rsigma, x.shape[:-1], rms)
    return out + (amax,) if fmt else out


_plans = {}  # launch plans (launch.planned; an eager LN at 8192 x 4096 was host-bound)


def _fwd_key(eps, rows, hidden, dtype, fmt, rms, zero_centered):
    """A forward plan's key: the call's eps (None: _fwd_launch's choice, which does not read
    it), shape and every setting the choice reads."""
    import cupy
    return (eps, rows, hidden, dtype, fmt, rms, zero_centered,
            cupy.cuda.runtime.getDevice(), FWD_VARIANT, STREAM_MIN_ROW_BYTES, STREAM_MAX_SLOTS,
            STREAM_WARP_BYTES[bool(fmt)], ring_launch, ring_settings(), THREADS_PER_ROW,
            MAX_THREADS, FWD_THREADS_PER_SM)


def _fwd_launch(rows, hidden, dtype, fmt, rms, zero_centered):
    """(launch(grid, block, args, shared_mem), grid, threads, dynamic shared bytes) of the
    forward of x (`dtype`) with an output of x's dtype, or of FP8 format `fmt` ("e4m3",
    "e5m2"): functools.partial(launch, kernel), or ring_launch's run."""
    return planned(_plans, _fwd_key(None, rows, hidden, dtype, fmt, rms, zero_centered),
                   _choose_fwd_launch, rows, hidden, dtype, fmt, rms, zero_centered)


_NULL = np.uint64(0)  # a null pointer argument


def _fwd_plan(rows, hidden, dtype, fmt, rms, zero_centered, eps):
    """(Launcher, the arguments rows, hidden, eps and zero_centered in the kernel's types,
    the ring kernels' last arguments: () or (row counters, slots), counters None where each
    launch takes its own) of _fwd_launch's choice, so that a call packs its arguments and
    launches (the kernels begin with PDL_WAIT)."""
    import cupy
    run, grid, threads, smem = _fwd_launch(rows, hidden, dtype, fmt, rms, zero_centered)
    if isinstance(run, functools.partial):  # partial(launch, kernel)
        k, rings = run.args[0], ()
    else:  # ring_launch's run: the kernel, its slots and rows from counters or fixed
        k, rings = run.kernel, (None if run.counted else _NULL, np.int32(run.slots))
    nd = cupy.ndarray  # x, gamma, beta, y, mu, rsigma, rows, hidden, eps, zero_centered,
    # scale, amax, slot (an array or a pool's address), scale_inv (or null), then the rings'
    # counters and slots
    kinds = (nd,) * 6 + (np.int64, np.int32, np.float32, np.int32, nd, nd, np.uint64,
                         np.uint64)
    kinds += (np.uint64, np.int32)[:len(rings)]
    scalars = (np.int64(rows), np.int32(hidden), np.float32(eps), np.int32(zero_centered))
    return Launcher(k, (grid,), (threads,), kinds, smem), scalars, rings


def _choose_fwd_launch(rows, hidden, dtype, fmt, rms, zero_centered):
    kind, name, arg = _fwd_kernel(hidden, dtype, fmt, rms, zero_centered, hopper())
    k = loader.function(FWD_FILE, name)
    if kind == "stream":  # (FP8 outputs keep the fixed split: ring.RING_DYNAMIC_ROWS)
        slot, extra, group = arg
        return ring_launch(k, rows, slot, extra, group, STREAM_MAX_SLOTS, dynamic=not fmt)
    if kind == "warp":  # 4 rows (warps) per block
        return functools.partial(launch, k), _grid(-(-rows // 4), 128, FWD_THREADS_PER_SM), \
            128, 0
    return functools.partial(launch, k), _grid(rows, arg, FWD_THREADS_PER_SM), arg, 0


def _fwd_kernel(hidden, dtype, fmt, rms, zero_centered, sm90):
    """The forward's kernel for rows of `hidden` elements of `dtype`, output of that dtype
    or of FP8 format `fmt`, on a Hopper GPU or not (`sm90`): ("stream", name, (slot bytes,
    extra shared bytes, warps per row)), ("warp", name, None) or ("block", name, threads).
    No GPU needed."""
    vec = vec_width(dtype, hidden)
    t, r = CTYPE[dtype], cbool(rms)
    out = FP8TYPE[fmt] if fmt else t
    if sm90 and FWD_VARIANT == "stream" and vec > 1:
        row_bytes = hidden * np.dtype(dtype).itemsize
        group = ring_group(row_bytes, STREAM_WARP_BYTES[bool(fmt)])
        slot = 16 * ring_portion(hidden // vec, group)
        # gamma + 1 (zero-centered) is kept as float: it need not be a value of the input type
        ptype = "float" if zero_centered else t
        # copies of gamma (and beta), the moments' scratch [2, 16 warps] of float4 and the row
        # takes [2, 16 warps] of uint32
        extra = (4 if ptype == "float" else 16 // vec) * hidden * (1 if rms else 2) + 640
        if row_bytes >= STREAM_MIN_ROW_BYTES and ring_plan(slot, extra):
            return ("stream", f"norm_fwd_stream<{t}, {vec}, {r}, {out}, {group}, {ptype}>",
                    (slot, extra, group))
    wchunks = -(-hidden // (32 * vec))
    if wchunks <= WARP_CHUNKS[-1]:
        chunks = next(c for c in WARP_CHUNKS if c >= wchunks)
        return "warp", f"norm_fwd_warp<{t}, {vec}, {chunks}, {r}, {out}>", None
    threads, chunks = _shape(hidden, vec)
    return "block", f"norm_fwd<{t}, {vec}, {chunks}, {r}, {out}>", threads


def _outputs(y, mu, rsigma, shape, rms):
    if len(shape) != 1:  # (a reshape costs ~1 us per call)
        mu, rsigma = mu.reshape(shape), rsigma.reshape(shape)
    return (y, rsigma) if rms else (y, mu, rsigma)


def _bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, rms, dres=None):
    """dres: None, or the gradient x already has from another consumer (x's shape and
    dtype), added to dx in the same pass."""
    import cupy
    hidden = x.shape[-1]
    rows = x.size // hidden
    dy, x = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(x)
    gamma = cupy.ascontiguousarray(gamma)
    rsigma = cupy.ascontiguousarray(rsigma, np.float32)
    mu = rsigma if rms else cupy.ascontiguousarray(mu, np.float32)
    run, nblocks, tail, reduce = _bwd_launch(rows, hidden, x.dtype, rms, zero_centered_gamma)
    part = cupy.empty((nblocks, 2 * hidden), np.float32)
    # (cupy.empty, not empty_like: ~2x its host cost; x and gamma are contiguous here)
    dx, dgamma = cupy.empty(x.shape, x.dtype), cupy.empty(gamma.shape, gamma.dtype)
    dbeta = dgamma if rms else cupy.empty(gamma.shape, gamma.dtype)
    dres = _NULL if dres is None else cupy.ascontiguousarray(dres)
    run((dy, x, mu, rsigma, gamma, dx, dres, part) + tail)
    _reduce(reduce, part, dgamma, dbeta)
    return (dx, dgamma) if rms else (dx, dgamma, dbeta)


def _bwd_launch(rows, hidden, dtype, rms, zero_centered):
    """The backward's plan: (Launcher, blocks, its arguments after the arrays: rows, hidden,
    zero_centered; the reduce's plan: _reduce_plan)."""
    import cupy
    key = ("bwd", rows, hidden, dtype, rms, zero_centered, cupy.cuda.runtime.getDevice(),
           BWD_VARIANT, GRP_STAGES, RING_STAGES, BWD_SMEM, MAX_ACC_SMEM, THREADS_PER_ROW,
           MAX_THREADS, BWD_THREADS_PER_SM)
    return planned(_plans, key, _choose_bwd_launch, rows, hidden, dtype, rms, zero_centered)


def _choose_bwd_launch(rows, hidden, dtype, rms, zero_centered):
    import cupy
    kind, name, (threads, smem, groups) = _bwd_kernel(hidden, dtype, rms, hopper())
    k = loader.function(BWD_FILE, name)
    opt_in_smem(k, smem)
    if kind == "grp":  # one block per SM (the partials are read back: fewer is better)
        nblocks = balanced_grid(-(-rows // groups), 1)
    elif kind == "ring":
        nblocks = balanced_grid(rows, resident_blocks(k, threads, smem))
    else:  # Each block writes a [2, hidden] partial that the reduce reads back: fewer
        # blocks measured faster (PERFLOG.md: 2 blocks of 256 per SM beat 4 and 8).
        nblocks = _grid(rows, threads, BWD_THREADS_PER_SM)
    nd = cupy.ndarray  # dy, x, mu, rsigma, gamma, dx, dres (or null), part, rows, hidden,
    kinds = (nd,) * 6 + (np.uint64, nd, np.int64, np.int32, np.int32)  # zero_centered
    return (Launcher(k, (nblocks,), (threads,), kinds, smem), nblocks,
            (np.int64(rows), np.int32(hidden), np.int32(zero_centered)),
            _reduce_plan(nblocks, hidden, dtype, rms))


def _bwd_kernel(hidden, dtype, rms, sm90):
    """The backward's kernel for rows of `hidden` elements of `dtype` on a Hopper GPU or not
    (`sm90`): (kind "grp" / "ring" / "base", name, (threads per block, dynamic shared bytes,
    groups per block)). No GPU needed."""
    vec = vec_width(dtype, hidden)
    threads, chunks = _shape(hidden, vec)
    t, r = CTYPE[dtype], cbool(rms)
    if vec > 1 and chunks <= 2:
        groups = _grp_groups(hidden * np.dtype(dtype).itemsize, threads, chunks)
        if sm90 and BWD_VARIANT == "grp" and groups:
            # the rings, which the groups' dgamma/dbeta sums reuse at the end
            smem = -(-8 * groups * GRP_STAGES // 128) * 128 + max(
                groups * GRP_STAGES * 2 * hidden * np.dtype(dtype).itemsize,
                (groups - 1) * 2 * chunks * threads * vec * 4)
            return ("grp", f"norm_bwd_grp<{t}, {vec}, {chunks}, {r}, {GRP_STAGES}, {groups}>",
                    (groups * threads, smem, groups))
        return ("ring", f"norm_bwd_ring<{t}, {vec}, {chunks}, {r}, {RING_STAGES}>",
                (threads, RING_STAGES * 2 * chunks * threads * 16, 1))
    # the dgamma/dbeta sums in shared memory where 4+ chunks per thread would spill
    # registers; short rows two at a time (their loads in flight together)
    acc = chunks > 2 and 8 * hidden <= MAX_ACC_SMEM
    return ("base", f"norm_bwd<{t}, {vec}, {chunks}, {r}, {cbool(acc)}, "
                    f"{1 if chunks > 2 else 2}>", (threads, 8 * hidden if acc else 0, 1))


def _grp_groups(row_bytes, threads, chunks):
    """Groups of `threads` threads per block of norm_bwd_grp: the most of 8, 4, 2, 1 within
    its launch bounds (1024 threads of one chunk, 512 of two) whose rings (GRP_STAGES
    slots of a row of x and one of dy each) fit in BWD_SMEM; 0 if none."""
    limit = 1024 if chunks == 1 else 512
    return next((g for g in (8, 4, 2, 1) if g * threads <= limit
                 and g * GRP_STAGES * 2 * row_bytes <= BWD_SMEM), 0)


def _bwd_reduce(part, nparts, hidden, dgamma, dbeta, rms):
    """dgamma, dbeta = the column sums of the partials [nparts, 2 hidden]."""
    import cupy
    _reduce(planned(_plans, ("reduce", nparts, hidden, dgamma.dtype, rms,
                             cupy.cuda.runtime.getDevice()),
                    _reduce_plan, nparts, hidden, dgamma.dtype, rms), part, dgamma, dbeta)


def _reduce(plan, part, dgamma, dbeta):
    """The reduce's launch by its plan (_reduce_plan)."""
    run, sizes, both = plan
    run((part,) + sizes + (dgamma, dbeta, both))


def _reduce_plan(nparts, hidden, dtype, rms):
    """(Launcher, (nparts, hidden) as int32, whether dbeta too as int32) of the reduce of
    the backward's partials: norm_bwd_reduce_vec at an even hidden, else norm_bwd_reduce."""
    import cupy
    t = CTYPE[dtype]
    if hidden % 2 == 0:
        k, grid, block = (loader.function(BWD_FILE, f"norm_bwd_reduce_vec<{t}>"),
                          (-(-2 * hidden // 128),), (32, 32))
    else:
        k, grid, block = (loader.function(BWD_FILE, f"norm_bwd_reduce<{t}>"),
                          (-(-2 * hidden // 32),), (32, 8))
    nd = cupy.ndarray  # part, nparts, hidden, dgamma, dbeta, dbeta too
    kinds = (nd, np.int32, np.int32, nd, nd, np.int32)
    return Launcher(k, grid, block, kinds), (np.int32(nparts), np.int32(hidden)), np.int32(
        not rms)


_declare()


@backends.register("layernorm_fwd", "cuda", supports=supported)
def layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma):
    return _fwd(x, gamma, beta, eps, zero_centered_gamma, rms=False)


@backends.register("layernorm_fwd_fp8", "cuda", supports=supported)
def layernorm_fwd_fp8(x, gamma, beta, eps, zero_centered_gamma, scale, fmt, amax_out=None,
                      scale_inv_out=None):
    return _fwd(x, gamma, beta, eps, zero_centered_gamma, False, scale, fmt, amax_out,
                scale_inv_out)


@backends.register("rmsnorm_fwd_fp8", "cuda", supports=supported)
def rmsnorm_fwd_fp8(x, gamma, eps, zero_centered_gamma, scale, fmt, amax_out=None,
                    scale_inv_out=None):
    return _fwd(x, gamma, None, eps, zero_centered_gamma, True, scale, fmt, amax_out,
                scale_inv_out)


@backends.register("layernorm_bwd", "cuda", supports=supported)
def layernorm_bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, dres=None):
    return _bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, False, dres)


@backends.register("rmsnorm_fwd", "cuda", supports=supported)
def rmsnorm_fwd(x, gamma, eps, zero_centered_gamma):
    return _fwd(x, gamma, None, eps, zero_centered_gamma, rms=True)


@backends.register("rmsnorm_bwd", "cuda", supports=supported)
def rmsnorm_bwd(dy, x, rsigma, gamma, zero_centered_gamma, dres=None):
    return _bwd(dy, x, None, rsigma, gamma, zero_centered_gamma, True, dres)

"""CUDA LayerNorm and RMSNorm, forward and backward: cuda/norm.cu."""
import functools
import itertools
import os

import numpy as np

from .. import backends, loader
from .._array import is_cupy
from .common import (CTYPE, FP8TYPE, LOW_PRECISION, RING_GROUPS, RING_WARP_BYTES,
                     amax_args, balanced_grid, cbool, hopper, launch, opt_in_smem,
                     planned, resident_blocks, ring_group, ring_launch, ring_plan,
                     ring_portion, ring_settings, sm_count, vec_width)

FILE = "norm.cu"
CHUNKS = (1, 2, 4, 8)  # VEC-wide chunks each thread keeps in registers
WARP_CHUNKS = (1, 2, 4, 8, 16)  # the same for the warp-per-row forward
FWD_WARP = True  # forward: one warp per row (else one block per row; PERFLOG.md)
_VECS = {"float": (1, 4), "__half": (1, 8), "__nv_bfloat16": (1, 8)}
_BOOLS = ("false", "true")
_FP8 = tuple(FP8TYPE.values())


# output types of the forward: T itself and FP8 codes, on every path (an odd hidden size
# has no FP8 GEMM after it, but the op must still run on the GPU)
def _outs(t):
    return (t,) + _FP8


loader.declare(FILE, [f"{k}<{t}, {v}, {c}, {r}, {o}>" for k, cs in (
    ("norm_fwd", CHUNKS), ("norm_fwd_warp", WARP_CHUNKS)) for t, c, r in itertools.product(
    _VECS, cs, _BOOLS) for v in _VECS[t] for o in _outs(t)]
    + [f"norm_bwd<{t}, {v}, {c}, {r}, {a}, {q}>" for t, c, r, a, q in itertools.product(
        _VECS, CHUNKS, _BOOLS, _BOOLS, (1, 2)) for v in _VECS[t]]
    + [f"norm_bwd_reduce<{t}>" for t in _VECS])

# Backward variants (scripts/issue3_device.py checks and times them on the GPU; PERFLOG.md):
# (kind, stages, dgamma/dbeta reduce). "base" is the session-1 path; "ring4": block per row,
# the next 3 rows streamed into shared memory by cp.async, on 16-byte rows of at most 2
# chunks per thread (other shapes take the base kernel, with the vector reduce).
# "grp" (Hopper, rows of 16-byte vectors within 2 chunks per thread, else "ring4"):
# norm_bwd_grp, BWD_GROUPS groups of threads per block, each with its own ring of
# BWD_STAGES row slots filled by bulk copies (fewer where shared memory is short).
BWD_VARIANTS = {"base": ("base", 0, "scalar"), "ring4": ("ring", 4, "vec"),
                "grp": ("grp", 3, "vec")}
BWD_VARIANT = os.environ.get("TECUPY_NORM_BWD", "grp")
BWD_GROUPS = 8  # at most
# grp blocks per SM (None: as many as fit); each block's dgamma/dbeta partial is read back
BWD_BLOCKS_PER_SM = 1
BWD_SMEM = 200 << 10  # shared bytes the grp rings may take per block
_RING_VECS = {t: v[1] for t, v in _VECS.items()}  # 16-byte vectors only
loader.declare(FILE, [f"norm_bwd_ring<{t}, {v}, {c}, {r}, 4>" for t, v in _RING_VECS.items()
                      for c, r in itertools.product((1, 2), _BOOLS)]
               + [f"norm_bwd_grp<{t}, {v}, {c}, {r}, {s}, {g}>" for t, v in _RING_VECS.items()
                  for c, r, s, g in itertools.product((1, 2), _BOOLS, (2, 3, 4), (1, 2, 4, 8))
                  if c == 1 or g < 4]
               + [f"norm_bwd_reduce_vec<{t}>" for t in _VECS])

# Forward variants: "warp" (a warp per row from registers, or a block per row for long
# rows); "stream" (Hopper, rows of 16-byte vectors: norm_fwd_stream, rows streamed through
# per-warp rings of shared memory by bulk copies, common.ring_launch; other cases take
# "warp").
# "stream" takes rows of at least STREAM_MIN_ROW_BYTES: shorter rows fit the warp kernel's
# registers with many warps per SM, which measured faster (H200, PERFLOG.md: 1024 bf16
# 93% of copy against 65%; 4096: 74% against 72%, with an FP8 output 57% against 50%).
FWD_VARIANTS = ("warp", "stream")
FWD_VARIANT = os.environ.get("TECUPY_NORM_FWD", "stream")
STREAM_MIN_ROW_BYTES = 4096
# norm_fwd_stream keeps gamma/beta in shared memory as float ("float") or as the input
# type ("input": half the shared-memory reads, ncu's limit; an unpack per use)
STREAM_GAMMA = "input"
# bytes of a row per warp (common.ring_group): an FP8 output does more work per byte and
# takes 4096 (H200 8192 x 4096: 65% of copy against 61% at 2048; bf16 out 85% against 81%)
STREAM_WARP_BYTES = {False: RING_WARP_BYTES, True: 4096}
# at most 2 slots per warp (H200, LayerNorm with an FP8 output at 8192 x 4096: 70 -> 74-75%
# of copy against 3 slots; bf16 outputs equal or better; PERFLOG.md)
STREAM_MAX_SLOTS = 2
loader.declare(FILE, [f"norm_fwd_stream<{t}, {v}, {r}, {o}, {g}, {p}>"
                      for t, v in _RING_VECS.items() for r in _BOOLS for o in _outs(t)
                      for g in RING_GROUPS for p in sorted({"float", t})])

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


def _fwd(x, gamma, beta, eps, zero_centered_gamma, rms, scale=None, fmt=None, amax_out=None):
    """y (x's dtype), or with `fmt` the FP8 codes of y * scale and amax of y (maxed into
    amax_out where given: common.amax_args)."""
    import cupy
    hidden = x.shape[-1]
    rows = x.size // hidden
    x, gamma = cupy.ascontiguousarray(x), cupy.ascontiguousarray(gamma)
    beta = gamma if rms else cupy.ascontiguousarray(beta)
    y = cupy.empty(x.shape, np.uint8 if fmt else x.dtype)
    # amax only for an FP8 output (the kernels read scale, amax and slot then only)
    amax, slot = amax_args(amax_out, rows) if fmt else (y, y)
    mu, rsigma = cupy.empty(rows, np.float32), cupy.empty(rows, np.float32)
    if rows:
        k, grid, threads, smem = _fwd_launch(rows, hidden, x.dtype, fmt and fmt.name, rms,
                                             zero_centered_gamma)
        k((grid,), (threads,), (x, gamma, beta, y, mu, rsigma, np.int64(rows),
          np.int32(hidden), np.float32(eps), np.int32(zero_centered_gamma),
          amax if scale is None else scale, amax, slot), shared_mem=smem)
    out = _outputs(y, mu, rsigma, x.shape[:-1], rms)
    return out + (amax,) if fmt else out


_plans = {}  # launch plans (common.planned; an eager LN at 8192 x 4096 was host-bound)


def _fwd_launch(rows, hidden, dtype, fmt, rms, zero_centered):
    """(kernel, grid, threads, dynamic shared bytes) of the forward of x (`dtype`) with an
    output of x's dtype, or of FP8 format `fmt` ("e4m3", "e5m2")."""
    import cupy
    key = ("fwd", rows, hidden, dtype, fmt, rms, zero_centered, cupy.cuda.runtime.getDevice(),
           FWD_VARIANT, FWD_WARP, STREAM_MIN_ROW_BYTES, STREAM_GAMMA, STREAM_MAX_SLOTS,
           STREAM_WARP_BYTES[bool(fmt)], ring_launch, ring_settings(), CHUNKS, WARP_CHUNKS,
           THREADS_PER_ROW, MAX_THREADS, FWD_THREADS_PER_SM)
    return planned(_plans, key, _choose_fwd_launch, rows, hidden, dtype, fmt, rms,
                   zero_centered)


def _choose_fwd_launch(rows, hidden, dtype, fmt, rms, zero_centered):
    vec = vec_width(dtype, hidden)
    # the kernels' template arguments, with a {} for the chunks per thread
    types = f"{CTYPE[dtype]}, {vec}, {{}}, {cbool(rms)}, " + (
        FP8TYPE[fmt] if fmt else CTYPE[dtype])
    stream = _stream_launch(rows, hidden, vec, types, rms, zero_centered)
    if stream:
        return stream
    threads, chunks = _shape(hidden, vec)
    wchunks = -(-hidden // (32 * vec))
    if FWD_WARP and wchunks <= WARP_CHUNKS[-1]:
        chunks = next(c for c in WARP_CHUNKS if c >= wchunks)
        k = loader.function(FILE, f"norm_fwd_warp<{types.format(chunks)}>")
        groups = -(-rows // 4)  # 4 rows (warps) per block
        return functools.partial(launch, k), _grid(groups, 128, FWD_THREADS_PER_SM), 128, 0
    k = loader.function(FILE, f"norm_fwd<{types.format(chunks)}>")
    return functools.partial(launch, k), _grid(rows, threads, FWD_THREADS_PER_SM), threads, 0


def _stream_launch(rows, hidden, vec, types, rms, zero_centered):
    """The launch of norm_fwd_stream as _fwd_launch gives it, or None where the kernel does
    not apply (not Hopper, rows not of 16-byte vectors, too short, too long for 2 slots)."""
    row_bytes = hidden * 16 // vec
    group = ring_group(row_bytes, STREAM_WARP_BYTES["fp8" in types])
    slot = 16 * ring_portion(hidden // vec, group)
    # gamma + 1 (zero-centered) is kept as float: it need not be a value of the input type
    ptype = "float" if STREAM_GAMMA == "float" or zero_centered else types.split(",")[0]
    # copies of gamma (and beta), the moments' scratch [2, 16 warps] of float4 and the row
    # takes [2, 16 warps] of uint32
    extra = (4 if ptype == "float" else row_bytes // hidden) * hidden * (1 if rms else 2) + 640
    if not (FWD_VARIANT == "stream" and vec > 1 and row_bytes >= STREAM_MIN_ROW_BYTES
            and hopper() and ring_plan(slot, extra)):
        return None
    k = loader.function(FILE, "norm_fwd_stream<" + types.replace(" {},", "")
                        + f", {group}, {ptype}>")
    # (FP8 outputs keep the fixed split: common.RING_DYNAMIC_ROWS)
    return ring_launch(k, rows, slot, extra, group, STREAM_MAX_SLOTS,
                       dynamic="fp8" not in types)


def _outputs(y, mu, rsigma, shape, rms):
    if len(shape) != 1:  # (a reshape costs ~1 us per call)
        mu, rsigma = mu.reshape(shape), rsigma.reshape(shape)
    return (y, rsigma) if rms else (y, mu, rsigma)


def _bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, rms):
    import cupy
    hidden = x.shape[-1]
    rows = x.size // hidden
    dy, x, gamma = (cupy.ascontiguousarray(t) for t in (dy, x, gamma))
    rsigma = cupy.ascontiguousarray(rsigma, np.float32)
    mu = rsigma if rms else cupy.ascontiguousarray(mu, np.float32)
    k, nblocks, threads, smem, reduce = _bwd_launch(rows, hidden, x.dtype, rms)
    part = cupy.empty((nblocks, 2 * hidden), np.float32)
    dx, dgamma = cupy.empty_like(x), cupy.empty_like(gamma)
    dbeta = dgamma if rms else cupy.empty_like(gamma)
    launch(k, (nblocks,), (threads,), (dy, x, mu, rsigma, gamma, dx, part, np.int64(rows),
                                       np.int32(hidden), np.int32(zero_centered_gamma)), smem)
    _bwd_reduce(part, nblocks, hidden, dgamma, dbeta, rms, reduce)
    return (dx, dgamma) if rms else (dx, dgamma, dbeta)


def _bwd_launch(rows, hidden, dtype, rms):
    """(kernel, blocks, threads, dynamic shared bytes, reduce variant) of the backward."""
    import cupy
    key = ("bwd", rows, hidden, dtype, rms, cupy.cuda.runtime.getDevice(), BWD_VARIANT,
           BWD_VARIANTS[BWD_VARIANT], BWD_GROUPS, BWD_BLOCKS_PER_SM, BWD_SMEM, BWD_ACC_SMEM,
           MAX_ACC_SMEM, BWD_ROWS, CHUNKS, THREADS_PER_ROW, MAX_THREADS, BWD_THREADS_PER_SM)
    return planned(_plans, key, _choose_bwd_launch, rows, hidden, dtype, rms)


def _choose_bwd_launch(rows, hidden, dtype, rms):
    kind, stages, reduce = BWD_VARIANTS[BWD_VARIANT]
    vec = vec_width(dtype, hidden)
    threads, chunks = _shape(hidden, vec)
    if kind == "grp" and vec > 1 and chunks <= 2 and hopper():
        plan = _grp_plan(hidden * dtype.itemsize, stages, threads, chunks)
        if plan:
            groups, stages = plan
            k = loader.function(FILE, f"norm_bwd_grp<{CTYPE[dtype]}, {vec}, {chunks}, "
                                      f"{cbool(rms)}, {stages}, {groups}>")
            # the rings, which the groups' dgamma/dbeta sums reuse at the end
            smem = -(-8 * groups * stages // 128) * 128 + max(
                groups * stages * 2 * hidden * dtype.itemsize,
                (groups - 1) * 2 * chunks * threads * vec * 4)
            opt_in_smem(k, smem)
            per_sm = BWD_BLOCKS_PER_SM or resident_blocks(k, groups * threads, smem)
            return (k, balanced_grid(-(-rows // groups), per_sm), groups * threads, smem,
                    reduce)
    if kind in ("ring", "grp") and vec > 1 and chunks <= 2:
        stages = stages if kind == "ring" else 4
        k = loader.function(FILE, f"norm_bwd_ring<{CTYPE[dtype]}, {vec}, {chunks}, "
                                  f"{cbool(rms)}, {stages}>")
        smem = stages * 2 * chunks * threads * 16
        opt_in_smem(k, smem)
        return k, balanced_grid(rows, resident_blocks(k, threads, smem)), threads, smem, reduce
    # Each block writes a [2, hidden] partial that the reduce reads back: fewer blocks
    # measured faster (PERFLOG.md: 2 blocks of 256 per SM beat 4 and 8).
    nblocks = _grid(rows, threads, BWD_THREADS_PER_SM)
    # Sums in shared memory when asked, or when 4+ chunks per thread would spill registers.
    use_smem = (BWD_ACC_SMEM or chunks > 2) and 8 * hidden <= MAX_ACC_SMEM
    smem = 8 * hidden if use_smem else 0
    rows_at_once = BWD_ROWS if chunks <= 2 else 1  # more chunks: registers are full
    k = loader.function(FILE, f"norm_bwd<{CTYPE[dtype]}, {vec}, {chunks}, {cbool(rms)}, "
                              f"{cbool(smem)}, {rows_at_once}>")
    opt_in_smem(k, smem)
    return k, nblocks, threads, smem, reduce


def _grp_plan(row_bytes, stages, threads, chunks):
    """(groups, stages) of norm_bwd_grp: the most groups of `threads` threads up to
    BWD_GROUPS within its launch bounds (1024 threads of one chunk, 512 of two), then the
    most stages up to `stages` whose rings (a row of x and one of dy per slot) fit in
    BWD_SMEM; None when not even one group of 2 stages fits."""
    limit = 1024 if chunks == 1 else 512
    for groups in (8, 4, 2, 1):
        if groups > BWD_GROUPS or groups * threads > limit:
            continue
        for s in range(stages, 1, -1):
            if groups * s * 2 * row_bytes <= BWD_SMEM:
                return groups, s
    return None


def _bwd_reduce(part, nparts, hidden, dgamma, dbeta, rms, reduce):
    """dgamma, dbeta = the column sums of the partials [nparts, 2 hidden]."""
    t = CTYPE[dgamma.dtype]
    args = (part, np.int32(nparts), np.int32(hidden), dgamma, dbeta, np.int32(not rms))
    if reduce == "vec" and hidden % 2 == 0:
        r = loader.function(FILE, f"norm_bwd_reduce_vec<{t}>")
        launch(r, (-(-2 * hidden // 128),), (32, 32), args)
    else:
        r = loader.function(FILE, f"norm_bwd_reduce<{t}>")
        launch(r, (-(-2 * hidden // 32),), (32, 8), args)


@backends.register("layernorm_fwd", "cuda", supports=supported)
def layernorm_fwd(x, gamma, beta, eps, zero_centered_gamma):
    return _fwd(x, gamma, beta, eps, zero_centered_gamma, rms=False)


@backends.register("layernorm_fwd_fp8", "cuda", supports=supported)
def layernorm_fwd_fp8(x, gamma, beta, eps, zero_centered_gamma, scale, fmt, amax_out=None):
    return _fwd(x, gamma, beta, eps, zero_centered_gamma, False, scale, fmt, amax_out)


@backends.register("rmsnorm_fwd_fp8", "cuda", supports=supported)
def rmsnorm_fwd_fp8(x, gamma, eps, zero_centered_gamma, scale, fmt, amax_out=None):
    return _fwd(x, gamma, None, eps, zero_centered_gamma, True, scale, fmt, amax_out)


@backends.register("layernorm_bwd", "cuda", supports=supported)
def layernorm_bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma):
    return _bwd(dy, x, mu, rsigma, gamma, zero_centered_gamma, rms=False)


@backends.register("rmsnorm_fwd", "cuda", supports=supported)
def rmsnorm_fwd(x, gamma, eps, zero_centered_gamma):
    return _fwd(x, gamma, None, eps, zero_centered_gamma, rms=True)


@backends.register("rmsnorm_bwd", "cuda", supports=supported)
def rmsnorm_bwd(dy, x, rsigma, gamma, zero_centered_gamma):
    return _bwd(dy, x, None, rsigma, gamma, zero_centered_gamma, rms=True)

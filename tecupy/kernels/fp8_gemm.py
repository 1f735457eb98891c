"""FP8 GEMM on Hopper: cutlass_templates/fp8_gemm.cu (TMA + wgmma, warp-specialized,
persistent), the `cutlass` implementation of fp8_gemm.

Python's part: pick a configuration, encode the two TMA descriptors (cached: a descriptor
only encodes an address and a shape), launch. Both operands are K-major uint8 codes; the
scales stay in device memory. Configurations (BN, stages, promote, cluster): "fast"
accumulation runs 128 x 256 tiles; the split accumulator (TE's default for dgrad and wgrad)
needs a second register fragment, so it runs 128 x 192 tiles, or 128 x 256 in two halves
where that wastes less of the last wave of tiles. A tuned table on disk (tecupy.gemm.tune)
overrides both.
"""
import itertools
import json
import os
import struct
import warnings

import numpy as np

from .. import backends, loader
from .._array import bfloat16, is_cupy
from ..fp8 import FP8Format
from .dtypes import CTYPE, FP8TYPE, cbool
from . import launch as launch_module  # (PDL: a setting; `launch` is a function here)
from .launch import Launcher, current_device, hopper, opt_in_smem, planned, sm_count
from .tma import tma_desc as tma_encode

FILE = "fp8_gemm.cu"
OPTIONS = ("-default-device",)  # CUTLASS headers have unannotated constexpr helpers
THREADS, BM, BK = 384, 128, 128
# split accumulator? -> default (BN, stages, promote, cluster), and the candidates
# tecupy.gemm.tune times. A cluster of 2 shares the A tile (TMA multicast) between CTAs of
# neighbouring column blocks; shapes with an odd number of column blocks run the same config
# unclustered.
# Split accumulation holds a second fragment: 128 x 192 tiles (BN = 256 runs its k-blocks
# in two 128-wide halves); measured on an H200, PERFLOG.md.
# Stages are what fits beside the bf16 output's staging buffer (smem_bytes <= SMEM_MAX).
CONFIGS = {False: (256, 3, False, 1), True: (192, 4, True, 1)}
# The default per shape (no tuned entry): among DEFAULTS, the least of waves x BN / speed,
# waves = ceil(tiles / SMs), speed = the config's relative throughput per tile (H200,
# PERFLOG.md session 3). A wider tile wins where the narrow one wastes a last wave: 4096^3
# split runs 704 tiles of 128 x 192 (5.33 waves, 89% used) or 512 of 128 x 256 (3.88, 97%).
DEFAULTS = {False: [(CONFIGS[False], 1.0)],
            True: [(CONFIGS[True], 1.0), ((256, 3, True, 1), 0.96)]}
# Short K (<= SHORT_K): the 256-wide split tiles' speed is that of the 192-wide ones, and a
# tie goes to the wider tile (fewer tiles, fewer epilogues). Measured on an H100 at the
# layer's split GEMMs (scripts/gemm_layer_tune.py, PERFLOG.md session 23): with K 3072-4096
# the 256-wide tiles ran 0-6% faster where the 0.96 model chose 192 (tensor-parallel ranks'
# dgrads at 8192 x 4096, the medium layer's qkv wgrad); with K >= 6144 the 192-wide ones won
# as modelled. The per-tensor and block-scaled GEMMs pass K (block scaling since session 28).
SHORT_K, SHORT_K_SPEED = 4096, {(256, 3, True, 1): 1.0}
# The block-scaled kernel with 128x128 B (block_scaling) and K > SHORT_K: 256-wide tiles at
# 0.98 of the 192-wide ones' speed, not 0.96. 256 x 3 ran 2-8% faster at the five shapes
# where that flips the choice (fc2's 8192 x 4096 x 16384, 4096 x 8192 x 16384, 16384 x 4096
# x 8192, 2048 x 16384 x 8192, 8192 x 4096 x 8192), and 192 x 4 stayed 8% faster at 8192^3
# (H100, PERFLOG.md session 31). 1x128 B (wgrad) keeps the model: 192 x 4 ran 2% faster
# there at 16384 x 4096 x 8192, the shape it would have flipped.
BLOCK_LONG_K_SPEED = {(256, 3, True, 1): 0.98}
CANDIDATES = {False: [(256, 3, False, 1), (256, 3, False, 2), (128, 6, False, 2)],
              True: [(192, 4, True, 1), (256, 3, True, 1), (128, 6, True, 1),
                     (256, 3, True, 2)]}
SMEM_MAX = 232448  # bytes of dynamic shared memory a block may have on sm_90
_ATOM = {("e4m3", "e4m3"): "E4M3E4M3", ("e5m2", "e4m3"): "E5M2E4M3",
         ("e4m3", "e5m2"): "E4M3E5M2"}
_OUT = ("float", "__half", "__nv_bfloat16")
_OUT_DTYPES = frozenset(map(np.dtype, ("float32", "float16", bfloat16)))
# Block scaling (kernels/block_scaling.py): fp8_block_gemm_pipe_tn, every block factor from
# shared memory (no global load in the mainloop: the A factors come with each stage; B's
# with 128x128 blocks in a per-tile table, with 1x128 blocks with each stage), instead of
# fp8_block_gemm_tn: H100, 128x128 B, the six bench shapes, 0.90-1.00x the per-tensor split
# GEMM (geomean 0.95) against 0.78-0.91x (0.84) for the other kernel (PERFLOG.md, session
# 17). On by default; TECUPY_BLOCK_PIPELINE=0 turns it off.
BLOCK_PIPELINE = os.environ.get("TECUPY_BLOCK_PIPELINE", "1") != "0"


def kernel_name(a_fmt, b_fmt, out, epi, accumulate, config, scale=0, pipe=False, wait=False):
    """epi: 0 plain, 1 + bias, 2 gelu(+ bias) with the pre-gelu values as a second output,
    3 gelu's backward (D * gelu'(aux + bias), aux read), 4 the residual add (T(T(D) + aux),
    aux read; its rows prefetched into L2 during the tile's mainloop), 5 the same with the
    bias (T(T(D + bias) + aux)), 6 and 7: 4 and 5 without the prefetch. scale: 0 per-tensor
    scales, else block scaling (kernels/block_scaling.py) with B's blocks 1x128 (1) or
    128x128 (2): fp8_block_gemm_tn, split accumulation, no cluster; pipe:
    fp8_block_gemm_pipe_tn, its factors from shared memory (BLOCK_PIPELINE); wait:
    fp8_gemm_tn_wait, A's rows arriving in chunks while it runs (gemm_chunked)."""
    bn, stages, promote, cluster = config
    atom_n = bn // 2 if promote and bn > 192 else bn  # split: acc + a full part > 232 regs
    atom = f"tc::MMA_64x{atom_n}x32_F32{_ATOM[(a_fmt, b_fmt)]}_SS_TN<>"
    if scale:
        assert promote and cluster == 1, "block scaling: split accumulation, no cluster"
        entry = "fp8_block_gemm_pipe_tn" if pipe else "fp8_block_gemm_tn"
        return (f"tc::{entry}<{bn}, {stages}, {atom}, {out}, {int(epi)}, "
                f"{cbool(accumulate)}, {scale}>")
    assert not wait or cluster == 1, "the chunk waits: no cluster"
    entry = ("fp8_gemm_tn_wait" if wait else "fp8_gemm_tn" if cluster == 1
             else f"fp8_gemm_tn_cluster{cluster}")
    return (f"tc::{entry}<{bn}, {stages}, {atom}, {out}, {int(epi)}, {cbool(accumulate)}, "
            f"{cbool(promote)}>")


def _names():
    for fmts in _ATOM:
        for split in (False, True):
            for config, _ in DEFAULTS[split]:
                for out in _OUT:
                    for epi in (0, 1):
                        yield kernel_name(*fmts, out, epi, False, config)
                yield kernel_name(*fmts, "float", 0, True, config)
        for out in _OUT:  # gelu: forward GEMMs, fast accumulation
            yield kernel_name(*fmts, out, 2, False, CONFIGS[False])
        for config, _ in DEFAULTS[True]:  # gelu's backward: dgrad GEMMs, split accumulation
            for out in _OUT[1:]:
                yield kernel_name(*fmts, out, 3, False, config)
        for out in FP8TYPE.values():  # FP8 output: forward GEMMs, fast accumulation
            for epi in (0, 1):
                yield kernel_name(*fmts, out, epi, False, CONFIGS[False])
    # the residual add in the epilogue (4 none, 5 bias): forward GEMMs (E4M3 codes, fast
    # accumulation) with a 16-bit output, as the layer's proj and fc2 run
    for config, _ in DEFAULTS[False]:
        for out in _OUT[1:]:
            for epi in (4, 5):
                yield kernel_name("e4m3", "e4m3", out, epi, False, config)
            # gemm_chunked: sequence parallel's gathered norm codes (qkv, fc1) as they land
            for epi in (0, 1):
                yield kernel_name("e4m3", "e4m3", out, epi, False, config, wait=True)
    for config, _ in DEFAULTS[True]:  # and fc2's dgrad on dy's gathered codes (E5M2: HYBRID)
        for fmts in (("e5m2", "e4m3"), ("e4m3", "e4m3")):
            for out in _OUT[1:]:
                yield kernel_name(*fmts, out, 0, False, config, wait=True)


loader.declare(FILE, list(_names()), archs=("sm_90a",), options=OPTIONS)


def smem_bytes(config, staging=True, scale=0, pipe_k=None):
    """Stages of A and B tiles, the output staging buffer of 16-bit outputs, [block scaling
    with 1x128 B (scale 1): BN float factors per stage], barriers, [the pipelined block
    kernel for K = pipe_k: BM float A factors per stage, then with 128x128 B (scale 2) two
    tables of 2 rows of B factors (the k-blocks' count rounded up to 4 floats each) and
    their four barriers]."""
    bn, stages = config[:2]
    nk4 = -(-pipe_k // (4 * BK)) * 4 if pipe_k is not None else 0
    tables = 2 * 2 * nk4 * 4 + 4 * 8 if pipe_k is not None and scale == 2 else 0
    pipe = 0 if pipe_k is None else stages * BM * 4 + tables
    return (stages * (BM + bn) * BK + (2 * 64 * bn * 2 if staging else 0)
            + (stages * bn * 4 if scale == 1 else 0) + 2 * stages * 8 + pipe)


def tma_store(out_dtype, act, accumulate, bn):
    """Whether the kernel's epilogue stages D in shared memory for TMA stores (as the
    template decides: 16-bit D, no gelu (aux) (the residual add is staged), no
    accumulation, 64-column boxes)."""
    return (np.dtype(out_dtype).itemsize == 2 and act in (None, *_RESIDUAL_EPI)
            and not accumulate and bn % 64 == 0)


# the residual epilogue's act names -> EPI without a bias (+ 1 with one); RESIDUAL_PREFETCH
# picks (the L2 prefetch of the residual's rows by the producer, or none: to time it)
_RESIDUAL_EPI = {"residual": 4, "residual, no prefetch": 6}
RESIDUAL_PREFETCH = True


_warned = []


def supported(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias=None, out=None,
              accumulate=False, split_accumulator=False, out_scale=None, amax_out=None,
              gelu=False, dgelu_aux=None, residual=None):
    if not (is_cupy(a) and is_cupy(b) and (a_fmt.name, b_fmt.name) in _ATOM):
        return False
    if not hopper():
        if not _warned:
            _warned.append(True)
            warnings.warn("tecupy: the FP8 GEMM kernel needs a Hopper GPU (sm_90); FP8 GEMMs "
                          "run on the reference (decode to float32, then cuBLAS), which is "
                          "correct but slow", RuntimeWarning, stacklevel=2)
        return False
    if a.ndim != 2 or b.ndim != 2:
        return False
    if not _built_for(out_dtype, None if bias is None else bias.dtype, out is None,
                      accumulate, split_accumulator, gelu, dgelu_aux is None,
                      residual is None):
        return False
    if residual is not None and not _residual_ok(residual, out_dtype, a.shape[0], b.shape[0]):
        return False
    if dgelu_aux is not None and not (
            (out is None or out is dgelu_aux)  # (in place: each element read first)
            and is_cupy(dgelu_aux) and dgelu_aux.dtype == np.dtype(out_dtype)
            and dgelu_aux.flags.c_contiguous and dgelu_aux.shape == (a.shape[0], b.shape[0])):
        return False
    if bias is not None and not is_cupy(bias):
        return False
    # TMA: 16-byte aligned bases and row strides (K codes; N values of a 16-bit D)
    k = a.shape[1]
    ok = b.shape[1] == k and k % 16 == 0 and k > 0 and b.shape[0] % 8 == 0
    return ok and _tma_ok(a) and _tma_ok(b) and (out is None or _tma_ok(out))


def _residual_ok(r, out_dtype, m, n):
    """The residual the epilogue reads as D's pairs: a contiguous CuPy [M, N] array of D's
    (16-bit) dtype, 4-byte aligned; anything else runs on the reference."""
    return (is_cupy(r) and r.dtype == out_dtype and r.shape == (m, n)
            and r.flags.c_contiguous and r.data.ptr % 4 == 0)


_built = {}  # _built_for's answers: supported() runs on every call


def _built_for(out_dtype, bias_dtype, no_out, accumulate, split, gelu, no_dgelu,
               no_residual=True):
    """Whether a kernel is built for this output, bias dtype and epilogue (what does not
    depend on the arrays themselves), kept per combination."""
    key = (out_dtype, bias_dtype, no_out, accumulate, split, gelu, no_dgelu, no_residual)
    ok = _built.get(key)
    if ok is None:
        if isinstance(out_dtype, FP8Format):
            ok = not split and no_out and not accumulate and not gelu
        else:
            ok = np.dtype(out_dtype) in _OUT_DTYPES
        ok = ok and not (gelu and (split or accumulate))
        if not no_dgelu:  # built for dgrad: split accumulation, a 16-bit D, no more
            ok = (ok and split and not (gelu or accumulate) and not isinstance(
                out_dtype, FP8Format) and np.dtype(out_dtype).itemsize == 2)
        if bias_dtype is not None:  # the epilogue's bias type (bias_t) holds it exactly
            ok = ok and _bias_fits(bias_dtype, out_dtype)
        ok = ok and (not accumulate or (not no_out and np.dtype(out_dtype) == np.float32))
        if not no_residual:  # built for forward GEMMs: a fresh 16-bit D, fast accumulation
            ok = (ok and no_out and not (split or gelu or accumulate) and no_dgelu
                  and not isinstance(out_dtype, FP8Format)
                  and np.dtype(out_dtype).itemsize == 2)
        _built[key] = ok
    return ok


def _tma_ok(t):
    """t contiguous at a 16-byte aligned address (a call each: a generator costs ~1 us)."""
    return t.flags.c_contiguous and t.data.ptr % 16 == 0


def bias_dtype(out_dtype):
    """The dtype the epilogue reads the bias in (the template's bias_t): a 16-bit D's own
    (bf16 or half: exact in float32, so the sums are those of a float32 copy, without a copy
    per call), else float32."""
    if isinstance(out_dtype, FP8Format):
        return _F32
    out_dtype = np.dtype(out_dtype)
    return out_dtype if out_dtype.itemsize == 2 else _F32


_F32 = np.dtype(np.float32)


def _bias_fits(dtype, out_dtype):
    """A bias of `dtype` gives the reference's sums (bias.astype(float32) added in float32):
    it is the epilogue's bias type, or that type is float32 (the wrapper copies it into
    float32, as the reference does). A float32 bias with a bf16 D would be rounded to bf16:
    refused (the reference runs it), as no kernel is built for that pair."""
    want = bias_dtype(out_dtype)
    return dtype == want or want == _F32


_descs = {}  # (address, shape, dtype, box rows) -> descriptor: three per GEMM call


def tma_desc(t, box_rows):
    """TMA descriptor of a row-major matrix t [rows, cols] (uint8 codes or a 16-bit output),
    box of 128 bytes x box_rows. Kept here by the array's own address, shape and dtype
    (tma.tma_desc's key costs a few tuples and a dtype's name more per call)."""
    key = (t.data.ptr, t.shape, t.dtype, box_rows)
    desc = _descs.get(key)
    if desc is None:
        if len(_descs) > 512:  # many addresses: start over rather than grow
            _descs.clear()
        desc = _descs[key] = tma_encode(t.data.ptr, t.dtype, (t.shape[1], t.shape[0]),
                                        (t.shape[1] * t.itemsize,),
                                        (128 // t.itemsize, box_rows))
    return desc


@backends.register("fp8_gemm", "cutlass", supports=supported)
def fp8_gemm(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias=None, out=None,
             accumulate=False, split_accumulator=False, out_scale=None, amax_out=None,
             gelu=False, dgelu_aux=None, residual=None):
    """dgelu_aux: [M, N] in out_dtype, the values gelu saw in the forward: D becomes
    T(D) * gelu'(dgelu_aux + bias) (bias None: 0), the epilogue of gelu's backward; out may
    be dgelu_aux itself (written in place). residual: [M, N] in out_dtype: D becomes
    T(T(D (+ bias)) + residual), the GEMM then the residual add, bit for bit."""
    _check_fp8_out(out_dtype, out_scale, amax_out)
    m, k = a.shape
    n = b.shape[0]
    act = ("dgelu" if dgelu_aux is not None else "gelu" if gelu else None if residual is None
           else "residual" if RESIDUAL_PREFETCH else "residual, no prefetch")
    # the configuration per shape (tuned, else the default), kept with the launch plan:
    # the table's version changes with every remember()
    key = (m, n, k, a_fmt.name, b_fmt.name, split_accumulator, out_dtype, bias is None,
           accumulate, act, current_device(), backends._env("TECUPY_CACHE_DIR"), _version[0],
           launch_module.margin())
    plan = planned(_plans, key, _shape_plan, m, n, k, a_fmt, b_fmt, split_accumulator,
                   out_dtype, bias is None, accumulate, act)
    return _run(plan, a, a_scale_inv, b, b_scale_inv, bias, out, out_scale, amax_out,
                residual if dgelu_aux is None else dgelu_aux)


def _shape_plan(m, n, k, a_fmt, b_fmt, split, out_dtype, no_bias, accumulate, act):
    config = tuple(_tuned().get(_tune_key(m, n, k, a_fmt.name, b_fmt.name, split), ()))
    if config not in CANDIDATES[split]:  # not tuned, or a stale table entry
        config = default_config(m, n, split, k=k)
    return _plan(config, a_fmt, b_fmt, out_dtype, no_bias, accumulate, act, m, n, k)


_defaults = {}  # (M, N, split, SMs, K <= SHORT_K, block) -> config


def default_config(m, n, split, sms=None, k=None, block=False):
    """The default configuration for an M x N output (see DEFAULTS), with K where the
    caller knows it (SHORT_K); block: for the block-scaled kernel with 128x128 B
    (BLOCK_LONG_K_SPEED)."""
    sms = sms or sm_count()
    short = k is not None and k <= SHORT_K
    block = bool(block) and k is not None and not short
    key = (m, n, split, sms, short, block)
    if key not in _defaults:
        def cost(item):
            config, speed = item
            if short:
                speed = SHORT_K_SPEED.get(config, speed)
            elif block:
                speed = BLOCK_LONG_K_SPEED.get(config, speed)
            tiles = -(-m // BM) * -(-n // config[0])
            return -(-tiles // sms) * config[0] / speed, -config[0]
        _defaults[key] = min(DEFAULTS[split], key=cost)[0]
    return _defaults[key]


def launch(config, a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias, out=None,
           accumulate=False, out_scale=None, amax_out=None, gelu=False):
    """Run the kernel of `config` (BN, stages, promote, cluster)."""
    _check_fp8_out(out_dtype, out_scale, amax_out)
    gelu = "gelu" if gelu else None
    (m, k), n = a.shape, b.shape[0]
    key = (config, a_fmt.name, b_fmt.name, out_dtype, bias is None, accumulate, gelu, m, n, k,
           current_device(), launch_module.margin())
    plan = planned(_plans, key, _plan, config, a_fmt, b_fmt, out_dtype, bias is None,
                   accumulate, gelu, m, n, k)
    return _run(plan, a, a_scale_inv, b, b_scale_inv, bias, out, out_scale, amax_out)


# fp8_gemm_tn_wait's Chunks argument: ready (a pointer), rows, rot (int32), limit_ns (uint64)
_CHUNKS = struct.Struct("<QiiQ")
WAIT_LIMIT_S = 300.0  # a chunk later than this: the kernel traps (a dead peer, not a slow one)


def gemm_chunked(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias, ready,
                 chunk_rows, first, split_accumulator=False, gelu=False, out=None,
                 limit_s=WAIT_LIMIT_S):
    """fp8_gemm (per-tensor scales) while A's rows [M, K] arrive in chunks of chunk_rows rows
    (an all-gather's, pushed by peers' copy engines, which take no SM from it):
    ready (uint32 CuPy array, one flag per chunk) holds nonzero once chunk c is in memory;
    the tiles of chunk `first` (present at the launch) run first, then the others in order,
    each once its flag is set. The caller resets the flags after the call (the kernel only
    reads them). The same tiles, kernel body and sums as fp8_gemm with that configuration:
    the same bits. A flag still 0 after limit_s seconds makes the kernel trap (the CUDA
    context is then lost: a dead peer ends the process with an error, never a hang)."""
    import cupy
    m, k = a.shape
    n = b.shape[0]
    chunks = m // chunk_rows if chunk_rows > 0 else 0
    if chunk_rows <= 0 or chunk_rows % BM or m % chunk_rows or not 1 <= chunks <= 32:
        raise ValueError(f"gemm_chunked: chunk_rows must divide M = {m} into 1 to 32 chunks of "
                         f"a multiple of {BM} rows, got {chunk_rows}")
    if (not isinstance(ready, cupy.ndarray) or ready.dtype != np.uint32 or ready.size < chunks
            or not ready.flags.c_contiguous):
        raise TypeError(f"gemm_chunked: ready must be a contiguous uint32 CuPy array of at "
                        f"least {chunks} flags, got {ready!r:.80}")
    if not 0 <= first < chunks:
        raise ValueError(f"gemm_chunked: first must be a chunk index in [0, {chunks}), "
                         f"got {first}")
    if not supported(a, a_fmt, a_scale_inv, b, b_fmt, b_scale_inv, out_dtype, bias, out,
                     split_accumulator=split_accumulator, gelu=gelu):
        raise ValueError("gemm_chunked: these operands are not ones fp8_gemm's kernel takes")
    _check_fp8_out(out_dtype, None, None)
    act = "gelu" if gelu else None
    config = default_config(m, n, split_accumulator, k=k)
    key = ("wait", config, a_fmt.name, b_fmt.name, out_dtype, bias is None, act, m, n, k,
           current_device(), launch_module.margin())
    plan = planned(_plans, key, _plan, config, a_fmt, b_fmt, out_dtype, bias is None, False,
                   act, m, n, k, 0, False, launch_module.PDL, True)
    packed = _CHUNKS.pack(ready.data.ptr, chunk_rows, first * chunk_rows // BM,
                          int(limit_s * 1e9))
    return _run(plan, a, a_scale_inv, b, b_scale_inv, bias, out, None, None, chunks=packed)


_plans = {}  # launch plans (launch.planned): what a call of one shape and kind launches
_plan_ids = itertools.count()


def _check_fp8_out(out_dtype, out_scale, amax_out):
    if isinstance(out_dtype, FP8Format) and (out_scale is None or amax_out is None):
        raise ValueError("fp8_gemm: an FP8 output needs out_scale and amax_out (float32 (1,))")



def _plan(config, a_fmt, b_fmt, out_dtype, no_bias, accumulate, act, m, n, k, scale=0,
          pipe=False, pdl=True, wait=False):
    """(kernel, grid, shared bytes, staged output?, output dtype, BN, act, bias dtype, the
    kernel's int32 M, N, K, a number naming the plan, its Launcher) of `config` for an
    M x N output, K deep; act: None, "gelu" (forward), "dgelu" (gelu's backward) or
    "residual" (the residual add; "residual, no prefetch": without the L2 prefetch); scale,
    pipe: kernel_name's (0 per tensor, 1 or 2 block scaling; the pipelined block kernel);
    pdl False: launched without PDL even where launch_module.PDL is on; wait: the chunk
    waits' kernel (gemm_chunked: one more argument, no cluster)."""
    bn, cluster = config[0], config[3]
    if wait or -(-n // bn) % cluster:
        config = config[:3] + (1,)
        cluster = 1
    fp8_out, bias_of = isinstance(out_dtype, FP8Format), out_dtype
    ctype = FP8TYPE[out_dtype.name] if fp8_out else CTYPE[np.dtype(out_dtype)]
    out_dtype = np.dtype(np.uint8) if fp8_out else np.dtype(out_dtype)
    epi = {"gelu": 2, "dgelu": 3}.get(act, _RESIDUAL_EPI.get(act, 0) + int(not no_bias))
    name = kernel_name(a_fmt.name, b_fmt.name, ctype, epi, accumulate, config, scale, pipe,
                       wait)
    staged = not fp8_out and tma_store(out_dtype, act, accumulate, bn)
    smem = smem_bytes(config, staged, scale, k if pipe else None)
    if name not in loader.declared().get(FILE, ()):  # a tuned config's kernel
        loader.declare(FILE, [name], archs=("sm_90a",), options=OPTIONS)
    fn = loader.function(FILE, name)
    # (per kernel and device, raised only: the pipelined block kernel's shared bytes grow
    # with K, and one plan lowering it under another's made that one's launches fail)
    opt_in_smem(fn, smem)
    units = -(-m // BM) * -(-n // bn) // cluster  # tiles, or pairs of tiles in a cluster
    sms = max(cluster, sm_count() - launch_module.margin())  # (the plan's key holds margin)
    grid = (min(units, sms // cluster) * cluster,)
    return (fn, grid, smem, staged, out_dtype, bn, act, bias_dtype(bias_of),
            (np.int32(m), np.int32(n), np.int32(k)), next(_plan_ids),
            Launcher(fn, grid, (THREADS,), _kinds() + ((_CHUNKS.size,) if wait else ()), smem,
                     pdl=pdl and launch_module.PDL))


def _kinds():
    """The kernel's argument types: scale_inv_a, scale_inv_b, bias, scale_out, amax_out, d,
    aux (pointers), M, N, K (int32), the 3 TMA descriptors (128 bytes each)."""
    import cupy
    return (cupy.ndarray,) * 7 + (np.int32,) * 3 + (bytes,) * 3


def _run(plan, a, a_scale_inv, b, b_scale_inv, bias, out, out_scale, amax_out,
         aux_in=None, chunks=None):
    import cupy
    fn, grid, smem, staged, out_dtype, bn, act, b_dtype, (m32, n32, k32), plan_id, run = plan
    m, n = a.shape[0], b.shape[0]
    if out is None:
        out = cupy.empty((m, n), out_dtype)
    elif out.shape != (m, n) or out.dtype != out_dtype or not out.flags.c_contiguous:
        raise ValueError(f"fp8_gemm: out must be a contiguous {out_dtype} array of shape "
                         f"{(m, n)}, got {out.dtype} {out.shape}")
    # unused pointers get a_scale_inv: the kernel neither reads nor writes them
    if bias is not None:
        bias = _bias_arg(bias, b_dtype)
    elif act == "dgelu":  # EPI 3 reads its bias
        bias = cupy.zeros((n,), b_dtype)
    else:
        bias = a_scale_inv
    out_scale = a_scale_inv if out_scale is None else out_scale
    amax_out = a_scale_inv if amax_out is None else amax_out
    # gelu: the pre-gelu values come out here; dgelu: they are read, as the residual is;
    # else out is a stand-in
    aux = cupy.empty_like(out) if act == "gelu" else out if act is None else aux_in
    packed, arrays = _gemm_descs(plan_id, a, b, out, bn, staged)
    args = (a_scale_inv, b_scale_inv, bias, out_scale, amax_out, out, aux, m32, n32, k32)
    if chunks is not None:  # (gemm_chunked: its plan's Launcher takes them; never CuPy's)
        run(args + packed + (chunks,))
    elif CTYPES_LAUNCH:
        run(args + packed)
    else:
        fn(grid, (THREADS,), args + arrays, shared_mem=smem)
    return (out, aux) if act == "gelu" else out


# The launch: through cuLaunchKernelEx with the plan's Launcher (arguments packed by its
# struct, the descriptors as bytes; with the PDL attribute where launch_module.PDL was on
# when the plan was made: the kernel waits with griddepcontrol.wait), or CuPy's launch
# (which converts every argument per call): scripts/linear_host.py times both on the GPU.
CTYPES_LAUNCH = True
_gemm_desc_sets = {}  # (plan number, addresses of A, B, D) -> the call's 3 TMA descriptors,
#                     as bytes (the Launcher's 128-byte arguments) and as NumPy (CuPy's)


def _gemm_descs(plan_id, a, b, out, bn, staged):
    """The TMA descriptors of A, B and D (A again where D is not staged: unused) of one
    call: a plan fixes their shapes, dtypes and boxes, so the addresses name them: one
    lookup of 4 ints (three tma_desc keys cost a tuple and a dtype hash each)."""
    key = (plan_id, a.data.ptr, b.data.ptr, out.data.ptr)
    descs = _gemm_desc_sets.get(key)
    if descs is None:
        if len(_gemm_desc_sets) > 512:  # many addresses: start over rather than grow
            _gemm_desc_sets.clear()
        da = tma_desc(a, BM)
        arrays = (da, tma_desc(b, bn), tma_desc(out, 64) if staged else da)
        descs = _gemm_desc_sets[key] = (tuple(d.tobytes() for d in arrays), arrays)
    return descs


def _bias_arg(bias, dtype):
    """The bias as the epilogue reads it: itself when it is of the kernel's bias type and
    contiguous (the FP8 linears' case: no copy, no launch), else a contiguous copy in that
    type (exact or as the reference rounds it: supported() refuses the rest)."""
    if bias.dtype == dtype and bias.flags.c_contiguous:
        return bias
    import cupy
    return cupy.ascontiguousarray(bias.astype(dtype, copy=False))


# ---- the tuned table: tecupy.gemm.tune's winners (it times the candidates), on disk ----
_tuned_cache = {}  # TECUPY_CACHE_DIR's value -> {shape key: config}
_version = [0]  # remember() calls so far


def _tune_file():
    return loader.cache_dir() / "fp8_gemm_tuned.json"


def _tune_key(m, n, k, a_fmt, b_fmt, split):
    return f"{m},{n},{k},{a_fmt},{b_fmt},{'split' if split else 'fast'}"


def _tuned():
    """The remembered winners, read once per process (remember() updates them in place; no
    file access, not even a path built and its folder made, on the GEMM's hot path)."""
    where = os.environ.get("TECUPY_CACHE_DIR")
    if where not in _tuned_cache:
        path = _tune_file()
        _tuned_cache[where] = json.loads(path.read_text()) if path.exists() else {}
    return _tuned_cache[where]


def remember(m, n, k, a_fmt, b_fmt, split, config):
    """Make `config` the choice of every later call of this shape, format pair (names) and
    accumulation: in this process's table and in TECUPY_CACHE_DIR/fp8_gemm_tuned.json
    (written whole under another name, then renamed: no reader sees half a file)."""
    table = _tuned()
    table[_tune_key(m, n, k, a_fmt, b_fmt, split)] = list(config)
    _version[0] += 1  # the launch plans made from the table are stale
    tmp = _tune_file().with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    tmp.replace(_tune_file())

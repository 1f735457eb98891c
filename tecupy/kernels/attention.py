"""CUDA fused attention: cuda/attention.cu (FlashAttention-2 scheme on mma.sync, every
sm_80+ GPU) and, on Hopper, cuda/attention_sm90.cu (forward and backward on TMA and wgmma,
the FlashAttention-3 scheme; attention dropout runs on mma.sync).

attention_fwd -> (o, lse); attention_bwd -> (dq, dk, dv), the reference's signatures
(reference/attention.py; the mask a Mask: causal picks the kernel's template, padding passes
the lengths or null pointers). bf16/fp16, head dim 64 or 128, shapes bshd; other inputs fall
back to the reference (supports() declines them, and a softmax scale <= 0). The kernels
take each operand's batch and sequence strides, so sbhd views and the q/k/v slices of a
packed projection are read in place (no copies); outputs are laid out in memory as the
matching input is (sequence-major for sbhd).

The backward adds each KV block's part of dQ into a float32 buffer with float reductions
(on Hopper, TMA reductions from shared memory), whose order varies between runs: dq is not
bit-reproducible at large sizes (dk and dv are). deterministic() picks the kernels'
deterministic mode instead, where the KV blocks add in a fixed order (turn counters,
FlashAttention-3's deterministic backward): dq bit-identical from run to run and between
eager calls and CUDA-graph replays, for a slower backward (forward + backward at b4 h32
s2048 d128 on an H100: causal +18%, no mask +33%; README).
"""
import itertools

import numpy as np

from .. import backends, loader
from .._array import bfloat16, is_cupy
from ..graphs import seed_pointer
from .dtypes import CTYPE, cbool
from .launch import Launcher, current_device, grid_1d, hopper, opt_in_smem, planned
from .tma import tma_desc

FILE, SM90_FILE = "attention.cu", "attention_sm90.cu"
_TYPES = [CTYPE[np.dtype(np.float16)], CTYPE[bfloat16]]
HEAD_DIMS = (64, 128)
FWD_BM, BWD_BM = 128, 64
# Forward variants: "sm90" (attention_sm90.cu; Hopper, no dropout: elsewhere the next
# variant runs), or mma.sync's (K/V tile rows, 16-row tiles per warp, Q fragments kept in
# registers): 4 warps x 32 rows re-reading Q from shared memory, two blocks per SM (8%
# faster at b4 h32 s2048 d128 on an H200 than 8 warps x 16 rows with Q in registers). The
# tests check each; the bench times each with TECUPY_BENCH_VARIANTS=1.
FWD_VARIANTS = ("sm90", (64, 2, False), (64, 1, True))
BWD_WARPS = 8  # warps of 16 KV rows per backward block (4 was 10% slower)
# Backward: "sm90" (attention_sm90.cu; Hopper, no dropout) or "mma" (attention.cu).
BWD_VARIANTS = ("sm90", "mma")
# "deterministic": None follows the environment (deterministic()), True / False overrides it.
# "sm90_options": extra NVRTC options of attention_sm90.cu's kernels, e.g. ("-DATTN_DQ_TMA=0",)
# (the backward's dQ by reductions from registers) to time a variant against the default in
# one process; the plans are keyed by them.
CONFIG = {"fwd": FWD_VARIANTS[0], "bwd": BWD_VARIANTS[0], "deterministic": None,
          "sm90_options": ()}
SM90_BM, SM90_STAGES = 128, 2  # query rows per forward block, K/V buffers (3 was 5% slower)
# causal? -> keys per forward tile (176 was 0-4% faster than 128 without a mask, H200)
SM90_BN = {False: 176, True: 128}
SM90_BWD_BM, SM90_BWD_BN = 64, 128  # query rows per step, keys per block


def _fwd_name(t, d, variant, causal, dropout):
    bn, mw, qreg = variant
    return (f"attention_fwd<{t}, {d}, {bn}, {mw}, {cbool(qreg)}, {cbool(causal)}, "
            f"{cbool(dropout)}>")


def _bwd_name(t, d, causal, dropout, det):
    return (f"attention_bwd<{t}, {d}, {BWD_WARPS}, {cbool(causal)}, {cbool(dropout)}, "
            f"{cbool(det)}>")


def _sm90_name(t, d, bn, causal):
    return f"attention_fwd_sm90<{t}, {d}, {bn}, {cbool(causal)}, {SM90_STAGES}>"


def _sm90_bwd_name(t, d, causal, det):
    return f"attention_bwd_sm90<{t}, {d}, {cbool(causal)}, {cbool(det)}>"


def _declare():
    names = [f"attention_bwd_dot<{t}, {d}>" for t in _TYPES for d in HEAD_DIMS]
    names += [f"attention_convert<{t}>" for t in _TYPES]
    for t, d, c, r in itertools.product(_TYPES, HEAD_DIMS, (False, True), (False, True)):
        names += [_fwd_name(t, d, v, c, r) for v in FWD_VARIANTS[1:]]
        names += [_bwd_name(t, d, c, r, det) for det in (False, True)]
    loader.declare(FILE, names)
    sm90 = [f"attention_bwd_prep_sm90<{t}, {d}>" for t in _TYPES for d in HEAD_DIMS]
    for t, d, c in itertools.product(_TYPES, HEAD_DIMS, (False, True)):
        sm90 += [_sm90_name(t, d, SM90_BN[c], c)]
        sm90 += [_sm90_bwd_name(t, d, c, det) for det in (False, True)]
    # -default-device: the forward's step is a lambda (NVRTC has no host code)
    loader.declare(SM90_FILE, sm90, archs=("sm_90a",), options=("-default-device",))


_declare()


def deterministic():
    """Whether the backward adds dQ in a fixed order (bit-identical runs, a slower backward):
    CONFIG["deterministic"] unless None, else TECUPY_DETERMINISTIC when set (0 or 1), else
    Transformer Engine's NVTE_ALLOW_NONDETERMINISTIC_ALGO=0. Default: no (TE's default, the
    fast float reductions). Read at every call (a capture keeps the kernel it recorded)."""
    if CONFIG["deterministic"] is not None:
        return bool(CONFIG["deterministic"])
    own = backends._env("TECUPY_DETERMINISTIC").strip()
    if own:
        return own != "0"
    return backends._env("NVTE_ALLOW_NONDETERMINISTIC_ALGO").strip() == "0"


def _ok(t, like):
    return is_cupy(t) and t.dtype == like.dtype


def _supports(q, k, v, scale=1.0, *rest):
    b, sq, h, d = q.shape
    return (scale > 0 and _ok(q, q) and q.dtype in (np.dtype(np.float16), bfloat16)
            and _ok(k, q)
            and _ok(v, q) and d in HEAD_DIMS and min(b, sq, k.shape[1]) > 0
            and max(q.size, k.size) < 2**31 and b * h * sq * k.shape[1] < 2**62)


def _supports_bwd(do, q, k, v, o, lse, scale, *rest):
    return _supports(q, k, v, scale) and _ok(do, q) and _ok(o, q)


def _function(name, smem, file=FILE):
    fn = loader.function(file, name, _options(file))
    opt_in_smem(fn, smem)
    return fn


def _options(file):
    """CONFIG["sm90_options"] for attention_sm90.cu's kernels, none for the others."""
    return tuple(CONFIG["sm90_options"]) if file == SM90_FILE else ()


def _dq_tma():
    """Whether attention_sm90.cu's backward takes dq_acc's TMA descriptor as its last
    argument and adds dQ by TMA reductions from shared staging tiles (deterministic: in
    turns) (its ATTN_DQ_TMA: on unless CONFIG["sm90_options"] turns it off)."""
    return "-DATTN_DQ_TMA=0" not in CONFIG["sm90_options"]


def _lengths(mask, seqlens_q, seqlens_kv):
    """int32 device arrays of the padding lengths, or null pointers."""
    import cupy
    if not mask.padding:
        return np.uint64(0), np.uint64(0)
    lq = cupy.ascontiguousarray(cupy.asarray(seqlens_q), dtype=np.int32)
    lkv = lq if seqlens_kv is None else cupy.ascontiguousarray(cupy.asarray(seqlens_kv),
                                                                 dtype=np.int32)
    return lq, lkv


def _strided(t):
    """t itself when the kernels can read it in place (d contiguous, heads d apart,
    16-byte aligned rows and base), else a contiguous copy."""
    import cupy
    size = t.itemsize
    ok = (t.strides[3] == size and t.strides[2] == t.shape[3] * size
          and t.data.ptr % 16 == 0 and t.strides[0] % 16 == 0 and t.strides[1] % 16 == 0)
    return t if ok else cupy.ascontiguousarray(t)


def _strides(t):
    """(batch, sequence) strides of a bshd-shaped array, in elements."""
    return np.int64(t.strides[0] // t.itemsize), np.int64(t.strides[1] // t.itemsize)


def _empty_as(t, dtype=None, alloc=None):
    """A new bshd-shaped array whose memory is sequence-major where t's is (sbhd); alloc is
    cupy.empty (default) or cupy.zeros (a memset, cheaper than a fill kernel)."""
    import cupy
    dtype, alloc = t.dtype if dtype is None else dtype, alloc or cupy.empty
    if t.shape[0] > 1 and t.strides[1] > t.strides[0]:
        return alloc((t.shape[1], t.shape[0]) + t.shape[2:], dtype).transpose(1, 0, 2, 3)
    return alloc(t.shape, dtype)


def _grad_buffers(q, k, v):
    """dq, dk, dv, each laid out as its input. When q, k, v are adjacent head slices of one
    contiguous array (the layer's split of the packed qkv projection), the gradients are the
    same slices of one new array, so the split's backward joins them without a copy."""
    import cupy
    base, d, size = q.base, q.shape[3], q.itemsize
    packed = (base is not None and k.base is base and v.base is base and base.flags.c_contiguous
              and q.data.ptr == base.data.ptr and q.strides == k.strides == v.strides
              and k.data.ptr == q.data.ptr + q.shape[2] * d * size
              and v.data.ptr == k.data.ptr + k.shape[2] * d * size
              and v.data.ptr + v.shape[2] * d * size - q.data.ptr == min(q.strides[:2]))
    if not packed:
        return _empty_as(q), _empty_as(k), _empty_as(k)
    buf = cupy.empty(base.shape, base.dtype)
    return tuple(cupy.ndarray(t.shape, t.dtype, buf.data + (t.data.ptr - q.data.ptr), t.strides)
                 for t in (q, k, v))


def _dropout_args(p, seed):
    """(p, 1 / (1 - p), seed, seed_ptr) as the kernels take them. seed is None (no dropout:
    unused) or in [0, 2**64), checked by dot_product_attention, so np.uint64 cannot
    overflow; seed_ptr: graphs.seed_pointer (a captured step reads its seed on the GPU)."""
    factor = np.float32(1 / (1 - p))  # rounded as the reference rounds it
    return np.float32(p), factor, np.uint64(seed or 0), seed_pointer(seed)


def _tma(t, rows):
    """TMA descriptor of a bshd-shaped operand: dims (d, heads, sequence, batch), boxes of
    128 bytes of columns (64 16-bit values, 32 float32) x `rows` rows of one head. A dim of
    size 1 may have stride 0 (x[None]): only its index 0 is read, so it gets the head stride
    instead (TMA takes no zero stride)."""
    b, s, h, d = t.shape
    head = d * t.itemsize
    strides = [st if n > 1 else head for n, st in ((s, t.strides[1]), (b, t.strides[0]))]
    return tma_desc(t.data.ptr, t.dtype, (d, h, s, b), (head, *strides),
                    (128 // t.itemsize, 1, rows, 1))


# Launch plans of the Hopper kernels (issue 21: the wrappers' Python was 80 us per forward
# and 170 per backward on an H100 host): kernel, grid, shared bytes, a Launcher (arguments
# struct-packed, cuLaunchKernelEx; the kernels have no PDL wait) and the constant arguments,
# by everything they are chosen from. The TMA descriptors are kept per plan and addresses.
_plans = {}
_descs = {}
_plan_ids = itertools.count()


def _sm90_descs(plan_id, operands):
    """The TMA descriptors (bytes) of `operands` ((array, box rows) pairs) for one plan:
    its shapes fix everything but the addresses, which name them."""
    key = (plan_id, *(t.data.ptr for t, _ in operands))
    descs = _descs.get(key)
    if descs is None:
        if len(_descs) > 512:  # many addresses: start over rather than grow
            _descs.clear()
        descs = _descs[key] = tuple(_tma(t, rows).tobytes() for t, rows in operands)
    return descs


def _fwd_plan(q, k, o, scale, causal):
    import cupy
    b, sq, h, d = q.shape
    bn = SM90_BN[causal]
    # Q tile, the K and V rings, barriers, alignment slack (the kernel's Sm90Smem)
    smem = SM90_BM * d * 2 + 2 * SM90_STAGES * bn * d * 2 + 8 * (1 + 4 * SM90_STAGES) + 1024
    fn = _function(_sm90_name(CTYPE[q.dtype], d, bn, causal), smem, SM90_FILE)
    kinds = (bytes,) * 3 + (cupy.ndarray,) * 2 + (np.uint64,) * 2 + (np.int32,) * 4 + (
        np.float32, np.int64, np.int64)
    run = Launcher(fn, (-(-sq // SM90_BM), h, b), (384,), kinds, smem, pdl=False)
    tail = (np.int32(sq), np.int32(k.shape[1]), np.int32(h), np.int32(k.shape[2]),
            np.float32(scale * np.log2(np.e)), *_strides(o))
    return run, bn, tail, next(_plan_ids)


def _fwd_sm90(q, k, v, o, lse, scale, causal, lq, lkv):
    key = (q.shape, k.shape, q.strides, k.strides, v.strides, o.strides, q.dtype, scale,
           causal, CONFIG["sm90_options"], current_device())
    run, bn, tail, pid = planned(_plans, ("fwd",) + key, _fwd_plan, q, k, o, scale, causal)
    run(_sm90_descs(pid, ((q, SM90_BM), (k, bn), (v, bn))) + (o, lse, lq, lkv) + tail)
    return o, lse


@backends.register("attention_fwd", "cuda", supports=_supports)
def attention_fwd(q, k, v, scale, mask, seqlens_q, seqlens_kv, dropout_p, seed):
    import cupy
    q, k, v = (_strided(t) for t in (q, k, v))
    b, sq, h, d = q.shape
    skv, hk = k.shape[1], k.shape[2]
    o, lse = _empty_as(q), cupy.empty((b, h, sq), np.float32)
    lq, lkv = _lengths(mask, seqlens_q, seqlens_kv)
    variant = CONFIG["fwd"]
    if variant == "sm90":
        if dropout_p == 0 and hopper():
            return _fwd_sm90(q, k, v, o, lse, scale, mask.causal, lq, lkv)
        variant = FWD_VARIANTS[1]
    bn, mw = variant[:2]
    smem = (FWD_BM + 4 * bn) * d * 2
    fn = _function(_fwd_name(CTYPE[q.dtype], d, variant, mask.causal, dropout_p > 0), smem)
    fn((-(-sq // FWD_BM), h, b), (256 // mw,),
       (q, k, v, o, lse, lq, lkv, np.int32(sq), np.int32(skv), np.int32(h), np.int32(hk),
        np.float32(scale * np.log2(np.e)), *_dropout_args(dropout_p, seed),
        *(x for t in (q, k, v, o) for x in _strides(t))), shared_mem=smem)
    return o, lse


@backends.register("attention_bwd", "cuda", supports=_supports_bwd)
def attention_bwd(do, q, k, v, o, lse, scale, mask, seqlens_q, seqlens_kv, dropout_p,
                  seed):
    import cupy
    do, q, k, v, o = (_strided(t) for t in (do, q, k, v, o))
    lse = cupy.ascontiguousarray(lse, dtype=np.float32)
    det = deterministic()
    if CONFIG["bwd"] == "sm90" and dropout_p == 0 and hopper():
        return _bwd_sm90(do, q, k, v, o, lse, scale, mask, seqlens_q, seqlens_kv, det)
    b, sq, h, d = q.shape
    skv, hk = k.shape[1], k.shape[2]
    t, rows = CTYPE[q.dtype], b * sq * h
    delta = cupy.empty((b, h, sq), np.float32)
    sem = _turn_counters(b * h * -(-sq // BWD_BM), det)
    loader.function(FILE, f"attention_bwd_dot<{t}, {d}>")(
        (-(-rows // 8),), (256,), (do, o, delta, sem, np.int64(rows), np.int32(sq),
                                   np.int32(h), *_strides(do), *_strides(o)))
    dq_acc = _empty_as(q, np.float32, cupy.zeros)
    dq, dk, dv = _grad_buffers(q, k, v)  # the kernel writes dk and dv alike
    st = np.array([x for t in (do, q, k, v, dq_acc, dk) for x in _strides(t)],
                  np.int64).view("V96")  # struct BwdStrides
    bn = 16 * BWD_WARPS
    smem = (2 * bn * d + 4 * BWD_BM * d + bn * BWD_BM) * 2 + 4 * BWD_BM * 4
    fn = _function(_bwd_name(t, d, mask.causal, dropout_p > 0, det), smem)
    lq, lkv = _lengths(mask, seqlens_q, seqlens_kv)
    fn((-(-skv // bn), hk, b), (2 * bn,),
       (do, q, k, v, lse, delta, dq_acc, sem, dk, dv, lq, lkv, np.int32(sq), np.int32(skv),
        np.int32(h), np.int32(hk), np.float32(scale), *_dropout_args(dropout_p, seed), st),
       shared_mem=smem)
    _convert_dq(dq_acc, dq)
    return dq, dk, dv


def _turn_counters(n, det):
    """The deterministic dQ's n int32 turn counters (one per batch, query head and query
    block; the kernel before the backward zeroes them), or a null pointer."""
    import cupy
    return cupy.empty(n, np.int32) if det else np.uint64(0)


def _convert_args(dq_acc, dq):
    """The launch of dq_acc [b, sq, h, d] (or sbhd) -> dq rows of h d values (row stride:
    dq's sequence or batch stride, whichever is inner): (kernel, grid, constant arguments)."""
    inner = int(min(dq.strides[:2]) // dq.itemsize)
    return (loader.function(FILE, f"attention_convert<{CTYPE[dq.dtype]}>"),
            (grid_1d(dq_acc.size, 4),), (np.int64(dq_acc.size),
                                         np.int64(dq.shape[2] * dq.shape[3]), np.int64(inner)))


def _convert_dq(dq_acc, dq):
    fn, grid, tail = _convert_args(dq_acc, dq)
    fn(grid, (256,), (dq_acc, dq) + tail)


def _bwd_plan(do, q, k, o, dq_acc, dq, dk, scale, causal, det):
    """The Hopper backward's three launches: (prep Launcher, its constant arguments, main
    Launcher, its constant arguments, convert Launcher, its constant arguments, lse2 and
    delta's shape, turn counters, plan number)."""
    import cupy
    b, sq, h, d = q.shape
    t, pad = CTYPE[q.dtype], -(-sq // SM90_BWD_BM) * SM90_BWD_BM
    rows = b * h * pad
    prep = loader.function(SM90_FILE, f"attention_bwd_prep_sm90<{t}, {d}>",
                           _options(SM90_FILE))
    nd, u64, i32, i64 = cupy.ndarray, np.uint64, np.int32, np.int64
    prep = Launcher(prep, (-(-rows // 8),), (256,),
                    (nd, nd, nd, nd, nd, u64, u64, i32, i32, i32, i64) + (i64,) * 4
                    + (nd, i64, i64), pdl=False)
    prep_tail = (np.int32(sq), np.int32(pad), np.int32(h), np.int64(rows), *_strides(do),
                 *_strides(o))
    tkv = SM90_BWD_BN * d * 2  # bytes of the K or V tile; Q and dO tiles are half of it
    # (the kernel's BwdSm90Smem; with the TMA dQ, BwdSm90SmemDq: + 2 float32 staging tiles
    # of 64 rows x d / 2, 16 KB each at d = 128)
    staging = 2 * SM90_BWD_BM * (d // 2) * 4 if _dq_tma() else 0
    smem = 4 * tkv + 2 * SM90_BWD_BN * 64 * 2 + staging + 4 * 256 + 5 * 8 + 1024
    fn = _function(_sm90_bwd_name(t, d, causal, det), smem, SM90_FILE)
    st = np.array([*_strides(dq_acc), *_strides(dk)], np.int64).tobytes()  # BwdSm90Strides
    main = Launcher(fn, (-(-k.shape[1] // SM90_BWD_BN), k.shape[2], b), (384,),
                    (bytes,) * 4 + (nd,) * 3 + (u64, nd, nd, u64, u64) + (i32,) * 5
                    + (np.float32, len(st)) + ((bytes,) if _dq_tma() else ()), smem,
                    pdl=False)
    tail = (np.int32(sq), np.int32(pad), np.int32(k.shape[1]), np.int32(h),
            np.int32(k.shape[2]), np.float32(scale), st)
    fn, grid, convert_tail = _convert_args(dq_acc, dq)
    convert = Launcher(fn, grid, (256,), (nd, nd, i64, i64, i64), pdl=False)
    return (prep, prep_tail, main, tail, convert, convert_tail, (2, b * h, pad),
            rows // SM90_BWD_BM, next(_plan_ids))


def _bwd_sm90(do, q, k, v, o, lse, scale, mask, seqlens_q, seqlens_kv, det):
    import cupy
    lq, lkv = _lengths(mask, seqlens_q, seqlens_kv)
    dq_acc = _empty_as(q, np.float32)  # (zeroed by the prep kernel)
    dq, dk, dv = _grad_buffers(q, k, v)  # the kernel writes dk and dv alike
    key = ("bwd", q.shape, k.shape, do.strides, q.strides, k.strides, v.strides, o.strides,
           dq_acc.strides, dq.strides, dk.strides, q.dtype, scale, mask.causal, det,
           CONFIG["sm90_options"], current_device())
    prep, prep_tail, main, tail, convert, convert_tail, lse_shape, blocks, pid = planned(
        _plans, key, _bwd_plan, do, q, k, o, dq_acc, dq, dk, scale, mask.causal, det)
    lse2, delta = cupy.empty(lse_shape, np.float32)  # rows padded to whole blocks
    sem = _turn_counters(blocks, det)
    prep((do, o, lse, lse2, delta, sem, lq) + prep_tail + (dq_acc,) + _strides(dq_acc))
    descs = _sm90_descs(pid, ((q, SM90_BWD_BM), (k, SM90_BWD_BN), (v, SM90_BWD_BN),
                              (do, SM90_BWD_BM))
                        + (((dq_acc, SM90_BWD_BM),) if _dq_tma() else ()))
    main(descs[:4] + (lse2, delta, dq_acc, sem, dk, dv, lq, lkv) + tail + descs[4:])
    convert((dq_acc, dq) + convert_tail)
    return dq, dk, dv

"""CUDA scaled, masked softmax and its backward: cuda/softmax.cu."""
import os

import numpy as np

from .. import backends, loader
from .dtypes import CTYPE, LOW_PRECISION, cbool, on_gpu_low_precision, vec_width
from .launch import balanced_grid, hopper, launch, planned, resident_blocks
from .ring import RING_GROUPS, ring_group, ring_launch, ring_plan, ring_portion, ring_settings

FILE = "softmax.cu"
_TYPES = [CTYPE[d] for d in LOW_PRECISION]
_VECS = {"float": 4, "__half": 8, "__nv_bfloat16": 8}
# Forward: "stream" (Hopper): softmax_fwd_stream, rows streamed through per-warp rings of
# shared memory by bulk copies (ring.ring_launch), for 16-byte rows (with a mask: sk % 16 ==
# 0) and scale >= 0; other rows, and "block4" everywhere, take softmax_fwd_block with 4
# chunks per thread (sk = 4096 bf16: 128 threads) for 16-byte rows of at most 2048 VEC
# entries, else softmax_fwd (a block of 128 threads reading the row three times). The value:
# the chunks per thread of the block kernel each variant falls back to.
FWD_VARIANTS = {"stream": 4, "block4": 4}
# defaults: the fastest on an H200 at 8192 x 4096 bf16 (PERFLOG.md, session 3)
FWD_VARIANT = os.environ.get("TECUPY_SOFTMAX_FWD", "stream")
STREAM_WARP_BYTES = 2048  # of a row per warp in softmax_fwd_stream (H200: PERFLOG.md)
# at most 2 slots per warp (same run, % of copy, 3 -> 2 slots at 8192 x 4096 / 4096 x 8192 /
# 16384 x 4096: H100 83.3 -> 86.1 / 86.6 -> 88.0 / 96.0 -> 97.2; H200 79.4 -> 79.3 / 78.6 ->
# 81.5 / 87.8 -> 89.7; PERFLOG.md)
STREAM_MAX_SLOTS = 2
# Backward: softmax_bwd_block with 2 chunks per thread for 16-byte rows of at most 1024 VEC
# entries (H200 8192 x 4096: 95% of copy against 40%), else softmax_bwd.
BWD_CHUNKS = 2
loader.declare(FILE, [f"softmax_fwd<{t}, {m}>" for t in _TYPES for m in ("false", "true")]
               + [f"softmax_bwd<{t}>" for t in _TYPES]
               + [f"softmax_fwd_block<{t}, {_VECS[t]}, {c}, {m}>" for t in _TYPES
                  for c in set(FWD_VARIANTS.values()) for m in ("false", "true")]
               + [f"softmax_bwd_block<{t}, {_VECS[t]}, {BWD_CHUNKS}>" for t in _TYPES]
               + [f"softmax_fwd_stream<{t}, {_VECS[t]}, {m}, {g}, {c}>" for t in _TYPES
                  for m in ("false", "true") for g in RING_GROUPS for c in ("false", "true")])


def _block_shape(dtype, sk, chunks):
    """(vec, threads) of the block-per-row kernels with `chunks` per thread, or None when
    the row does not vectorize or needs more than 512 threads (__launch_bounds__)."""
    vec = vec_width(dtype, sk)
    threads = 32 * -(-sk // (32 * vec * chunks))
    return (vec, threads) if vec > 1 and threads <= 512 else None


def _block_launch(name, dtype, sk, rows, chunks, extra=""):
    """(kernel, grid, threads) of softmax_{fwd,bwd}_block, or None (see _block_shape)."""
    shape = _block_shape(dtype, sk, chunks)
    if not shape:
        return None
    k = loader.function(FILE, f"{name}<{CTYPE[dtype]}, {shape[0]}, {chunks}{extra}>")
    return k, balanced_grid(rows, resident_blocks(k, shape[1], 0)), shape[1]


def _stream_launch(dtype, sk, rows, has_mask, causal, scale):
    """The launch of softmax_fwd_stream (ring.ring_launch), or None where it does not
    apply (not the variant, not Hopper, rows not of 16-byte vectors, a mask row not of
    16-byte multiples, a row too long for 2 slots, a scale that is negative or NaN: the
    kernel takes max(x scale) as max(x) scale)."""
    vec = vec_width(dtype, sk)
    row_bytes = sk * np.dtype(dtype).itemsize
    group = ring_group(row_bytes, STREAM_WARP_BYTES)
    per = ring_portion(sk // vec, group, 16 // vec)  # the mask's portions stay aligned
    slot = per * (16 + (vec if has_mask else 0))
    extra = 640  # the group's scratch [2, 16 warps] of float4 and takes [2, 16] of uint32
    if not (FWD_VARIANT == "stream" and scale >= 0 and vec > 1 and (sk % 16 == 0 or not has_mask)
            and hopper() and ring_plan(slot, extra)):
        return None
    k = loader.function(FILE, f"softmax_fwd_stream<{CTYPE[dtype]}, {vec}, "
                              f"{cbool(has_mask)}, {group}, {cbool(causal)}>")
    return ring_launch(k, rows, slot, extra, group, STREAM_MAX_SLOTS)


_plans = {}  # launch plans (launch.planned)


def _stream_plan(dtype, sk, rows, has_mask, causal, scale):
    import cupy
    key = (dtype, sk, rows, has_mask, causal, scale >= 0, cupy.cuda.runtime.getDevice(),
           FWD_VARIANT, STREAM_WARP_BYTES, STREAM_MAX_SLOTS, ring_launch, ring_settings())
    return planned(_plans, key, _stream_launch, dtype, sk, rows, has_mask, causal, scale)


def supported(x, *args):
    return on_gpu_low_precision(x) and x.ndim >= 1 and x.shape[-1] < 2**31


@backends.register("softmax_fwd", "cuda", supports=supported)
def softmax_fwd(x, scale, mask, causal):
    import cupy
    x = cupy.ascontiguousarray(x)
    sk = x.shape[-1]
    sq = x.shape[-2] if x.ndim >= 2 else 1
    rows = x.size // max(sk, 1)
    m = x if mask is None else cupy.ascontiguousarray(cupy.broadcast_to(mask, x.shape),
                                                      np.bool_).view(np.uint8)
    y = cupy.empty_like(x)
    stream = rows and sk and _stream_plan(x.dtype, sk, rows, mask is not None, causal, scale)
    if stream:
        k, grid, threads, smem = stream
        k((grid,), (threads,), (x, m, y, np.int64(rows), np.int32(sq), np.int32(sk),
          np.float32(scale), np.int32(causal)), shared_mem=smem)
        return y
    block = rows and sk and _block_launch("softmax_fwd_block", x.dtype, sk, rows,
                                          FWD_VARIANTS[FWD_VARIANT], f", {cbool(mask is not None)}")
    if block:
        k, grid, threads = block
        launch(k, (grid,), (threads,), (x, m, y, np.int64(rows), np.int32(sq), np.int32(sk),
                  np.float32(scale), np.int32(causal)))
    elif rows and sk:
        k = loader.function(FILE, f"softmax_fwd<{CTYPE[x.dtype]}, {cbool(mask is not None)}>")
        launch(k, (rows,), (128,), (x, m, y, np.int32(sq), np.int32(sk), np.float32(scale),
                  np.int32(causal)))
    return y


@backends.register("softmax_bwd", "cuda", supports=supported)
def softmax_bwd(dy, y, scale):
    import cupy
    dy, y = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(y)
    sk = y.shape[-1]
    rows = y.size // max(sk, 1)
    dx = cupy.empty_like(y)
    block = rows and sk and _block_launch("softmax_bwd_block", y.dtype, sk, rows, BWD_CHUNKS)
    if block:
        k, grid, threads = block
        launch(k, (grid,), (threads,), (dy, y, dx, np.int64(rows), np.int32(sk), np.float32(scale)))
    elif rows and sk:
        k = loader.function(FILE, f"softmax_bwd<{CTYPE[y.dtype]}>")
        launch(k, (rows,), (128,), (dy, y, dx, np.int32(sk), np.float32(scale)))
    return dx

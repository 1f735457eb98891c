"""CUDA scaled, masked softmax and its backward: cuda/softmax.cu."""
import numpy as np

from .. import backends, loader
from .common import CTYPE, LOW_PRECISION, cbool, grid_1d, on_gpu_low_precision, vec_width

FILE = "softmax.cu"
_TYPES = [CTYPE[d] for d in LOW_PRECISION]
_VECS = {"float": 4, "__half": 8, "__nv_bfloat16": 8}
WARP_CHUNKS = (1, 2, 4, 8, 16)
loader.declare(FILE, [f"softmax_fwd<{t}, {m}>" for t in _TYPES for m in ("false", "true")]
               + [f"softmax_bwd<{t}>" for t in _TYPES]
               + [f"softmax_fwd_warp<{t}, {_VECS[t]}, {c}, {m}>" for t in _TYPES
                  for c in WARP_CHUNKS for m in ("false", "true")]
               + [f"softmax_bwd_warp<{t}, {_VECS[t]}, {c}>" for t in _TYPES
                  for c in WARP_CHUNKS[:-1]])


def _warp_chunks(dtype, sk, most=WARP_CHUNKS[-1]):
    """Chunks per lane for the warp-per-row kernels, or None when a row does not fit in
    `most` chunks or does not vectorize (then one block per row). The backward holds two
    arrays per row and spills past 8 chunks."""
    vec = vec_width(dtype, sk)
    need = -(-sk // (32 * vec))
    if vec == 1 or need > most:
        return None
    return vec, next(c for c in WARP_CHUNKS if c >= need)


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
    warp = _warp_chunks(x.dtype, sk)
    if rows and sk and warp:
        k = loader.function(FILE, f"softmax_fwd_warp<{CTYPE[x.dtype]}, {warp[0]}, {warp[1]}, "
                                  f"{cbool(mask is not None)}>")
        k((grid_1d(rows, 1, 4, 16),), (128,), (x, m, y, np.int64(rows), np.int32(sq),
          np.int32(sk), np.float32(scale), np.int32(causal)))
    elif rows and sk:
        k = loader.function(FILE, f"softmax_fwd<{CTYPE[x.dtype]}, {cbool(mask is not None)}>")
        k((rows,), (128,), (x, m, y, np.int32(sq), np.int32(sk), np.float32(scale),
          np.int32(causal)))
    return y


@backends.register("softmax_bwd", "cuda", supports=supported)
def softmax_bwd(dy, y, scale):
    import cupy
    dy, y = cupy.ascontiguousarray(dy), cupy.ascontiguousarray(y)
    sk = y.shape[-1]
    rows = y.size // max(sk, 1)
    dx = cupy.empty_like(y)
    warp = _warp_chunks(y.dtype, sk, most=8)
    if rows and sk and warp:
        k = loader.function(FILE, f"softmax_bwd_warp<{CTYPE[y.dtype]}, {warp[0]}, {warp[1]}>")
        k((grid_1d(rows, 1, 4, 16),), (128,), (dy, y, dx, np.int64(rows), np.int32(sk),
          np.float32(scale)))
    elif rows and sk:
        k = loader.function(FILE, f"softmax_bwd<{CTYPE[y.dtype]}>")
        k((rows,), (128,), (dy, y, dx, np.int32(sk), np.float32(scale)))
    return dx

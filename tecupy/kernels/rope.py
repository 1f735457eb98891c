"""CUDA rotary position embedding: cuda/rope.cu, forward and backward in one template.

x may be any strided sbhd/bshd array whose head dim is contiguous (slices of a packed qkv
projection, transposed views): the kernel takes its s, b and head strides, so nothing is
copied before it runs; the output is a new C-contiguous array in x's own format.
"""
import numpy as np

from .. import backends, loader
from .dtypes import CTYPE, LOW_PRECISION, cbool, on_gpu_low_precision
from .launch import launch

FILE = "rope.cu"
loader.declare(FILE, [f"rope<{CTYPE[t]}, {cbool(b)}>" for t in LOW_PRECISION
                      for b in (False, True)])


def _as_sbhd(t, fmt):
    return t if fmt == "sbhd" else t.transpose(1, 0, 2, 3)


def _freqs(freqs):
    """[s2, 1, 1, d2] (any float dtype) -> C-contiguous float32 [s2, d2] (no copy when it is
    one already, as RotaryPositionEmbedding's are)."""
    import cupy
    return cupy.ascontiguousarray(freqs.reshape(freqs.shape[0], freqs.shape[-1]),
                                  dtype=np.float32)


def _run(x, freqs_q, freqs_k, nq, nk, fmt, bwd):
    import cupy
    if x.strides[3] != x.itemsize:
        x = cupy.ascontiguousarray(x)
    y = cupy.empty(x.shape, x.dtype)
    xs, ys = _as_sbhd(x, fmt), _as_sbhd(y, fmt)
    s, b, H, d = xs.shape
    fq = _freqs(freqs_q)
    fk = fq if freqs_k is None else _freqs(freqs_k)
    d2 = fq.shape[1]
    if y.size == 0:
        return y
    k = loader.function(FILE, f"rope<{CTYPE[x.dtype]}, {cbool(bwd)}>")
    st = [np.int64(v // x.itemsize) for t in (xs, ys) for v in t.strides[:3]]
    launch(k, (s, b), (32, 4), (xs, ys, fq, fk, np.int32(H), np.int32(d), np.int32(d2),
                                np.int32(nq), np.int32(nk), *st), shared_mem=16 * d2)
    return y


@backends.register("rope_fwd", "cuda", supports=on_gpu_low_precision)
def rope_fwd(x, freqs_q, freqs_k, nq, nk, tensor_format):
    return _run(x, freqs_q, freqs_k, nq, nk, tensor_format, False)


@backends.register("rope_bwd", "cuda", supports=on_gpu_low_precision)
def rope_bwd(dy, freqs_q, freqs_k, nq, nk, tensor_format):
    return _run(dy, freqs_q, freqs_k, nq, nk, tensor_format, True)

"""CUDA cross entropy: cuda/loss.cu. One block per token reads the logits in their own dtype;
the only allocations are float32 [tokens] (loss, lse) and, in the backward, dlogits."""
import numpy as np

from .. import backends, loader
from .dtypes import CTYPE, LOW_PRECISION, on_gpu_low_precision
from .launch import launch

FILE = "loss.cu"
_IDS = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
loader.declare(FILE, [f"cross_entropy_{d}<{CTYPE[t]}, {i}>" for d in ("fwd", "bwd")
                      for t in LOW_PRECISION for i in _IDS.values()])


def _threads(vocab):
    """Whole warps, about 16 logits per thread, at most 1024."""
    return int(min(1024, 32 * max(1, -(-vocab // 512))))


def _rows(logits, target):
    """(logits as C-contiguous [rows, V], target as contiguous int32/int64 [rows])."""
    import cupy
    x = cupy.ascontiguousarray(logits).reshape(-1, logits.shape[-1])
    t = cupy.ascontiguousarray(target).reshape(-1)
    return x, (t if t.dtype in _IDS else t.astype(np.int64))


def _name(d, x, t):
    return f"cross_entropy_{d}<{CTYPE[x.dtype]}, {_IDS[t.dtype]}>"


@backends.register("cross_entropy_fwd", "cuda", supports=on_gpu_low_precision)
def cross_entropy_fwd(logits, target, ignore_index, label_smoothing):
    import cupy
    x, t = _rows(logits, target)
    rows, vocab = x.shape
    loss, lse = cupy.empty(rows, np.float32), cupy.empty(rows, np.float32)
    if rows:
        launch(loader.function(FILE, _name("fwd", x, t)), (rows,), (_threads(vocab),),
               (x, t, loss, lse, np.int32(vocab), np.int64(ignore_index),
                np.float32(label_smoothing)))
    shape = tuple(logits.shape[:-1])
    return loss.reshape(shape), lse.reshape(shape)


@backends.register("cross_entropy_bwd", "cuda",
                   supports=lambda dloss, logits, *rest: on_gpu_low_precision(logits))
def cross_entropy_bwd(dloss, logits, target, lse, ignore_index, label_smoothing):
    import cupy
    x, t = _rows(logits, target)
    rows, vocab = x.shape
    w = cupy.ascontiguousarray(dloss, dtype=np.float32).reshape(-1)  # (a broadcast: rows)
    lse = cupy.ascontiguousarray(lse, dtype=np.float32).reshape(-1)
    dx = cupy.empty_like(x)
    if rows:
        launch(loader.function(FILE, _name("bwd", x, t)), (rows,), (_threads(vocab),),
               (w, x, t, lse, dx, np.int32(vocab), np.int64(ignore_index),
                np.float32(label_smoothing)))
    return dx.reshape(logits.shape)

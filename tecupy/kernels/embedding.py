"""CUDA embedding: gather forward, sort-then-reduce backward (deterministic): cuda/embedding.cu.

The backward sorts unique int64 keys (id * n + t) with CuPy's sort (CUB/Thrust radix sort),
then reduces each vocabulary row in one block, in ascending token order: no float atomics,
so two runs give the same bits, and the same bits as np.add.at in float32.
"""
import itertools

import numpy as np

from .. import backends, loader
from .._array import is_cupy
from .dtypes import CTYPE
from .launch import grid_1d, launch

FILE = "embedding.cu"
_IDS = {np.dtype(np.int32): "int", np.dtype(np.int64): "long long"}
_VEC = {t: 16 // d.itemsize for d, t in CTYPE.items()}  # 16-byte vectors per dtype
loader.declare(FILE, [f"embedding_fwd<{t}, {i}, {v}>" for (t, i) in itertools.product(
    CTYPE.values(), _IDS.values()) for v in (1, _VEC[t])]
    + [f"embedding_keys<{i}>" for i in _IDS.values()]
    + [f"embedding_bwd<{t}>" for t in CTYPE.values()])
_THREADS = 128


def _ids(ids):
    """ids flattened, contiguous, as int32 or int64 (other integer dtypes are widened)."""
    import cupy
    ids = cupy.ascontiguousarray(ids).reshape(-1)
    return ids if ids.dtype in _IDS else ids.astype(np.int64)


def _supports(weight, ids, *rest):
    return is_cupy(weight) and weight.dtype in CTYPE


@backends.register("embedding_fwd", "cuda", supports=_supports)
def embedding_fwd(weight, ids):
    import cupy
    weight, flat = cupy.ascontiguousarray(weight), _ids(ids)
    (V, D), n = weight.shape, flat.size
    out = cupy.empty((n, D), weight.dtype)
    vec = _VEC[CTYPE[weight.dtype]]
    vec = vec if D % vec == 0 and weight.data.ptr % 16 == 0 else 1  # (a view may be offset)
    bx = min(_THREADS, 32 * -(-(D // vec) // 32))  # whole warps over a row's vectors
    by = _THREADS // bx
    k = loader.function(FILE, f"embedding_fwd<{CTYPE[weight.dtype]}, {_IDS[flat.dtype]}, "
                              f"{vec}>")
    if n and D:
        launch(k, (grid_1d(n, 1, by, 64),), (bx, by),
               (weight, flat, out, np.int64(n), np.int64(V), np.int32(D)))
    return out.reshape(tuple(ids.shape) + (D,))


@backends.register("embedding_bwd", "cuda",
                   supports=lambda dout, *rest: is_cupy(dout) and dout.dtype in CTYPE)
def embedding_bwd(dout, ids, num_embeddings):
    """dweight [num_embeddings, D] in dout's dtype; every row written (no memset)."""
    import cupy
    flat = _ids(ids)
    n, D = flat.size, dout.shape[-1]
    dout = cupy.ascontiguousarray(dout).reshape(n, D)
    dweight = cupy.empty((num_embeddings, D), dout.dtype)
    if n == 0 or D == 0:
        dweight.fill(0)
        return dweight
    keys = cupy.empty(n, np.int64)
    launch(loader.function(FILE, f"embedding_keys<{_IDS[flat.dtype]}>"),
           (grid_1d(n),), (256,), (flat, keys, np.int64(n), np.int64(num_embeddings)))
    keys = cupy.sort(keys)  # keys are unique: the order does not depend on the algorithm
    launch(loader.function(FILE, f"embedding_bwd<{CTYPE[dout.dtype]}>"),
           (num_embeddings, -(-D // _THREADS)), (_THREADS,),
           (dout, keys, dweight, np.int64(n), np.int32(D)))
    return dweight

"""CUDA transpose of FP8 codes (cuda/transpose.cu): the column-wise copy of an FP8 tensor
whose cast made none; and the benchmark's plain copy kernel."""
import numpy as np

from .. import backends, loader
from .._array import is_cupy
from .launch import Launcher, planned

FILE = "transpose.cu"
COPY_UNROLL = (1, 4)
loader.declare(FILE, ["transpose_u8"] + [f"copy_u4<{u}>" for u in COPY_UNROLL])
_U8 = np.dtype(np.uint8)


def supported(data):
    return (is_cupy(data) and data.dtype is _U8 and data.ndim == 2
            and data.shape[0] % 16 == 0 and data.shape[1] % 16 == 0)


@backends.register("fp8_transpose", "cuda", supports=supported)
def fp8_transpose(data):
    import cupy
    data = cupy.ascontiguousarray(data)
    rows, cols = data.shape
    out = cupy.empty((cols, rows), np.uint8)
    if data.size:
        run, args = planned(_plans, (rows, cols, cupy.cuda.runtime.getDevice()),
                            _transpose_plan, rows, cols)
        run((data, out) + args)
    return out


_plans = {}  # fp8_transpose's launch plans (launch.planned), by shape and device


def _transpose_plan(rows, cols):
    """(Launcher, the scalar arguments) of transpose_u8: one block per 64 x 64 tile."""
    import cupy
    k = loader.function(FILE, "transpose_u8")
    kinds = (cupy.ndarray, cupy.ndarray, np.int32, np.int32)  # in, out, rows, cols
    return (Launcher(k, (-(-cols // 64), -(-rows // 64)), (256,), kinds),
            (np.int32(rows), np.int32(cols)))


def copy_u4(src, dst, unroll=4):
    """dst[:] = src by copy_u4 (uint8 arrays of one size, a multiple of 16 bytes): the
    benchmark's bar for a stream of SM loads and stores, not an op."""
    from .launch import grid_1d
    if src.nbytes != dst.nbytes or src.nbytes % 16:
        raise ValueError(f"copy_u4: sizes {src.nbytes} and {dst.nbytes}, need one multiple of 16")
    n = src.nbytes // 16
    loader.function(FILE, f"copy_u4<{unroll}>")((grid_1d(n, unroll),), (256,),
                                                 (src, dst, np.int64(n)))

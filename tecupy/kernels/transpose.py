"""CUDA transpose of FP8 codes (cuda/transpose.cu): the column-wise copy of an FP8 tensor
whose cast made none."""
import numpy as np

from .. import backends, loader
from .._array import is_cupy

FILE = "transpose.cu"
loader.declare(FILE, ["transpose_u8"])


def supported(data):
    return (is_cupy(data) and data.dtype == np.uint8 and data.ndim == 2
            and data.shape[0] % 16 == 0 and data.shape[1] % 16 == 0)


@backends.register("fp8_transpose", "cuda", supports=supported)
def fp8_transpose(data):
    import cupy
    data = cupy.ascontiguousarray(data)
    rows, cols = data.shape
    out = cupy.empty((cols, rows), np.uint8)
    if data.size:
        loader.function(FILE, "transpose_u8")((-(-cols // 64), -(-rows // 64)), (256,),
                                              (data, out, np.int32(rows), np.int32(cols)))
    return out

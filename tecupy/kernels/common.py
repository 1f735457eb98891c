"""Helpers the kernel wrappers share: C type names, the supports() test, launch sizes."""
import numpy as np

from .._array import bfloat16, is_cupy

CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double",
         np.dtype(np.float16): "__half", bfloat16: "__nv_bfloat16"}
FP8TYPE = {"e4m3": "__nv_fp8_e4m3", "e5m2": "__nv_fp8_e5m2"}
LOW_PRECISION = (np.dtype(np.float32), np.dtype(np.float16), bfloat16)


def on_gpu(x, *args, **kwargs):
    """supports(): the first argument is a CuPy array."""
    return is_cupy(x)


def on_gpu_low_precision(x, *args, **kwargs):
    """supports(): the first argument is a CuPy array of float32, float16 or bfloat16."""
    return is_cupy(x) and x.dtype in LOW_PRECISION


_sm_counts = {}


def grid_1d(n, per_thread=1, threads=256, blocks_per_sm=16):
    """Blocks for a grid-stride loop over n items, `threads` items per block each taking
    `per_thread`: enough to fill the GPU (blocks_per_sm per SM), no more."""
    return max(1, min(sm_count() * blocks_per_sm, -(-n // (threads * per_thread))))


def sm_count():
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    if dev not in _sm_counts:
        _sm_counts[dev] = cupy.cuda.Device(dev).attributes["MultiProcessorCount"]
    return _sm_counts[dev]


_occupancy = {}


def resident_blocks(k, threads, smem):
    """Blocks of kernel `k` (a loader function) with `threads` threads and `smem` dynamic
    shared bytes that fit on one SM (at least 1)."""
    key = (k.kernel.ptr, threads, smem)
    if key not in _occupancy:
        from cupy.cuda import driver
        _occupancy[key] = max(1, driver.occupancyMaxActiveBlocksPerMultiprocessor(
            k.kernel.ptr, threads, smem))
    return _occupancy[key]


def balanced_grid(units, per_sm):
    """Blocks for a grid-stride loop over `units` (rows, or groups of rows) when `per_sm`
    blocks fit on an SM: all blocks resident at once and each gets the same number of units
    to within one, so no few blocks run a last iteration while the rest of the GPU idles."""
    per = -(-units // (sm_count() * per_sm))
    return int(max(1, -(-units // max(per, 1))))


def vec_width(dtype, n):
    """Elements per 16-byte access when every row of length n stays 16-byte aligned, else 1."""
    v = 16 // np.dtype(dtype).itemsize
    return v if n % v == 0 else 1


def cbool(flag):
    return "true" if flag else "false"


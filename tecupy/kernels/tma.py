"""TMA descriptors (CUtensorMap) for the Hopper kernels that load tiles with the Tensor
Memory Accelerator (the FP8 GEMM, attention): encoded by the driver, cached."""
import collections

import numpy as np

_descs = collections.OrderedDict()  # encoding arguments -> TMA descriptor (V128)
_TMA_DTYPES = {"uint8": "UINT8", "bfloat16": "BFLOAT16", "float16": "FLOAT16",
               "float32": "FLOAT32"}


def tma_desc(ptr, dtype, dims, strides, box):
    """The 128B-swizzled TMA descriptor (a CUtensorMap, as numpy V128 for a kernel argument)
    of a tensor at device address `ptr`: dims innermost first, in elements (dims[0]
    contiguous), `strides` the byte strides of dims[1:], `box` the elements a load moves
    along each dim (box[0] * itemsize = 128 bytes, the swizzle's row). Cached: a descriptor
    only encodes an address and a shape."""
    dtype = np.dtype(dtype)
    key = (ptr, dtype.name, tuple(dims), tuple(strides), tuple(box))
    if key not in _descs:
        from cuda.bindings import driver as cu
        u64, u32 = cu.cuuint64_t, cu.cuuint32_t
        kind = getattr(cu.CUtensorMapDataType,
                       f"CU_TENSOR_MAP_DATA_TYPE_{_TMA_DTYPES[dtype.name]}")
        err, tmap = cu.cuTensorMapEncodeTiled(
            kind, len(dims), ptr, [u64(int(d)) for d in dims], [u64(int(s)) for s in strides],
            [u32(int(b)) for b in box], [u32(1)] * len(dims),
            cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            cu.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
            cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled failed ({err}) for a {dtype} tensor at "
                               f"{ptr:#x}: dims {tuple(dims)}, byte strides {tuple(strides)}, "
                               f"box {tuple(box)}")
        words = np.array(tmap.opaque, np.uint64)
        span = dtype.itemsize * dims[0] + sum((d - 1) * s for d, s in zip(dims[1:], strides))
        if span < 128 << 10 and _driver_version() <= 13010:
            words[1] &= ~np.uint64(1 << 21)  # driver bug on small tensors (CUTLASS 4.3.4)
        _descs[key] = words.view("V128")
        if len(_descs) > 512:
            _descs.popitem(last=False)
    return _descs[key]


_driver = []


def _driver_version():
    if not _driver:
        import cupy
        _driver.append(cupy.cuda.runtime.driverGetVersion())
    return _driver[0]

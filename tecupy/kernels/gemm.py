"""High-precision GEMM on CuPy arrays through cuBLAS (cublasGemmEx) in the inputs' own
dtype: tensor cores for bf16/fp16 with float32 accumulation, instead of the reference's
upcast to float32. (FP8 GEMMs are the CUTLASS kernels of fp8_gemm.py.)

cuBLAS is called directly through ctypes, on a handle of tecupy's own per thread and
device, not through cupy.matmul or cupy_backends' cublas module: those set the handle's
stream on every call and refuse to while the stream captures a CUDA graph, which cuBLAS
itself allows (make_graphed_step captures whole steps, high-precision GEMMs included).
"""
import ctypes
import threading

import numpy as np

from .. import backends
from .._array import is_cupy
from .dtypes import LOW_PRECISION, bfloat16

CUDA_DTYPE = {np.dtype(np.float32): 0, np.dtype(np.float16): 2, bfloat16: 14}  # cudaDataType
COMPUTE_32F = 68  # CUBLAS_COMPUTE_32F: float32 accumulation (no TF32 for float32 inputs)
OP_N, OP_T = 0, 1
GEMM_DEFAULT = -1
_ALPHA, _BETA = np.ones(1, np.float32), np.zeros(1, np.float32)  # host pointer mode
_local = threading.local()  # .handles: device -> [cuBLAS handle, the stream it is set to]
_lib = []  # [the loaded libcublas, through ctypes]


def _cublas():
    """libcublas as CuPy loaded it (the path from /proc/self/maps; else by soname)."""
    if not _lib:
        import cupy
        from cupy_backends.cuda.libs import cublas  # noqa: F401  (loads libcublas)
        path = None
        try:
            with open("/proc/self/maps") as maps:
                path = next((line.split()[-1] for line in maps
                             if "/libcublas.so" in line), None)
        except OSError:
            pass
        major = cupy.cuda.runtime.runtimeGetVersion() // 1000
        lib = ctypes.CDLL(path or f"libcublas.so.{major}")
        lib.cublasGemmEx.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [
            ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
            ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
            ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.cublasSetStream_v2.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
        _lib.append(lib)
    return _lib[0]


def _check(status, what):
    if status:
        raise RuntimeError(f"{what} failed: cuBLAS status {status}")


def _handle(stream):
    """This thread's handle on the current device, pointed at `stream` (a ptr)."""
    import cupy
    handles = getattr(_local, "handles", None)
    if handles is None:
        handles = _local.handles = {}
    dev = cupy.cuda.runtime.getDevice()
    h = handles.get(dev)
    if h is None:
        handle = ctypes.c_void_p()
        _check(_cublas().cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        h = handles[dev] = [handle, None]
    if h[1] != stream:
        _check(_cublas().cublasSetStream_v2(h[0], stream), "cublasSetStream")
        h[1] = stream
    return h[0]


def _operand(t, transposed):
    """(op, ld, t) for cuBLAS's column-major view of a row-major 2-D array t, giving t
    (transposed=False) or t.T: a C-contiguous t is t.T in column-major memory, an
    F-contiguous one (a transposed view such as dy.T) is t itself; others are copied."""
    if not (t.flags.c_contiguous or t.flags.f_contiguous):
        import cupy
        t = cupy.ascontiguousarray(t)
    if t.flags.c_contiguous:
        return (OP_N if transposed else OP_T), max(1, t.shape[1]), t
    return (OP_T if transposed else OP_N), max(1, t.shape[0]), t


def supported(a, b, out_dtype, bias=None, trans_b=True):
    return (is_cupy(a) and a.dtype in LOW_PRECISION and b.dtype == a.dtype
            and np.dtype(out_dtype) == a.dtype and a.ndim == 2 and b.ndim == 2)


@backends.register("gemm", "cuda", supports=supported)
def gemm(a, b, out_dtype, bias=None, trans_b=True):
    """a [M, K] @ (b [N, K]).T or a @ b [K, N], + bias [N]; cuBLAS accumulates in float32
    and rounds once to the output dtype, then the bias is added in that dtype.
    Row-major C = A B is column-major C.T = B.T A.T: cuBLAS gets B.T as its first operand."""
    import cupy
    m, k = a.shape
    n = b.shape[0] if trans_b else b.shape[1]
    y = cupy.empty((m, n), a.dtype)
    if k == 0:
        y.fill(0)
    elif m and n:
        op_b, ld_b, b = _operand(b, transposed=not trans_b)
        op_a, ld_a, a = _operand(a, transposed=True)
        dt = CUDA_DTYPE[a.dtype]
        _check(_cublas().cublasGemmEx(
            _handle(cupy.cuda.get_current_stream().ptr), op_b, op_a, n, m, k,
            _ALPHA.ctypes.data, b.data.ptr, dt, ld_b, a.data.ptr, dt, ld_a, _BETA.ctypes.data,
            y.data.ptr, dt, n, COMPUTE_32F, GEMM_DEFAULT), "cublasGemmEx")
    if bias is not None:
        y += bias
    return y

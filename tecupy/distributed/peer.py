"""Peer memory for comm-GEMM overlap on one host (issue 25): buffers that every rank of a
group maps (CUDA IPC), chunks pushed into them by the GPUs' copy engines (cudaMemcpyAsync
between devices: no SM, so they run beside a persistent GEMM that holds every SM, where
NCCL's kernels wait for it; PERFLOG.md session 23), and flags written and waited on by
streams (cuStreamWriteValue32 / cuStreamWaitValue32: stream memory operations, capturable
in CUDA graphs). The FP8 GEMM reads such flags itself: kernels/fp8_gemm.gemm_chunked.

Flags take fixed values (0 or 1) and are reset by whoever waited on them, so a captured
graph replays the same operations."""
import ctypes

import numpy as np

WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ: (int32)(*addr - value) >= 0
_lib = []


def _cuda():
    """libcuda's stream memory operations (ctypes; CuPy does not wrap them)."""
    if not _lib:
        lib = ctypes.CDLL("libcuda.so.1")
        fns = []
        for name in ("cuStreamWriteValue32_v2", "cuStreamWaitValue32_v2"):
            fn = getattr(lib, name)
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            fns.append(fn)
        _lib[:] = fns
    return _lib


def _stream_ptr(stream):
    import cupy
    return (stream or cupy.cuda.get_current_stream()).ptr


def write_flag(address, value, stream=None):
    """*address = value (uint32, device memory of this GPU or a peer's mapped here) once the
    stream's earlier work is done (with a memory barrier: what that work wrote is visible
    first)."""
    err = _cuda()[0](_stream_ptr(stream), address, value, 0)
    if err:
        raise RuntimeError(f"cuStreamWriteValue32 failed (CUresult {err}) at {address:#x}")


def wait_flag(address, value, stream=None):
    """The stream's later work waits until *address >= value (uint32, as a signed
    difference): no host wait, no SM."""
    err = _cuda()[1](_stream_ptr(stream), address, value, WAIT_GEQ)
    if err:
        raise RuntimeError(f"cuStreamWaitValue32 failed (CUresult {err}) at {address:#x}")


class PeerBuffer:
    """`nbytes` of device memory on each rank of an NCCL group (cudaMalloc: an IPC handle
    names a whole allocation), every rank's mapped on every other rank of the host: .ptr
    (this rank's address), .peer[r] (rank r's memory as mapped here; .peer[rank] is .ptr).
    Made collectively: every rank of the group calls it with the same nbytes. zero: cleared
    (and the clear finished) before the handles are exchanged."""

    def __init__(self, group, nbytes, zero=True):
        import cupy
        rt = cupy.cuda.runtime
        self.nbytes, self.rank, self.size = int(nbytes), group.rank, group.size
        self.ptr, self._opened = rt.malloc(self.nbytes), []
        try:
            if zero:
                rt.memset(self.ptr, 0, self.nbytes)
            handle = np.frombuffer(rt.ipcGetMemHandle(self.ptr), np.uint8)
            mine = cupy.asarray(handle)
            handles = cupy.asnumpy(group.all_gather(mine, 0)).reshape(group.size, -1)
            self.peer = []
            for r in range(group.size):
                if r == group.rank:
                    self.peer.append(self.ptr)
                    continue
                p = rt.ipcOpenMemHandle(bytes(handles[r]))
                self._opened.append(p)
                self.peer.append(p)
        except BaseException:
            self.close()
            raise

    def array(self, shape, dtype, offset=0):
        """This rank's memory as a CuPy array (the buffer must outlive it)."""
        import cupy
        mem = cupy.cuda.UnownedMemory(self.ptr, self.nbytes, self)
        return cupy.ndarray(shape, dtype, cupy.cuda.MemoryPointer(mem, offset))

    def close(self):
        """Unmap the peers' memory and free this rank's (after every use has finished)."""
        import cupy
        rt = cupy.cuda.runtime
        while self._opened:
            rt.ipcCloseMemHandle(self._opened.pop())
        if self.ptr:
            rt.free(self.ptr)
            self.ptr = 0

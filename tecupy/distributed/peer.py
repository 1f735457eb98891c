"""Peer memory for comm-GEMM overlap on one host (issue 25): buffers that every rank of a
group maps (CUDA IPC), chunks pushed into them by the GPUs' copy engines (cudaMemcpyAsync
between devices: no SM, so they run beside a persistent GEMM that holds every SM, where
NCCL's kernels wait for it; PERFLOG.md session 23), and flags written and waited on by
streams (cuStreamWriteValue32 / cuStreamWaitValue32: stream memory operations, capturable
in CUDA graphs). The FP8 GEMM reads such flags itself: kernels/fp8_gemm.gemm_chunked.

Flags take fixed values (0 or 1) and are reset by whoever waited on them, so a captured
graph replays the same operations."""
import ctypes
import os
import socket

import numpy as np

from .._array import is_cupy
from ..fp8 import FP8Tensor
from ..kernels import fp8_gemm as G
from ..ops.linear import fp8_gemm

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


# The sequence-parallel all-gather of FP8 codes before a column-parallel GEMM as peer
# copies that the GEMM reads as they land (PeerGather). TECUPY_TP_PEER=0 / PEER = False:
# NCCL's all-gather, then the GEMM.
PEER = os.environ.get("TECUPY_TP_PEER", "1").strip() not in ("", "0")


class PeerGather:
    """An all-gather of each rank's FP8 codes [rows, cols] into a buffer [size * rows, cols]
    (rank order) on every rank of a one-host group, overlapped with the GEMM that reads it.
    start(codes): the codes copied into this rank's chunk, then pushed to every peer by the
    copy engine on a side stream (to rank - 1 first, so that each rank receives its chunks in
    the order its GEMM reads them: its own, rank + 1, ...), a ready flag written in the peer
    after each chunk; gemm_chunked reads the chunks as their flags come. finish(), after the
    buffer's last read on the current stream: the flags reset, each peer told (a free flag
    in the pusher) that it may push again. Made collectively (peer_gather)."""

    def __init__(self, group, rows, cols):
        import cupy
        size, self.rank, self.rows = group.size, group.rank, rows
        self.buf = PeerBuffer(group, size * rows * cols)
        self.flags, self.free = PeerBuffer(group, 4 * size), PeerBuffer(group, 4 * size)
        self.full = self.buf.array((size * rows, cols), np.uint8)
        self.ready = self.flags.array((size,), np.uint32)
        self.ready[self.rank] = 1  # (its own chunk: there at every launch)
        self.free.array((size,), np.uint32).fill(1)  # every peer's slot may be written
        self.push = cupy.cuda.Stream(non_blocking=True)
        self.peers = [(self.rank - j) % size for j in range(1, size)]
        self.pushed = None
        cupy.cuda.Device().synchronize()
        group.barrier()  # (no rank pushes before every flag is set)

    def start(self, codes):
        """codes [rows, cols] (uint8, C-contiguous) into this rank's chunk and on their way
        to every peer -> the whole buffer (a CuPy array; its other chunks land later)."""
        import cupy
        r, step = self.rank, codes.nbytes
        main = cupy.cuda.get_current_stream()
        self.full[r * self.rows:(r + 1) * self.rows] = codes
        self.push.wait_event(main.record())
        src = self.buf.ptr + r * step
        for q in self.peers:
            wait_flag(self.free.ptr + 4 * q, 1, self.push)  # q read what we pushed last
            write_flag(self.free.ptr + 4 * q, 0, self.push)
            cupy.cuda.runtime.memcpyAsync(self.buf.peer[q] + r * step, src, step,
                                          cupy.cuda.runtime.memcpyDefault, self.push.ptr)
            write_flag(self.flags.peer[q] + 4 * r, 1, self.push)
        self.pushed = self.push.record()
        return self.full

    def finish(self):
        """After the current stream's last read of the buffer: flags reset (by the waiter),
        the peers free to push again; the current stream waits for this rank's pushes (they
        read its chunk; a CUDA graph joins the side stream here)."""
        import cupy
        main = cupy.cuda.get_current_stream()
        for q in self.peers:
            write_flag(self.flags.ptr + 4 * q, 0, main)
            write_flag(self.free.peer[q] + 4 * self.rank, 1, main)
        main.wait_event(self.pushed)
        self.pushed = None

    def matmul(self, full, qw, out_dtype, bias=None, split_accumulator=False):
        """full @ qw.T (+ bias) for `full`, this buffer's codes as an FP8Tensor, while its
        chunks land: gemm_chunked where its kernel takes the operands, else every chunk
        waited for on the current stream, then the FP8 GEMM op (the same on every rank)."""
        if type(qw) is FP8Tensor and G.supported(
                full.data, full.fmt, full.scale_inv, qw.data, qw.fmt, qw.scale_inv, out_dtype,
                bias, split_accumulator=split_accumulator):
            return G.gemm_chunked(full.data, full.fmt, full.scale_inv, qw.data, qw.fmt,
                                  qw.scale_inv, out_dtype, bias, self.ready, self.rows,
                                  self.rank, split_accumulator=split_accumulator)
        for q in self.peers:
            wait_flag(self.ready.data.ptr + 4 * q, 1)
        return fp8_gemm(full, qw, out_dtype, bias, split_accumulator=split_accumulator)

    def gemm(self, qx, weight_codes, out_dtype, bias, transpose=True):
        """(all-gather of the ranks' qx) @ qw.T (+ bias), qw = weight_codes() (the weight's
        cast, run while the chunks travel) -> (y, the gathered codes' column-wise copy as an
        FP8Tensor for wgrad (None unless transpose), qw)."""
        full = FP8Tensor.made(self.start(qx.data), qx.fmt, qx.scale_inv)
        qw = weight_codes()
        y = self.matmul(full, qw, out_dtype, bias)
        full_t = full.columnwise() if transpose else None
        self.finish()
        return y, full_t, qw


def peer_gather(group, codes):
    """The group's PeerGather for codes like `codes` (this rank's [rows, cols] FP8 codes of
    a sequence-parallel all-gather), or None: PEER off, not an NCCL group of one host, not
    a CuPy uint8 2-D C-contiguous array, rows not a multiple of 128 (the GEMM's row tile), or
    more than 32 ranks, or none made yet while a CUDA graph is being captured (NCCL's
    all-gather is captured then). Made at the first such call on every rank (collectively:
    the same arguments on every rank give the same answer) and kept on the group for the
    process's life: a peer may still write a flag into this rank's memory after this
    rank's last use, so it is never freed early (one buffer per codes shape: the layers
    share it)."""
    from .nccl import NcclGroup
    if (not PEER or not isinstance(group, NcclGroup) or not 2 <= group.size <= 32
            or not is_cupy(codes) or codes.dtype != np.uint8 or codes.ndim != 2
            or not codes.flags.c_contiguous or codes.shape[0] % 128):
        return None
    gathers = group.__dict__.setdefault("_peer_gathers", {})
    key = codes.shape
    if key not in gathers:
        import cupy
        if cupy.cuda.get_current_stream().is_capturing():  # (made eagerly only: it
            return None  # allocates, synchronises and exchanges handles; NCCL is captured)
        gathers[key] = PeerGather(group, *codes.shape) if _one_host(group) else None
    return gathers[key]


def _one_host(group):
    """Whether every rank of the group runs on this host (CUDA IPC maps only those): the
    ranks' host names compared, the same answer on every rank."""
    import cupy
    name = np.frombuffer(socket.gethostname().encode()[:64].ljust(64, b"\0"), np.uint8)
    names = cupy.asnumpy(group.all_gather(cupy.asarray(name), 0)).reshape(group.size, -1)
    return bool((names == names[0]).all())

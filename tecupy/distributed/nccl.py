"""NcclGroup: the ProcessGroup API over cupy.cuda.nccl, one process per GPU.

Collectives run on CuPy arrays of this rank's GPU, on the current stream, with no host
synchronisation (barrier() is the one call that waits on the host); all_reduce_into and
all_gather_into add NCCL's out-of-place / in-place forms that need no copy (the data-
parallel reducer and ZeroOptimizer use them where a group has them). Dtypes: float32,
float16, bfloat16, float64, uint8, int32, int64. Groups are made by init_process_group
(process.py) and split(); every rank calls the same collectives in the same order, as NCCL
requires (TECUPY_DIST_DEBUG=1 checks that through the store on every call, naming each
rank's call when they differ; slow, host round trips).

Faults: every process runs a watchdog thread blocked on the store's abort key. A rank that
raises posts the abort (process.py's excepthook, or spawn's wrapper); each other rank's
watchdog then calls ncclCommAbort on its communicators (under the lock collectives enqueue
with, so never beneath a running call), its later collectives raise GroupAborted with the
reason, and unless its process exits by itself within `grace` seconds (a main thread stuck
in a host sync on a collective that will never finish), the watchdog prints the reason and
exits the process with status 1, as PyTorch's NCCL watchdog does.

The NCCL calls go through an api object (CupyNccl here; tests pass a fake that runs on
NumPy through the store, so everything but NCCL itself is checked without a GPU).
"""
import json
import os
import sys
import threading
import time

import numpy as np

from .._array import bfloat16
from .group import GroupAborted, ProcessGroup
from .store import Store, StoreLost

# NCCL's enum values (nccl.h; stable across NCCL 2.x)
NCCL_DTYPES = {np.dtype(np.uint8): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 4,
               np.dtype(np.float16): 6, np.dtype(np.float32): 7, np.dtype(np.float64): 8,
               bfloat16: 9}
NCCL_OPS = {"sum": 0, "max": 2}
DTYPE_NAMES = "float32, float16, bfloat16, float64, uint8, int32, int64"


class CupyNccl:
    """The real api: cupy.cuda.nccl and CuPy arrays."""
    name = "nccl"
    point_to_point = True  # ncclSend / ncclRecv (NcclGroup.shift)

    def __init__(self):
        import cupy
        from cupy.cuda import nccl
        if not nccl.available:
            raise RuntimeError("tecupy.distributed: cupy.cuda.nccl cannot load libnccl.so.2; "
                               "pip install nvidia-nccl-cu13 (or -cu12, matching cupy)")
        self.xp, self.nccl = cupy, nccl

    def set_device(self, local_rank):
        n = self.xp.cuda.runtime.getDeviceCount()
        if local_rank >= n:
            raise RuntimeError(f"tecupy.distributed: LOCAL_RANK {local_rank} but this host "
                               f"has {n} GPU(s): launch at most {n} ranks per node")
        self.xp.cuda.Device(local_rank).use()
        return local_rank

    def get_unique_id(self):
        """-> bytes for the store: cupy's id (bytes, or a tuple of 128 signed chars in
        older CuPy) tagged so that communicator() hands back the same type."""
        uid = self.nccl.get_unique_id()
        if isinstance(uid, (bytes, bytearray)):
            return b"B" + bytes(uid)
        return b"T" + json.dumps([int(v) for v in uid]).encode()

    def communicator(self, size, uid, rank):
        uid = bytes(uid)
        uid = uid[1:] if uid[:1] == b"B" else tuple(json.loads(uid[1:]))
        return self.nccl.NcclCommunicator(size, uid, rank)

    def can_split(self):
        return (hasattr(self.nccl.NcclCommunicator, "commSplit")
                and self.nccl.get_version() >= 21801)

    def device_of(self, op, x, device):
        """x's device id; TypeError unless x is a CuPy array."""
        if not isinstance(x, self.xp.ndarray):
            raise TypeError(f"{op}: x must be a cupy array on this rank's GPU {device} "
                            f"(NCCL works on device memory); got {type(x).__module__}."
                            f"{type(x).__name__} (cupy.asarray(x) first)")
        return x.device.id

    @staticmethod
    def ptr(x):
        return x.data.ptr

    def stream(self):
        return self.xp.cuda.get_current_stream().ptr

    def synchronize(self):
        self.xp.cuda.get_current_stream().synchronize()

    def synchronize_device(self):
        self.xp.cuda.Device().synchronize()


class _Job:
    """This process's part of the job: store clients, the abort, every communicator."""

    def __init__(self, api, store, rank, size, device, server=None, grace=2.0,
                 exit_on_abort=True):
        self.api, self.store, self.rank, self.size, self.device = api, store, rank, size, device
        self.server, self.grace, self.exit_on_abort = server, grace, exit_on_abort
        self.reason = None  # why the job aborted, once it has
        self.local = False  # the abort came from this process (its own code raises)
        self.comms, self.lock = [], threading.RLock()
        self.debug = os.environ.get("TECUPY_DIST_DEBUG", "0") not in ("", "0")
        self.closed = False
        self._watch = Store(store.host, store.port, rank, timeout=10)
        threading.Thread(target=self._watchdog, daemon=True,
                         name=f"tecupy-watchdog-rank{rank}").start()

    def abort(self, reason):
        """Abort the job from this process (its code raised): post it, abort our comms."""
        self.local = True
        try:
            reason = self.store.abort(reason)
        except (StoreLost, OSError):
            pass
        self._abort_comms(reason)
        return reason

    def _abort_comms(self, reason):
        if self.reason is None:
            self.reason = reason
        if self.lock.acquire(timeout=self.grace):  # not beneath a running enqueue
            try:
                if self.comms:
                    self.api.set_device(self.device)  # (this thread's CUDA device)
                for comm in self.comms:
                    try:
                        comm.abort()
                    except Exception:  # noqa: BLE001 - best effort, the job is ending
                        pass
                self.comms = []
            finally:
                self.lock.release()

    def _watchdog(self):
        try:
            reason = self._watch.watch_abort()
        except (StoreLost, OSError) as e:
            if self.closed:
                return
            reason = str(e)
        if self.closed:
            return
        if self.reason is None:
            self.reason = reason  # (the main thread's next collective raises it)
        end = time.monotonic() + self.grace
        # ncclCommAbort in a thread of its own: were it to block, this one still ends the
        # process on time
        aborting = threading.Thread(target=self._abort_comms, args=(reason,), daemon=True)
        aborting.start()
        aborting.join(self.grace)
        if self.local or not self.exit_on_abort:
            return
        time.sleep(max(0.0, end - time.monotonic()))
        sys.stderr.write(f"tecupy.distributed: rank {self.rank} of {self.size} exits: group "
                         f"aborted: {reason}\n")
        sys.stderr.flush()
        os._exit(1)

    def _destroy(self, comms):
        self.api.set_device(self.device)
        for comm in comms:
            try:
                comm.destroy()
            except Exception:  # noqa: BLE001 - best effort at the end
                pass

    def check(self, what):
        if self.reason is not None:
            raise GroupAborted(f"{what} on rank {self.rank}: group aborted: {self.reason}")
        if self.closed:
            raise GroupAborted(f"{what} on rank {self.rank}: the process group was destroyed")

    def close(self):
        """A clean end: this GPU's work done (collectives the peers take part in
        included; the watchdog still guards the wait), the communicators destroyed (in a
        thread, given 10 s: an exit never hangs on it), bye to the store; rank 0 waits for
        the others to go first."""
        if self.closed:
            return
        if self.reason is None and self.comms:
            try:
                self.api.synchronize_device()
            except Exception:  # noqa: BLE001 - an aborted or broken job: nothing to wait for
                pass
        self.closed = True
        comms, self.comms = self.comms, []
        if comms:
            ending = threading.Thread(target=self._destroy, args=(comms,), daemon=True)
            ending.start()
            ending.join(10.0)
        self.store.close()
        self._watch.close()
        if self.server is not None:
            # the others may still be at work (rank 0 ends first); after an abort they
            # exit within their grace
            linger = float(os.environ.get("TECUPY_STORE_LINGER", "600"))
            self.server.wait_clients_closed(linger if self.reason is None else self.grace + 3)
            self.server.close()


class NcclGroup(ProcessGroup):
    """One rank of an NCCL communicator; made by init_process_group and split()."""

    def __init__(self, job, comm, rank, size, gid):
        super().__init__(rank, size)
        self._job, self._comm, self._gid = job, comm, gid
        self._splits = self._calls = 0
        self.device = job.device

    def __repr__(self):
        return f"<NcclGroup rank {self.rank} of {self.size} on GPU {self.device}>"

    def abort(self, reason):
        """Abort the whole job (every group), as ncclCommAbort on every rank."""
        self._job.abort(reason)

    # -- checks at the boundary --------------------------------------------------------
    def _check_array(self, op, x):
        super()._check_array(op, x)
        dev = self._job.api.device_of(op, x, self.device)
        if dev != self.device:
            raise ValueError(f"{op}: x is on GPU {dev} but this rank's group is on GPU "
                             f"{self.device} (LOCAL_RANK); copy it over first")
        if np.dtype(x.dtype) not in NCCL_DTYPES:
            raise TypeError(f"{op}: dtype {x.dtype} is not supported by the NCCL group; "
                            f"supported: {DTYPE_NAMES} (FP8 data travels as uint8 codes)")

    def _call(self, what, fn, *args):
        """Run one NCCL call under the job's lock, after the abort (and debug) checks."""
        job = self._job
        job.check(what)
        if job.debug:
            self._debug_match(what)
        with job.lock:
            job.check(what)
            try:
                fn(*args, self._job.api.stream())
            except Exception as e:  # noqa: BLE001 - NcclError and the like: abort the job
                reason = job.reason or job.abort(f"rank {job.rank}: {what} failed: "
                                                 f"{type(e).__name__}: {e}")
                raise GroupAborted(f"{what} on rank {self.rank}: group aborted: {reason}") \
                    from e

    def _debug_match(self, what):
        """TECUPY_DIST_DEBUG: every rank's call must be the same (via the store)."""
        what = str(what)
        self._calls += 1
        prefix = f"{self._gid}/dbg/{self._calls}"
        store = self._job.store
        store.set(f"{prefix}/{self.rank}", what)
        calls = [v.decode() for v in store.wait([f"{prefix}/{r}" for r in range(self.size)])]
        if any(c != what for c in calls):
            listed = ", ".join(f"rank {r}: {c}" for r, c in enumerate(calls))
            reason = self._job.abort(f"the ranks called different collectives ({listed})")
            raise GroupAborted(f"{what} on rank {self.rank}: group aborted: {reason}")

    # -- collectives ---------------------------------------------------------------------
    def _all_reduce(self, x, op):
        xp, api = self._job.api.xp, self._job.api
        buf = x if x.flags.c_contiguous else xp.ascontiguousarray(x)
        self._call(_name("all_reduce", x, op), self._comm.allReduce, api.ptr(buf),
                   api.ptr(buf), buf.size, NCCL_DTYPES[np.dtype(x.dtype)], NCCL_OPS[op])
        if buf is not x:
            x[...] = buf
        return x

    def _all_reduce_many(self, arrays, op):
        """One NCCL group of in-place all-reduces (one launch; contiguous arrays of NCCL's
        dtypes), else one all-reduce each."""
        if len(arrays) < 2 or not all(x.flags.c_contiguous for x in arrays):
            return super()._all_reduce_many(arrays, op)
        api = self._job.api
        calls = [(api.ptr(x), x.size, NCCL_DTYPES[np.dtype(x.dtype)]) for x in arrays]
        self._call(_name("all_reduce_many", arrays[0], f"{len(arrays)} arrays, {op}"),
                   self._grouped_all_reduce, calls, NCCL_OPS[op])

    def _grouped_all_reduce(self, calls, op, stream):
        nccl = self._job.api.nccl
        nccl.groupStart()
        try:
            for ptr, count, dt in calls:
                self._comm.allReduce(ptr, ptr, count, dt, op, stream)
        finally:
            nccl.groupEnd()

    # -- without a copy (the data-parallel reducer and ZeroOptimizer, data_parallel.py) -----
    def all_reduce_into(self, x, out, op="sum"):
        """x reduced over the ranks into `out`: NCCL's out-of-place all-reduce, x only read
        (a gradient the backward may still read), no copy. out: x's shape and dtype, both
        C-contiguous. -> out."""
        self._check_op("all_reduce_into", op)
        self._check_into("all_reduce_into", x, out, x.size)
        api = self._job.api
        self._call(_name("all_reduce", x, op), self._comm.allReduce, api.ptr(x), api.ptr(out),
                   x.size, NCCL_DTYPES[np.dtype(x.dtype)], NCCL_OPS[op])
        return out

    def all_gather_into(self, x, out):
        """The ranks' x, flat and in rank order, into `out` (out.size == size * x.size, x's
        dtype, both C-contiguous), no copy; x may be out's own chunk, out.ravel()[rank * k:
        (rank + 1) * k] with k = x.size (NCCL's in-place all-gather). -> out."""
        self._check_into("all_gather_into", x, out, x.size * self.size)
        api = self._job.api
        self._call(_name("all_gather", x, "into"), self._comm.allGather, api.ptr(x),
                   api.ptr(out), x.size, NCCL_DTYPES[np.dtype(x.dtype)])
        return out

    def _check_into(self, op, x, out, size):
        for name, a in (("x", x), ("out", out)):
            self._check_array(op, a)
            if not a.flags.c_contiguous:
                raise ValueError(f"{op}: {name} must be C-contiguous (NCCL reads and writes "
                                 "it flat)")
        if out.dtype != x.dtype or out.size != size:
            raise ValueError(f"{op}: out must be {x.dtype} of {size} elements (x: "
                             f"{tuple(x.shape)} {x.dtype}); got {tuple(out.shape)} {out.dtype}")

    def _all_gather(self, x, axis):
        xp, api = self._job.api.xp, self._job.api
        send = xp.ascontiguousarray(x)
        out = xp.empty((self.size,) + tuple(x.shape), dtype=x.dtype)
        self._call(_name("all_gather", x, f"axis={axis}"), self._comm.allGather,
                   api.ptr(send), api.ptr(out), send.size, NCCL_DTYPES[np.dtype(x.dtype)])
        shape = list(x.shape)
        shape[axis] *= self.size  # (size, ..., n, ...) -> (..., size, n, ...) -> (..., size*n, ...)
        return xp.ascontiguousarray(xp.moveaxis(out, 0, axis)).reshape(shape)

    def _reduce_scatter(self, x, axis, op):
        xp, api = self._job.api.xp, self._job.api
        shape = tuple(x.shape)
        pre, n = int(np.prod(shape[:axis])), shape[axis] // self.size
        # this rank's chunk must be contiguous in the send buffer: (size, pre, n, post)
        send = xp.ascontiguousarray(xp.reshape(x, (pre, self.size, n, -1)).transpose(1, 0, 2, 3))
        out = xp.empty(send.shape[1:], dtype=x.dtype)
        self._call(_name("reduce_scatter", x, f"axis={axis}, {op}"), self._comm.reduceScatter,
                   api.ptr(send), api.ptr(out), out.size, NCCL_DTYPES[np.dtype(x.dtype)],
                   NCCL_OPS[op])
        return out.reshape(shape[:axis] + (n,) + shape[axis + 1:])

    @property
    def can_shift(self):
        return bool(getattr(self._job.api, "point_to_point", False))

    def _shift(self, x, out):
        api = self._job.api
        if not (x.flags.c_contiguous and out.flags.c_contiguous):
            raise ValueError("shift: x and out must be C-contiguous (NCCL sends them flat)")
        dt = NCCL_DTYPES[np.dtype(x.dtype)]
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        if self.size == 1:
            out[...] = x
            return out
        self._call(_name("shift", x, "ring"), self._send_recv, api.ptr(x), api.ptr(out),
                   x.size, dt, nxt, prev)
        return out

    def _send_recv(self, send, recv, count, dt, nxt, prev, stream):
        """ncclSend to nxt and ncclRecv from prev in one group (no deadlock on a ring)."""
        nccl = self._job.api.nccl
        nccl.groupStart()
        try:
            self._comm.send(send, count, dt, nxt, stream)
            self._comm.recv(recv, count, dt, prev, stream)
        finally:
            nccl.groupEnd()

    def _broadcast(self, x, root):
        xp, api = self._job.api.xp, self._job.api
        buf = x if x.flags.c_contiguous else xp.ascontiguousarray(x)
        self._call(_name("broadcast", x, f"root={root}"), self._comm.bcast, api.ptr(buf),
                   buf.size, NCCL_DTYPES[np.dtype(x.dtype)], root)
        if buf is not x:
            x[...] = buf
        return x

    def _barrier(self):
        """An all-reduce of one int32, then the host waits for it."""
        one = self._job.api.xp.ones(1, dtype=np.int32)
        self._call("barrier", self._comm.allReduce, self._job.api.ptr(one),
                   self._job.api.ptr(one), 1, NCCL_DTYPES[np.dtype(np.int32)], NCCL_OPS["sum"])
        self._job.api.synchronize()

    def _split(self, color, key):
        job = self._job
        job.check("split")
        self._splits += 1
        gid = f"{self._gid}/s{self._splits}"
        if job.api.can_split():
            with job.lock:
                comm = self._comm.commSplit(-1 if color is None else color, key)
            if comm is None:
                return None
            rank, size = comm.rank_id(), comm.size()
        else:  # a new unique id per color, handed out through the store
            comm, rank, size = self._split_by_store(gid, color, key)
            if comm is None:
                return None
        with job.lock:
            job.comms.append(comm)
        return NcclGroup(job, comm, rank, size, f"{gid}/c{color}")

    def _split_by_store(self, gid, color, key):
        store = self._job.store
        store.set(f"{gid}/{self.rank}", f"{'' if color is None else color},{key}")
        pairs = [v.decode().split(",") for v in
                 store.wait([f"{gid}/{r}" for r in range(self.size)])]
        if color is None:
            return None, None, None
        members = sorted((int(k), r) for r, (c, k) in enumerate(pairs) if c == str(color))
        order = [r for _, r in members]
        rank = order.index(self.rank)
        if rank == 0:
            store.set(f"{gid}/uid/{color}", self._job.api.get_unique_id())
        uid = store.get(f"{gid}/uid/{color}")
        return self._job.api.communicator(len(order), uid, rank), rank, len(order)


class _name:
    """A collective's description for messages, "op(shape dtype, extra)", written out only
    when a message needs it (an abort, the debug check): formatting a shape and a dtype for
    every call cost ~2-3 us of host time each, 16+ calls per tensor-parallel step."""
    __slots__ = ("op", "shape", "dtype", "extra")

    def __init__(self, op, x, extra):
        self.op, self.shape, self.dtype, self.extra = op, x.shape, x.dtype, extra

    def __str__(self):
        return f"{self.op}({tuple(self.shape)} {self.dtype}, {self.extra})"

"""Launching kernels: device queries (SMs, Hopper), grid sizes and occupancy, shared memory
beyond 48 KB, the wrappers' cache of launch plans, and the launch with programmatic
dependent launch (PDL) through cuLaunchKernelEx."""
import contextlib
import contextvars
import ctypes
import itertools
import struct
import threading

import numpy as np

_sm_counts = {}


# Blocks per SM of grid-stride kernels that read two streams (or draw Philox numbers): 8
# resident blocks of 256 threads, the rest queued, so each block takes fewer iterations and
# the last ones end together (H200, 8192 x 4096: dropout 86-89 -> 94% of copy, gelu_bwd,
# swiglu, add, dropout_bwd +2-3 points). Single-input kernels (cast, gelu) keep 16: -2-4
# points at 64. PERFLOG.md.
MANY_BLOCKS = 64


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


# SMs the persistent GEMMs leave free (sm_margin): while a ring's exchange runs on a side
# stream (distributed/overlap.py), NCCL's kernels need SMs that a GEMM holding all of them
# for its whole run never frees (its CTAs take ~200 KB of shared memory each).
_margin = contextvars.ContextVar("tecupy_sm_margin", default=0)


@contextlib.contextmanager
def sm_margin(n):
    """Inside, persistent GEMMs (fp8_gemm's, the block GEMM's) launch at most SMs - n CTAs,
    so n SMs stay free for work on another stream (Transformer Engine's comm-GEMM overlap
    keeps SMs for its exchanges too). Per thread and context, as the tape."""
    if not (isinstance(n, int) and 0 <= n):
        raise ValueError(f"sm_margin: n must be an int >= 0, got {n!r}")
    token = _margin.set(n)
    try:
        yield
    finally:
        _margin.reset(token)


def margin():
    """The SMs left free inside the current sm_margin (0 outside)."""
    return _margin.get()


def current_device():
    """The current CUDA device's id (a launch plan's key: plans hold loaded functions)."""
    import cupy
    return cupy.cuda.runtime.getDevice()


_hopper = {}  # device id -> compute capability 9.0 (asked once: supports() runs every call)


def hopper():
    """Whether the current device is a Hopper GPU (sm_90: wgmma, TMA)."""
    import cupy
    dev = cupy.cuda.runtime.getDevice()
    if dev not in _hopper:
        _hopper[dev] = cupy.cuda.Device(dev).compute_capability == "90"
    return _hopper[dev]


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


def opt_in_smem(k, smem):
    """Let kernel `k` (a loader function) use `smem` dynamic shared bytes, beyond the
    default 48 KB when needed."""
    if smem > 48 << 10 and k.max_dynamic_shared_size_bytes < smem:
        k.max_dynamic_shared_size_bytes = smem


def balanced_grid(units, per_sm):
    """Blocks for a grid-stride loop over `units` (rows, or groups of rows) when `per_sm`
    blocks fit on an SM: all blocks resident at once and each gets the same number of units
    to within one, so no few blocks run a last iteration while the rest of the GPU idles."""
    per = -(-units // (sm_count() * per_sm))
    return int(max(1, -(-units // max(per, 1))))


def planned(plans, key, choose, *args):
    """choose(*args), kept in the dict `plans` under `key`: the kernel wrappers' launch plans
    (which kernel, grid, shared memory), whose choice costs 5-20 us of Python per call on
    the lent machines, a lookup ~1. `key` must hold the call's shape and every setting
    choose reads, so that a changed setting (tests and tuning scripts change them) gets a
    plan of its own."""
    try:
        return plans[key]
    except KeyError:
        if len(plans) > 4096:  # many shapes: start over rather than grow
            plans.clear()
        plan = plans[key] = choose(*args)
        return plan


# Programmatic dependent launch (PDL) on Hopper: the kernel's blocks may be scheduled while
# the previous kernel in the stream finishes (it waits in PDL_WAIT, common.cuh, before
# touching memory), which hides the launch gap between kernels: H200, graph replay, 8192 x
# 4096: LN fwd 83 -> 84-86% of copy, RMS 84 -> 86%, gelu 89 -> 91%, and +5-12 points on
# 2048 x 4096 (PERFLOG.md). Only for kernels that begin with PDL_WAIT().
PDL = True


class _LaunchAttr(ctypes.Structure):  # CUlaunchAttribute (cuda.h)
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3),
                ("shared", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttr)), ("num_attrs", ctypes.c_uint)]


_PDL_ATTR = _LaunchAttr(id=6)  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_PDL_ATTR.value[0] = 1
# each kernel argument in 8 bytes (little-endian; the driver copies the parameter's size
# from where its pointer points), a 128-byte one (bytes: a TMA descriptor, CUtensorMap) in 128
_ARG_FORMATS = {np.int32: "i4x", np.int64: "q", np.float32: "f4x", np.uint32: "I4x",
                np.uint64: "Q", bytes: "128s"}


def _launch_state(kinds, grid, block, shared_mem, pdl=True):
    """(struct packing arguments of types `kinds`, its buffer, void** to each argument in
    the buffer, the launch config, with the PDL attribute where pdl) for this grid, block
    and shared size."""
    import cupy
    fmts = {cupy.ndarray: "Q", **_ARG_FORMATS}
    bad = [getattr(t, "__name__", repr(t)) for t in kinds
           if t not in fmts and not (type(t) is int and t > 0 and t % 8 == 0)]
    if bad:
        raise TypeError(f"launch: kernel arguments of types {bad}; accepted: CuPy arrays "
                        "and NumPy int32/int64/float32/uint32/uint64 (and bytes: a 128-byte "
                        "parameter such as a TMA descriptor; a multiple of 8, n: an n-byte "
                        "struct passed by value, as bytes)")
    items = [f"{t}s" if type(t) is int else fmts[t] for t in kinds]
    st = struct.Struct("<" + "".join(items))
    buf = ctypes.create_string_buffer(st.size)
    offsets = itertools.accumulate((struct.calcsize("<" + f) for f in items[:-1]), initial=0)
    base = ctypes.addressof(buf)
    params = (ctypes.c_void_p * len(kinds))(*(base + o for o in offsets))
    g, b = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
    cfg = _LaunchConfig(grid=(ctypes.c_uint * 3)(*g), block=(ctypes.c_uint * 3)(*b),
                        shared=shared_mem)
    if pdl:
        cfg.attrs, cfg.num_attrs = ctypes.pointer(_PDL_ATTR), 1
    return st, buf, params, cfg


_cupy = []  # (ndarray, get_current_stream, cuLaunchKernelEx), set at the first launch


def _driver():
    """_cupy, filled at the first PDL launch (libcuda through ctypes)."""
    if not _cupy:
        from cupy import ndarray
        from cupy.cuda import get_current_stream
        fn = ctypes.CDLL("libcuda.so.1").cuLaunchKernelEx
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        fn.restype = ctypes.c_int
        _cupy[:] = ndarray, get_current_stream, fn
    return _cupy


class Launcher:
    """The launch of loader function k with grid, block, shared bytes and argument types
    fixed: what a wrapper's launch plan keeps, so that a call only packs its arguments and
    launches (no type tuple, key or dict per call). `kinds`: each argument's type; a
    position of kind np.uint64 takes an array too (a pointer: a raw address such as a null,
    or an array's), one of kind cupy.ndarray only an array. The struct, buffer and config
    are per thread: two threads never pack into one buffer. pdl: the kernel begins with
    PDL_WAIT() and launches with PDL (not a Hopper GPU: CuPy's own launch; PDL off, even
    after the plan was made: without the attribute). pdl=False: always through
    cuLaunchKernelEx, without the attribute (the FP8 GEMM, whose 128-byte TMA descriptors
    are bytes here). A kind n (an int, a multiple of 8) is an n-byte struct passed by
    value, given as bytes."""

    def __init__(self, k, grid, block, kinds, shared_mem=0, pdl=True):
        nd = _driver()[0]
        self.k, self.grid, self.block, self.shared_mem = k, grid, block, shared_mem
        self.kinds, self.pdl = tuple(kinds), pdl
        self.pack = _packer(self.kinds, nd)
        self.hopper = hopper()  # (a plan is made per device)
        self.local = threading.local()
        self._state()  # (an argument type it cannot pack fails here, not at a call)
        self.f = k.kernel.ptr

    def _state(self):
        """This thread's (struct, buffer, config, void** params' address, config address,
        the params array: kept alive with its address)."""
        st, buf, params, cfg = _launch_state(self.kinds, self.grid, self.block,
                                             self.shared_mem, self.pdl)
        self.local.state = (st, buf, cfg, ctypes.addressof(params), ctypes.addressof(cfg),
                            params)
        return self.local.state

    def __call__(self, args):
        if self.pdl and not self.hopper:
            return self.k(self.grid, self.block, args, shared_mem=self.shared_mem)
        try:
            st, buf, cfg, params, cfg_ptr, _ = self.local.state
        except AttributeError:  # another thread's first call
            st, buf, cfg, params, cfg_ptr, _ = self._state()
        _, stream, launch_ex = _cupy
        self.pack(st.pack_into, buf, args)
        cfg.stream = stream().ptr
        # (PDL read per call: turned off after this plan was made, the launch goes without
        # the attribute, still through cuLaunchKernelEx: CuPy's launch takes no bytes)
        cfg.num_attrs = 1 if self.pdl and PDL else 0
        err = launch_ex(cfg_ptr, self.f, params, None)
        if err:
            raise RuntimeError(f"cuLaunchKernelEx failed (CUresult {err}) for {self.k.name}: "
                               f"grid {self.grid}, block {self.block}, {self.shared_mem} "
                               "shared bytes")


def _packer(kinds, nd):
    """pack(pack_into, buf, args) for arguments of `kinds`, written out once per Launcher
    (as collections.namedtuple writes its class): each array's address read in place, a
    flexible pointer (np.uint64 kind) tested, no list or loop per call (~1 us a launch)."""
    def arg(i, t):
        if t is nd:
            return f"a[{i}].data.ptr"
        if t is np.uint64:  # a raw address, or an array
            return f"(a[{i}].data.ptr if type(a[{i}]) is nd else a[{i}])"
        return f"a[{i}]"
    body = ", ".join(arg(i, t) for i, t in enumerate(kinds))
    space = {"nd": nd}
    exec(f"def pack(pack_into, buf, a):\n    pack_into(buf, 0, {body})\n", space)
    return space["pack"]


_launchers = {}  # (k, argument types, grid, block, shared bytes) -> Launcher, for launch()


def launch(k, grid, block, args, shared_mem=0):
    """k(grid, block, args, shared_mem=...) for a loader function k whose kernel begins with
    PDL_WAIT(): with PDL where the GPU is a Hopper, else CuPy's launch. grid and block are
    tuples; args CuPy arrays and NumPy scalars (int32, int64, float32, uint32, uint64).
    cuLaunchKernelEx is called through ctypes, the arguments packed by one struct into a
    buffer kept per thread with the config (a Launcher per kernel, argument types and
    shape): 6.9 us per launch of a 15-argument kernel on an H200 host, CuPy's own launch
    7.1, this function before those were kept 8.6-8.8, through cuda-python ~15 us more.
    A wrapper that keeps a launch plan keeps its Launcher there instead (no key per call)."""
    if not (PDL and hopper()):
        return k(grid, block, args, shared_mem=shared_mem)
    kinds = tuple(map(type, args))
    key = (k, kinds, grid, block, shared_mem)
    launcher = _launchers.get(key)
    if launcher is None:
        if len(_launchers) > 1024:  # many shapes: start over rather than grow
            _launchers.clear()
        launcher = _launchers[key] = Launcher(k, grid, block, kinds, shared_mem)
    launcher(args)

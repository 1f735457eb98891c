"""Host time of one FP8 nn.Linear forward (M=256, K=N=4096, bf16, delayed scaling: issue
21's 60 us target) on the GPU, two ways:
  (a) a Tape and fp8_autocast entered per call (the exit's delayed-scaling update in every
      call), as a notebook cell runs it;
  (b) one Tape and fp8_autocast held over --held calls (the per-Linear cost inside a
      training step, which pays the exit's update once per step);
  (c), (d) the same with the weight as FP8 codes (quantized_model_init: no weight cast);
  (e) as (b), with is_first_microbatch=False: the weight's FP8 codes kept by one True call
      at the start of the held autocast (TE's weight caching: no weight cast per call);
and where (a) goes: cProfile's top functions by own time over --calls calls.

    python scripts/linear_host.py [--top 30] [--calls 300] [--parts] [--ab] [--stubs]
    python scripts/linear_host.py --fake      # no GPU: CuPy faked, the Python only

--stubs: (b) again with CuPy's allocations and / or the launches replaced by stand-ins,
alternated: how much of (b) each is (PERFLOG.md session 25).
--ab: (a)-(e) again with the FP8 linear's kept plan off (ops/linear.py KEPT, every call
dispatched), on with fresh row-wise codes, and on with them held (HELD_ROWS_BYTES), in turns
in the same run: each one's gain on this machine. --parts on a GPU also
times CuPy's own primitives the forward pays (an allocation, a view carved from one, a
launch), the numbers that decide whether carving scale_inv out of the transposed codes'
allocation pays.

--fake runs the same calls on a machine without a GPU with CuPy's arrays, allocations,
kernel lookups and launches replaced by trivial stand-ins (FakeCupy), so what is timed is
tecupy's own Python around them; CuPy's part (allocation ~2 us, launch ~5-7 us each on the
lent hosts, PERFLOG.md) comes on top on a GPU.
"""
import argparse
import contextlib
import cProfile
import itertools
import math
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tecupy  # noqa: E402  (this checkout's, not an installed copy)
from tecupy.recipe import DelayedScaling  # noqa: E402

M, K, N = 256, 4096, 4096


def make(cupy, fake):
    """The Linear and its input x [M, K] (fake: made on the CPU, parameters as fakes)."""
    lin = tecupy.nn.Linear(K, N, params_dtype=tecupy.bfloat16, seed=0,
                           device="cpu" if fake else "cuda")
    if fake:
        lin.weight, lin.bias = cupy.asarray(lin.weight), cupy.asarray(lin.bias)
    x = cupy.asarray(np.random.default_rng(0).standard_normal((M, K)).astype(tecupy.bfloat16))
    return lin, x


def make_fp8_weights(cupy, fake, recipe):
    """The Linear with its weight as FP8 codes (quantized_model_init: no weight cast per
    forward). fake: made on the CPU, its codes and bias as fakes, a fresh FP8 state."""
    with tecupy.quantized_model_init(recipe=recipe):
        lin = tecupy.nn.Linear(K, N, params_dtype=tecupy.bfloat16, seed=0,
                               device="cpu" if fake else "cuda")
    if fake:
        w = lin.weight
        w.data, w.data_t, w.scale_inv = map(cupy.asarray, (w.data, w.data_t, w.scale_inv))
        lin.bias = cupy.asarray(lin.bias)
        lin.fp8_state = tecupy.FP8State(lin.fp8_state.num_gemms)
    return lin


def per_call(lin, x, recipe):
    """(a): a Tape and an autocast entered per call."""
    def fwd():
        with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=recipe):
            lin(x)
    return fwd


def rounds(fn, calls, sync, n=5, held=None):
    """us per call of fn, best of n rounds of `calls` calls; held: a context entered around
    each round (b), else none."""
    best = []
    for _ in range(n):
        with held() if held else contextlib.nullcontext():
            fn()  # (the state is made at the first call; every plan is made)
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            best.append((time.perf_counter() - t0) / calls * 1e6)
        sync()
    return best


def held_context(recipe, enter=None):
    """(b): one Tape and fp8_autocast around a round of calls (the exit's update in it);
    enter: called first inside them (e: the is_first_microbatch=True call)."""
    @contextlib.contextmanager
    def ctx():
        with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=recipe):
            if enter is not None:
                enter()
            yield
    return ctx


def held_microbatches(lin, x, recipe, a, sync):
    """(e): us per is_first_microbatch=False call, held as (b), after one True call."""
    return rounds(lambda: lin(x, is_first_microbatch=False), a.held, sync,
                  n=3 * a.calls // a.held,
                  held=held_context(recipe, lambda: lin(x, is_first_microbatch=True)))


def parts(lin, x, rounds_=40, calls=100):
    """us per call of each CUDA wrapper the forward runs (best of `rounds_` rounds of `calls`
    calls, the garbage collector off): what one change moves, less noisy than the whole."""
    from tecupy import backends
    from tecupy.fp8_state import update_states
    state = lin.fp8_state
    qi, qw, _ = state.derived[0]
    ax, aw = qi.quantize(x, transpose=True), qw.quantize(lin.weight, transpose=True)
    inv = ax.scale_inv
    cases = {
        "cast_transpose (dispatch)": lambda: backends.dispatch(
            "cast_transpose", x, qi.scale, qi.fmt, qi.amax_out, inv),
        "fp8_gemm with bias (dispatch)": lambda: backends.dispatch(
            "fp8_gemm", ax.data, ax.fmt, inv, aw.data, aw.fmt, inv, x.dtype, lin.bias),
        "forward update of 1 state (update_states)": lambda: update_states([state], "fwd"),
    }
    best_of(cases, rounds_, calls)


def best_of(cases, rounds_, calls):
    """Print each case's us per call: the best of `rounds_` rounds of `calls` calls, the
    garbage collector off."""
    import gc
    gc.disable()
    try:
        for label, fn in cases.items():
            best = []
            for _ in range(rounds_):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best.append((time.perf_counter() - t0) / calls * 1e6)
            print(f"  {label}: {min(best):.2f} us")
    finally:
        gc.enable()


def ab(lin, lin8, x, r, a, sync, reps=12):
    """(a)-(e) with ops/linear.py's kept plan off, on (its pair of casts in one launch,
    KEPT_PAIR) with fresh row-wise codes (HELD_ROWS_BYTES 0), and on with them held: one
    round of each setting in turns, `reps` times (a busy host drifts: settings timed far
    apart differ by more than they gain), in one process; min and median per setting."""
    import importlib
    ops_linear = importlib.import_module("tecupy.ops.linear")
    held = ops_linear.HELD_ROWS_BYTES
    settings = {"kept plan off": (False, 0), "kept plan on": (True, 0),
                "kept plan on, rows held": (True, held)}
    n = a.held
    cases = {"(a)": (per_call(lin, x, r), None), "(b)": (lambda: lin(x), held_context(r)),
             "(c)": (per_call(lin8, x, r), None), "(d)": (lambda: lin8(x), held_context(r)),
             "(e)": (lambda: lin(x, is_first_microbatch=False),
                     held_context(r, lambda: lin(x, is_first_microbatch=True)))}
    for case, (fn, ctx) in cases.items():
        times = {name: [] for name in settings}
        for _ in range(reps):
            for name, (kept, rows) in settings.items():
                ops_linear.KEPT, ops_linear.HELD_ROWS_BYTES = kept, rows
                ops_linear._kept.clear()
                times[name] += rounds(fn, n, sync, n=1, held=ctx)
        for name, t in times.items():
            print(f"  {case} {name}: min {min(t):.1f} us, median {np.median(t):.1f} us")
    ops_linear.KEPT, ops_linear.HELD_ROWS_BYTES = True, held
    ops_linear._kept.clear()


def stubs(lin, x, r, a, sync):
    """(b) with CuPy's allocations and / or the Launchers' launches stubbed (GPU only; timing
    only, the outputs are garbage): where (b)'s host time goes. An allocation is replaced by
    an array held per (shape, dtype) (no pool allocation, no free), a launch by nothing."""
    import cupy
    import numpy as np
    from tecupy.kernels import launch
    real_call, real_empty, held = launch.Launcher.__call__, cupy.empty, {}

    def held_empty(shape, dtype=float, order="C"):
        key = (shape if type(shape) is tuple else (shape,), np.dtype(dtype))
        if key not in held:
            held[key] = real_empty(*key)
        return held[key]
    times = {}
    try:
        for _ in range(3):
            for name, stub_launch, stub_alloc in (("real", 0, 0), ("no launches", 1, 0),
                                                  ("no allocations", 0, 1), ("neither", 1, 1)):
                launch.Launcher.__call__ = (lambda self, args: None) if stub_launch else real_call
                cupy.empty = held_empty if stub_alloc else real_empty
                times.setdefault(name, []).extend(
                    rounds(lambda: lin(x), a.held, sync, n=3, held=held_context(r)))
    finally:
        launch.Launcher.__call__, cupy.empty = real_call, real_empty
    for name, best in times.items():
        report(f"  (b), {name}", best)


def cupy_parts(cupy, rounds_=40, calls=100):
    """us per call of CuPy's primitives in the forward (GPU only): allocations of scale_inv's
    and the transposed codes' sizes, a pool allocation alone, an array carved from one (what
    carving scale_inv out of the transposed copy's allocation would cost instead), a launch
    of a trivial kernel through the Launcher."""
    import numpy as np
    from tecupy.kernels.launch import Launcher
    buf = cupy.cuda.alloc(K * M + 512)
    k = cupy.RawKernel('extern "C" __global__ void nop(float* p) {}', "nop")
    k.compile()
    run = Launcher(k, (1,), (32,), (cupy.ndarray,), pdl=False)  # (k.kernel: its function)
    one = cupy.empty((1,), np.float32)
    cases = {
        "cupy.empty((1,), float32)": lambda: cupy.empty((1,), np.float32),
        "cupy.empty((K, M), uint8)": lambda: cupy.empty((K, M), np.uint8),
        "cupy.cuda.alloc(K*M + 512)": lambda: cupy.cuda.alloc(K * M + 512),
        "cupy.ndarray((1,), float32, memptr=buf + K*M)": lambda: cupy.ndarray(
            (1,), np.float32, memptr=buf + K * M),
        "Launcher, 1 argument (cuLaunchKernelEx)": lambda: run((one,)),
    }
    best_of(cases, rounds_, calls)
    cupy.cuda.Device().synchronize()


def report(label, best):
    print(f"{label}: {min(best):.1f} us per call (rounds: "
          + ", ".join(f"{b:.1f}" for b in best) + ")")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--held", type=int, default=100, help="calls per held Tape + autocast")
    p.add_argument("--parts", action="store_true", help="also time each wrapper alone")
    p.add_argument("--fake", action="store_true", help="no GPU: CuPy faked (FakeCupy)")
    p.add_argument("--ab", action="store_true",
                   help="(a)-(e): kept plan off, on, on with held rows")
    p.add_argument("--stubs", action="store_true",
                   help="(b) with allocations and / or launches stubbed (GPU only)")
    a = p.parse_args()
    with FakeCupy() if a.fake else contextlib.nullcontext():
        import cupy
        sync = (lambda: None) if a.fake else cupy.cuda.Device().synchronize
        lin, x = make(cupy, a.fake)
        r = DelayedScaling(amax_history_len=16)
        fwd = per_call(lin, x, r)
        for _ in range(20):
            fwd()
        sync()
        report("(a) FP8 Linear forward, Tape + fp8_autocast per call, host",
               rounds(fwd, a.calls, sync))
        report(f"(b) FP8 Linear forward, one Tape + fp8_autocast over {a.held} calls, host",
               rounds(lambda: lin(x), a.held, sync, n=3 * a.calls // a.held,
                      held=held_context(r)))
        lin8 = make_fp8_weights(cupy, a.fake, r)
        report("(c) as (a), the weight as FP8 codes (quantized_model_init)",
               rounds(per_call(lin8, x, r), a.calls, sync))
        report(f"(d) as (b), the weight as FP8 codes, held over {a.held} calls",
               rounds(lambda: lin8(x), a.held, sync, n=3 * a.calls // a.held,
                      held=held_context(r)))
        report(f"(e) as (b), is_first_microbatch=False (the FP8 weight kept by one True "
               f"call), held over {a.held} calls", held_microbatches(lin, x, r, a, sync))
        if not a.fake:  # the GEMM's two launch paths, same run (fp8_gemm.CTYPES_LAUNCH)
            from tecupy.kernels import fp8_gemm
            fp8_gemm.CTYPES_LAUNCH = False
            report("(a) with the FP8 GEMM through CuPy's launch", rounds(fwd, a.calls, sync))
            fp8_gemm.CTYPES_LAUNCH = True
            report("(a) with the FP8 GEMM through the Launcher, again",
                   rounds(fwd, a.calls, sync))
        if a.ab:
            ab(lin, lin8, x, r, a, sync)
        if a.parts:
            parts(lin, x)
            if not a.fake:
                cupy_parts(cupy)
        if a.stubs and not a.fake:
            stubs(lin, x, r, a, sync)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.calls):
            fwd()
        prof.disable()
        sync()
        pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


# ---- CuPy faked: the wrappers' Python timed on a machine without a GPU -------------------
class _Mem:
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr

    def __add__(self, offset):  # (a MemoryPointer's offset)
        return _Mem(self.ptr + offset)


class _Flags:
    c_contiguous = True


_ALLOCS = itertools.count(1 << 44, 1 << 32)  # cupy.cuda.alloc's addresses, room for any size


class FakeArray:
    """What the CUDA wrappers read of a CuPy array: shape, dtype, sizes, data.ptr, flags."""
    flags = _Flags()
    _free, _next = {}, itertools.count(1 << 32, 1 << 12)  # size -> freed addresses; new ones

    def __init__(self, shape, dtype, memptr=None):  # (about CuPy's own constructor, ~1 us)
        self.shape = shape = tuple(shape) if type(shape) is not int else (shape,)
        self.dtype = dtype = dtype if type(dtype) is np.dtype else np.dtype(dtype)
        self.ndim, self.itemsize = len(shape), dtype.itemsize
        self.size = math.prod(shape)
        self.nbytes = self.size * self.itemsize
        if memptr is not None:  # on a given pointer (a carved allocation): nothing to free
            self.data, self.nbytes = memptr, -1
            return
        free = FakeArray._free.get(self.nbytes)  # an address freed is reused, as in CuPy's
        self.data = _Mem(free.pop() if free else next(FakeArray._next))  # pool (same size)

    def __del__(self):
        if self.nbytes >= 0:
            FakeArray._free.setdefault(self.nbytes, []).append(self.data.ptr)

    def astype(self, dtype, copy=True):
        return self if not copy and np.dtype(dtype) == self.dtype else FakeArray(self.shape,
                                                                                 dtype)

    def reshape(self, *shape):
        return FakeArray(shape[0] if len(shape) == 1 else shape, self.dtype)

    def __getitem__(self, index):  # the states' slot views: (1,)
        return FakeArray((1,), self.dtype)

    def __setitem__(self, index, value):
        pass

    def __len__(self):
        return self.shape[0]


class _Kernel:
    """A loaded kernel: callable (CuPy's launch), with the attributes the plans read."""
    def __init__(self, name):
        self.name, self.max_dynamic_shared_size_bytes = name, 0
        self.kernel = _Mem(id(self))

    def __call__(self, grid, block, args, shared_mem=0):
        pass


class _Stream:
    ptr = 0

    def is_capturing(self):
        return False


class FakeCupy:
    """CuPy's arrays, allocations, device queries, kernel lookups and launches replaced by
    stand-ins (attributes of the imported cupy module and of tecupy's kernel modules), for
    as long as the context is open."""

    def __enter__(self):
        import cupy
        from tecupy import _array, loader
        from tecupy.kernels import cast, fp8_gemm, launch, pools
        stream = _Stream()
        kernels = {}
        fake = {
            (cupy, "ndarray"): FakeArray,
            (cupy, "empty"): lambda shape, dtype=np.float32: FakeArray(shape, dtype),
            (cupy, "zeros"): lambda shape, dtype=np.float32: FakeArray(shape, dtype),
            (cupy, "ones"): lambda shape, dtype=np.float32: FakeArray(shape, dtype),
            (cupy, "full"): lambda shape, v, dtype=np.float32: FakeArray(shape, dtype),
            (cupy, "empty_like"): lambda a: FakeArray(a.shape, a.dtype),
            (cupy, "ascontiguousarray"): lambda a: a,
            (cupy, "asarray"): lambda a, dtype=None: (
                a if isinstance(a, FakeArray) else FakeArray(np.shape(a),
                                                             dtype or np.asarray(a).dtype)),
            (cupy.cuda.runtime, "getDevice"): lambda: 0,
            (cupy.cuda, "alloc"): lambda n: _Mem(next(_ALLOCS)),  # (apart from arrays')
            (cupy.cuda, "get_current_stream"): lambda: stream,
            (_array, "_CUPY_ARRAY"): FakeArray,
            (loader, "function"): lambda file, name, options=(): kernels.setdefault(
                name, _Kernel(name)),
            (launch, "_hopper"): {0: True},
            (launch, "_sm_counts"): {0: 132},
            (launch, "_cupy"): [FakeArray, lambda: stream, lambda *args: 0],
            (cast, "resident_blocks"): lambda k, threads, smem: 8,
            (pools, "resident_blocks"): lambda k, threads, smem: 8,
            (fp8_gemm, "tma_encode"): lambda *args: np.zeros(128, np.uint8).view("V128"),
        }
        self.saved = [(obj, name, getattr(obj, name)) for obj, name in fake]
        for (obj, name), value in fake.items():
            setattr(obj, name, value)
        return self

    def __exit__(self, *exc):
        for obj, name, value in reversed(self.saved):
            setattr(obj, name, value)
        return False


if __name__ == "__main__":
    main()

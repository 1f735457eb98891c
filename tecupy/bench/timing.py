"""Timing that is honest on the GPU, the one helper of every benchmark, of tune() and of the
main job: warm-up, CUDA events (CuPy's, or torch's for a PyTorch peer; the host clock on
NumPy), medians of repeats, inputs rotated past L2, CUDA-graph replay for the kernels' own
time. Absolute times only mean something beside the GPU's name (gpu_name)."""
import statistics
import time

import numpy as np

L2_BYTES = 64 << 20  # rotate inputs over at least twice this (H100/H200 L2: 50-60 MB)


def once_ms(fn, xp=np):
    """Milliseconds of one fn(): CUDA events on CuPy or torch (the GPU's time, on the current
    stream), else the host clock."""
    if xp is np:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    torch = xp.__name__ == "torch"  # (torch's events time nothing unless asked to)
    kw = {"enable_timing": True} if torch else {}
    start, stop = xp.cuda.Event(**kw), xp.cuda.Event(**kw)
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) if torch else xp.cuda.get_elapsed_time(start, stop)


def in_turns(items, rounds):
    """Each of `items` once per round, every other round in reverse order: a timing's place
    in its round moves it (on an H100 the first of a round ran up to 3-4% faster under FP8
    load: PERFLOG.md, session 30), so each place is taken as often by every item."""
    items = list(items)
    for r in range(rounds):
        yield from (items if r % 2 == 0 else items[::-1])


def sustain(fn, seconds, xp=None):
    """Call fn() back to back for `seconds` (synchronizing every 10 calls) before timing it:
    an FP8 GEMM's clocks sink for a few seconds under load toward the power cap, and the
    rounds timed during that slide compare moments more than kernels (PERFLOG.md, sessions
    27 and 31)."""
    if xp is None:
        import cupy as xp
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        _synchronize(xp)


def time_ms(fn, xp=np, warmup=1, repeat=3):
    """Median milliseconds of fn() over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    return statistics.median(once_ms(fn, xp) for _ in range(repeat))


def gpu_time_ms(fn, sets, calls=20, repeats=5, xp=None):
    """Median over `repeats` of (time of `calls` back-to-back calls) / calls, in ms: what a
    caller sees, Python dispatch included. Call c gets the arguments sets[c % len(sets)];
    the first two sets warm up. xp: cupy (the default) or torch, whose events time it."""
    if xp is None:
        import cupy as xp
    for s in sets[:2]:
        fn(*s)
    _synchronize(xp)

    def batch():
        for c in range(calls):
            fn(*sets[c % len(sets)])
    return float(statistics.median(once_ms(batch, xp) / calls for _ in range(repeats)))


def flushed_ms(fn, calls=30, flush_bytes=int(8e9), xp=None):
    """Mean ms of fn() called `calls` times, each after zeroing `flush_bytes` (L2 cold, the
    GPU mostly idle between calls: near its boost clocks), fn alone timed by events around
    it: DeepGEMM's method behind its published figures (deep_gemm/testing/bench.py,
    bench_kineto: 30 calls, each after an 8 GB memset, kernel time only). xp: cupy or torch
    (whose events and current stream time it)."""
    if xp is None:
        import cupy as xp
    torch = xp.__name__ == "torch"
    flush = (xp.empty(flush_bytes // 4, dtype=xp.int32, device="cuda") if torch
             else xp.empty(flush_bytes // 4, xp.int32))
    fn()
    total = 0.0
    for _ in range(calls):
        if torch:
            flush.zero_()
        else:
            flush.fill(0)
        total += once_ms(fn, xp)
    del flush
    return total / calls


def torch_time_ms(fn, calls=20, repeats=5):
    """gpu_time_ms of a PyTorch peer fn() (torch's events, on torch's current stream)."""
    import torch
    return gpu_time_ms(fn, [()], calls, repeats, xp=torch)


def graph_time_ms(fn, sets, calls=20, repeats=5):
    """Like gpu_time_ms, but the calls are captured once in a CUDA graph and the graph is
    replayed: the kernels' own time, without Python dispatch and launch gaps. None when the
    calls cannot be captured."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    try:
        with stream:  # (events record on the current stream: this one)
            for s in sets[:2]:
                fn(*s)  # warm the memory pool: no cudaMalloc inside the capture
            stream.synchronize()
            stream.begin_capture()
            for c in range(calls):
                fn(*sets[c % len(sets)])
            graph = stream.end_capture()
            graph.launch(stream)
            stream.synchronize()
            times = [once_ms(lambda: graph.launch(stream), cupy) / calls
                     for _ in range(repeats)]
    except Exception:
        return None
    return float(statistics.median(times))


def first_call(fn, *args):
    """(fn(*args), its host milliseconds up to the end of its GPU work): the first call,
    compile or cache load included, which the benchmarks report apart."""
    import cupy
    t0 = time.perf_counter()
    out = fn(*args)
    cupy.cuda.Device().synchronize()
    return out, (time.perf_counter() - t0) * 1e3


def input_sets(make, nbytes):
    """Enough independent input sets (make() each) of `nbytes` that cycling through them
    defeats the L2 cache."""
    return [make() for _ in range(max(1, min(16, -(-2 * L2_BYTES // max(nbytes, 1)))))]


def gpu_name():
    import cupy
    return cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()


def host_speed(calls=100, rounds=8):
    """(us per cupy.empty of one float32, us per launch of an empty kernel through
    kernels.launch's Launcher: cuLaunchKernelEx), each the best of `rounds` rounds of
    `calls`, the GPU held busy by a kernel that spins so nothing waits (and no more launches
    than the driver queues without blocking): the host's own costs, which an eager step pays
    dozens of times (the lent hosts' ranged 2.1-5.7 and 6.0-10.5 us: the eager rows and host
    ms move with them, the graphed rows do not)."""
    import cupy
    from ..kernels.launch import Launcher
    k = cupy.RawKernel('extern "C" __global__ void nop(float* p) {}\n'
                       'extern "C" __global__ void spin(long long n) { long long t = clock64();'
                       ' while (clock64() - t < n) {} }', "nop")
    spin = cupy.RawKernel(k.code, "spin")
    k.compile()  # (the Launcher reads k.kernel: the loaded function)
    run = Launcher(k, (1,), (32,), (cupy.ndarray,), pdl=False)
    one = cupy.empty((1,), np.float32)
    run((one,))  # (compiled and loaded before timing)
    best = {}
    spin((1,), (1,), (np.int64(2_000_000_000),))  # (~1 s: longer than the rounds below)
    for name, fn in (("empty", lambda: cupy.empty((1,), np.float32)),
                     ("launch", lambda: run((one,)))):
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            dt = (time.perf_counter() - t0) / calls * 1e6
            best[name] = min(best.get(name, dt), dt)
    cupy.cuda.Device().synchronize()
    return best["empty"], best["launch"]


def _synchronize(xp):
    if xp.__name__ == "torch":
        xp.cuda.synchronize()
    else:
        xp.cuda.Device().synchronize()

"""Timing that is honest on the GPU: warm-up, CUDA events (or the host clock on NumPy),
median of repeats."""
import statistics
import time

import numpy as np


def time_ms(fn, xp=np, warmup=1, repeat=3):
    """Median milliseconds of fn() over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        if xp is np:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        else:
            start, stop = xp.cuda.Event(), xp.cuda.Event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(xp.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)

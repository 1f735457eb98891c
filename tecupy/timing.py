"""Timing that is honest on the GPU: warm-up, CUDA events (or the host clock on NumPy),
median of repeats."""
import statistics
import time

import numpy as np


def time_ms(fn, xp=np, warmup=1, repeat=3):
    """Median milliseconds of fn() over `repeat` runs after `warmup` runs."""
    for _ in range(warmup):
        fn()
    return statistics.median(once_ms(fn, xp) for _ in range(repeat))


def once_ms(fn, xp=np):
    """Milliseconds of one fn(): CUDA events on CuPy (the GPU's time), else the host clock."""
    if xp is np:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    start, stop = xp.cuda.Event(), xp.cuda.Event()
    start.record()
    fn()
    stop.record()
    stop.synchronize()
    return xp.cuda.get_elapsed_time(start, stop)

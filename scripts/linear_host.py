"""Host time of one FP8 nn.Linear forward (M=256, K=N=4096, bf16, delayed scaling, under a
Tape and fp8_autocast entered per call: issue 21's 60 us target) on the GPU, and where it
goes: cProfile's top functions by own time over 300 calls.

    python scripts/linear_host.py [--top 30]
"""
import argparse
import cProfile
import pstats
import time

import cupy
import numpy as np

import tecupy
from tecupy.recipe import DelayedScaling


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args()
    lin = tecupy.nn.Linear(4096, 4096, params_dtype=tecupy.bfloat16, device="cuda", seed=0)
    x = cupy.asarray(np.random.default_rng(0).standard_normal((256, 4096))
                     .astype(tecupy.bfloat16))
    r = DelayedScaling(amax_history_len=16)

    def fwd():
        with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
            lin(x)
    for _ in range(20):
        fwd()
    cupy.cuda.Device().synchronize()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(a.calls):
            fwd()
        best.append((time.perf_counter() - t0) / a.calls * 1e6)
        cupy.cuda.Device().synchronize()
    print(f"FP8 Linear forward host us per call: {min(best):.1f} (rounds: "
          + ", ".join(f"{b:.1f}" for b in best) + ")")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        fwd()
    prof.disable()
    cupy.cuda.Device().synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(a.top)


if __name__ == "__main__":
    main()

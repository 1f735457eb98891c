"""A/B of the Hopper attention backward under two sets of NVRTC options for
cuda/attention_sm90.cu, in one process (kernels.attention.CONFIG["sm90_options"], which
reaches NVRTC through loader.function's options, part of the cubin cache key, and keys the
launch plans). Default: --old "-DATTN_DQ_TMA=0" (dQ by red.global.add.v4.f32 from registers
after wait_group 0) against --new "" (dQ staged in shared memory, added by TMA reductions
while dK's wgmma runs; PERFLOG.md session 25). Other switches of the file
(-DATTN_LONGEST_FIRST=0, ...) go the same way.

Checks: dk, dv bit-identical between the two; dq's float32 sums (dq_acc, caught as the
wrapper allocates it) within 1e-5 of the largest |dq_acc| (only the order of the float adds
may differ). Times the whole backward (prep, main kernel, convert) as CUDA-graph replays
(tecupy.bench.timing.graph_time_ms: 20 calls, median of 5), old and new alternated for
--rounds rounds; prints the minimum per variant, in us. Needs a Hopper GPU.

    python scripts/attention_variants.py [--old "-DATTN_DQ_TMA=0"] [--new ""] [--rounds 3]
(the first run compiles the bf16 backward kernels it uses: ~1 min)."""
import argparse
import os
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # this checkout's
os.environ["TECUPY_STRICT"] = "1"  # a failing kernel raises (no quiet fallback to NumPy)

import cupy  # noqa: E402
import numpy as np  # noqa: E402

import tecupy  # noqa: E402
from tecupy import backends, loader  # noqa: E402
from tecupy.bench.timing import gpu_time_ms, graph_time_ms  # noqa: E402
from tecupy.kernels import attention as kernel  # noqa: E402
from tecupy.ops.attention import MASKS  # noqa: E402

p = argparse.ArgumentParser(description="A/B of the Hopper attention backward's NVRTC options")
p.add_argument("--old", default="-DATTN_DQ_TMA=0", help="options of A, space-separated")
p.add_argument("--new", default="", help="options of B, space-separated")
p.add_argument("--rounds", type=int, default=3)
ARGS = p.parse_args()
ROUNDS, OLD, NEW = ARGS.rounds, tuple(ARGS.old.split()), tuple(ARGS.new.split())
CASES = [  # (b, s, h, d), causal
    ((2, 512, 16, 64), True), ((2, 2048, 16, 128), True), ((4, 2048, 32, 128), True),
    ((4, 2048, 8, 128), True), ((3, 1000, 5, 128), True), ((4, 2048, 32, 128), False)]

# dq_acc is the backward's only float32 allocation through _empty_as: keep the last one
caught, real_empty_as = [], kernel._empty_as


def _spy(t, dtype=None, alloc=None):
    x = real_empty_as(t, dtype, alloc)
    if caught is not None and dtype is not None and np.dtype(dtype) == np.float32:
        caught[:] = [x]
    return x


kernel._empty_as = _spy
kernel.CONFIG["deterministic"] = False


def backward(options, args):
    kernel.CONFIG["sm90_options"] = options
    return backends.dispatch("attention_bwd", *args)


def main():
    global caught
    print(f"tecupy from {loader.source_path(kernel.SM90_FILE)}")
    print(f"GPU: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    rng = np.random.default_rng(0)
    rows = []
    for (b, s, h, d), causal in CASES:
        q, k, v, do = (cupy.asarray(rng.standard_normal((b, s, h, d), np.float32)
                                    .astype(tecupy.bfloat16)) for _ in range(4))
        mask = MASKS["causal" if causal else "no_mask"]
        tail = (float(1 / np.sqrt(d)), mask, None, None, 0.0, None)
        kernel.CONFIG["sm90_options"] = NEW
        o, lse = backends.dispatch("attention_fwd", q, k, v, *tail)
        args = (do, q, k, v, o, lse) + tail
        caught = []
        (dq0, dk0, dv0), acc0 = backward(OLD, args), caught[0]
        (dq1, dk1, dv1), acc1 = backward(NEW, args), caught[0]
        cupy.cuda.Device().synchronize()
        caught = None  # (no references kept during the graph captures)
        same = all(cupy.array_equal(x.view(np.uint16), y.view(np.uint16))
                   for x, y in ((dk0, dk1), (dv0, dv1)))
        err = float(cupy.abs(acc1 - acc0).max() / cupy.abs(acc0).max())
        flips = int((dq0.view(np.uint16) != dq1.view(np.uint16)).sum())
        times = {OLD: [], NEW: []}
        for _ in range(ROUNDS):
            for options in (OLD, NEW):
                ms = graph_time_ms(lambda: backward(options, args), [()])
                if ms is None:  # (not capturable: back-to-back eager calls instead)
                    print("graph capture failed: eager timing", flush=True)
                    ms = gpu_time_ms(lambda: backward(options, args), [()])
                times[options].append(ms * 1e3)
        old, new = min(times[OLD]), min(times[NEW])
        rows.append((f"({b}, {s}, {h}, {d})", "causal" if causal else "full", old, new,
                     new / old, same, err, flips, dq0.size))
        print(rows[-1], flush=True)
        del q, k, v, do, o, lse, dq0, dk0, dv0, dq1, dk1, dv1, acc0, acc1
        cupy.get_default_memory_pool().free_all_blocks()
    built = sorted({(name, opts) for (file, name, opts, _) in loader._functions
                    if name.startswith("attention_bwd_sm90")})
    print("backward kernels loaded:", *built, sep="\n  ")
    print(f"\nmin over {ROUNDS} alternated rounds, us per backward (prep + main + convert)")
    print("| (b, s, h, d) | mask | old | new | new/old | dk, dv identical | dq_acc rel err "
          "| dq bf16 elems differing |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for shape, m, old, new, ratio, same, err, flips, n in rows:
        print(f"| {shape} | {m} | {old:.1f} | {new:.1f} | {ratio:.3f} | {same} | {err:.1e} "
              f"| {flips} of {n} |")
    bad = [r for r in rows if not r[5] or not r[6] < 1e-5]
    print("CHECKS", "FAILED: " + str(bad) if bad else "passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

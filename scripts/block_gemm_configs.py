"""Issue 20's shape (M=4096, N=7168, K=16384, DeepGEMM's) on one GPU: TFLOP/s of the pipelined
block-scaled FP8 GEMM (B in 128x128 blocks; block1: 1x128) and of the per-tensor split and
fast GEMMs, for each tile configuration (BN, stages) that fits, every kernel timed
interleaved (CUDA events over --iters back-to-back calls; best and median of --rounds, after
--sustain seconds of load: the clocks under sustained load), the outputs checked against the
first configuration's of their kind (bit for bit: the tile does not change a row's sums).

    python scripts/block_gemm_configs.py [--m 4096 --n 7168 --k 16384] [--data normal|bits]
        [--sustain 10] [--kinds block,split] [--flush 8e9] [--peer]
    python scripts/block_gemm_configs.py --one block:256,3   # one call of one kernel (ncu)
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CONFIGS = [(256, 3), (192, 4), (128, 6), (128, 5), (128, 4)]


def operands(m, n, k, data="normal"):
    """A, B codes (normal: N(0, 1) cast to E4M3 with scale 1, as the GEMM bench's; bits:
    uniform random codes, NaN excluded) and their factors."""
    import cupy
    import tecupy
    rng = cupy.random.default_rng(0)
    if data == "normal":
        a, b = (tecupy.quantize(rng.standard_normal(s, np.float32), 1.0, "e4m3").data
                for s in ((m, k), (n, k)))
    else:
        a = rng.integers(0, 0x7E, (m, k), dtype=np.int32).astype(np.uint8)
        b = rng.integers(0, 0x7E, (n, k), dtype=np.int32).astype(np.uint8)
    sa = rng.uniform(0.5, 2, (-(-k // 128), m), dtype=np.float32)  # [nk, M]
    sb = {2: rng.uniform(0.5, 2, (-(-n // 128), -(-k // 128)), dtype=np.float32),  # 128x128
          1: rng.uniform(0.5, 2, (-(-k // 128), n), dtype=np.float32)}  # 1x128: [nk, N]
    return a, sa, b, sb


# kind -> (split accumulation, block scaling's SCALE): "block" is the pipelined block kernel
# (B in 128x128 blocks: fprop, dgrad), "block1" the same with B in 1x128 blocks (wgrad)
KINDS = {"block": (True, 2), "block1": (True, 1), "split": (True, 0), "fast": (False, 0)}


def kernels(m, n, k, only=None, data="normal", kinds=KINDS, peer=False):
    """{name: call()} for every kind and configuration that fits in shared memory (only:
    that one name); peer: torch._scaled_mm's blockwise GEMM too, where torch has it."""
    import cupy
    import tecupy
    from tecupy.fp8 import E4M3
    from tecupy.kernels import fp8_gemm as G
    from tecupy.kernels.block_scaling import pipe_b_factors
    a, sa, b, sb = operands(m, n, k, data)
    one = cupy.ones(1, np.float32)
    bf16 = tecupy.bfloat16
    out = {}
    for bn, stages in CONFIGS:
        for kind in kinds:
            split, scale = KINDS[kind]
            config = (bn, stages, split, 1)
            pipe = scale > 0
            if only not in (None, f"{kind}:{bn},{stages}"):
                continue
            staged = G.tma_store(np.dtype(bf16), None, False, bn)
            if G.smem_bytes(config, staged, scale, k if pipe else None) > G.SMEM_MAX:
                continue
            plan = G._plan(config, E4M3, E4M3, bf16, True, False, None, m, n, k, scale=scale,
                           pipe=pipe, pdl=False)
            args = ((a, sa, b, pipe_b_factors(sb[2]) if scale == 2 else sb[1]) if scale
                    else (a, one, b, one))

            def call(plan=plan, args=args):
                return G._run(plan, args[0], args[1], args[2], args[3], None, None, None, None)
            out[f"{kind}:{bn},{stages}"] = call
    if only is None and peer:  # cuBLASLt's blockwise GEMM (the GEMM bench's peer) per kind
        from tecupy.bench.gemm import _torch_block_peer
        for kind in (k for k in kinds if KINDS[k][1]):
            scale = KINDS[kind][1]
            call, why = _torch_block_peer(a, sa, b, sb[scale], scale)
            if call is None:
                print(f"(no peer: {why})")
            else:
                out[f"cuBLASLt {kind}"] = call
    return out


def timed(ks, iters, rounds, sustain):
    """{name: [ms per call of each round]}: `rounds` rounds of `iters` back-to-back calls
    of each kernel in turns, every other round in reverse order (CUDA events), after
    `sustain` seconds of the first kernel alone (the clocks under sustained load, as the
    GEMM bench's later shapes run)."""
    import cupy
    from tecupy.bench.timing import in_turns
    from tecupy.bench.timing import sustain as load
    load(next(iter(ks.values())), sustain)
    times = {name: [] for name in ks}
    for name, call in in_turns(ks.items(), rounds):
        start = cupy.cuda.get_current_stream().record()
        for _ in range(iters):
            call()
        end = cupy.cuda.get_current_stream().record()
        end.synchronize()
        times[name].append(cupy.cuda.get_elapsed_time(start, end) / iters)
    return times


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", type=int, default=4096)
    ap.add_argument("--n", type=int, default=7168)
    ap.add_argument("--k", type=int, default=16384)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--one", default=None)
    ap.add_argument("--data", choices=("normal", "bits"), default="normal")
    ap.add_argument("--sustain", type=float, default=0.0,
                    help="seconds of load before timing (the clocks under sustained load)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated KINDS")
    ap.add_argument("--peer", action="store_true",
                    help="torch._scaled_mm's blockwise GEMM (cuBLASLt) too, where torch has it")
    ap.add_argument("--flush", type=float, default=0.0,
                    help="bytes zeroed before each call, kernel timed alone (DeepGEMM's "
                         "method: 8e9); 0: back-to-back calls")
    args = ap.parse_args()
    import cupy
    ks = kernels(args.m, args.n, args.k, args.one, args.data, args.kinds.split(","),
                 args.peer)
    if args.one:
        ks[args.one]()
        cupy.cuda.Device().synchronize()
        return
    ref, same = {}, {}
    for name, call in ks.items():
        y = call()
        if ":" not in name:  # (the peer: its own sums)
            same[name] = "-"
            continue
        kind = name.split(":")[0]
        ref.setdefault(kind, y)
        same[name] = bool((y.view(np.uint16) == ref[kind].view(np.uint16)).all())
    flops = 2.0 * args.m * args.n * args.k
    gpu = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    if args.flush:  # DeepGEMM's method (bench.timing.flushed_ms)
        from tecupy.bench.timing import flushed_ms
        print(f"M={args.m} N={args.n} K={args.k}, {gpu}, {args.data} data, {args.iters} calls "
              f"of each kernel, each after a {args.flush / 1e9:g} GB memset (L2 flush)")
        print("| kernel:BN,stages | mean ms | TFLOP/s | same bits as the first |")
        print("| --- | --- | --- | --- |")
        for name, call in ks.items():
            xp = None
            if ":" not in name:  # (the peer: torch's events and stream)
                import torch as xp
            ms = flushed_ms(call, args.iters, int(args.flush), xp)
            print(f"| {name} | {ms:.3f} | {flops / ms / 1e9:.0f} | {same[name]} |")
        return
    times = timed(ks, args.iters, args.rounds, args.sustain)
    print(f"M={args.m} N={args.n} K={args.k}, {gpu}, {args.data} data, {args.rounds} rounds "
          f"of {args.iters} calls each in turns after {args.sustain:g} s of load")
    print("| kernel:BN,stages | best ms | TFLOP/s best | median | same bits as the first |")
    print("| --- | --- | --- | --- | --- |")
    for name, t in times.items():
        best, med = min(t), float(np.median(t))
        print(f"| {name} | {best:.3f} | {flops / best / 1e9:.0f} | {flops / med / 1e9:.0f} | "
              f"{same[name]} |")


if __name__ == "__main__":
    main()

"""The sequence-parallel all-gather + column-parallel FP8 GEMM at a tensor-parallel rank's
shape, on --gpus GPUs of one host (issue 25), timed four ways on each rank:
  gemm     the GEMM alone on codes already gathered (the floor)
  ag       NCCL's all-gather of the codes alone
  nccl     NCCL's all-gather, then the GEMM (today's FP8 sequence-parallel forward)
  overlap  each rank's chunk pushed by the copy engine into every peer's buffer
           (peer.PeerBuffer, cudaMemcpyAsync between GPUs) with a flag after it, and the
           GEMM reading each chunk as its flag comes (kernels/fp8_gemm.gemm_chunked): its
           own chunk first, no SM given to the exchange
us per call on rank 0 (CUDA events over --iters calls back to back, best of --rounds), the
overlap's output compared bit for bit with nccl's on every rank.

    python scripts/ag_overlap.py --gpus 4 [--m 8192 --k 4096 --n 3072] [--graph]

Defaults: the quickstart layer's qkv at TP=4 (sequence 2048 x batch 4 = 8192 rows, hidden
4096, 3 x 4096 / 4 = 3072 columns a rank). --graph also times overlap captured in a CUDA
graph (stream memory operations and peer copies are capturable).
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _codes(rng, shape):
    import cupy
    return rng.integers(0, 0x7E, shape, dtype=np.int32).astype(cupy.uint8)  # (no NaN codes)


def run(group, m, k, n, iters, rounds, graph, streams):
    import cupy
    import tecupy
    from tecupy.distributed.peer import PeerBuffer, wait_flag, write_flag
    from tecupy.fp8 import E4M3
    from tecupy.kernels import fp8_gemm as G
    r, p = group.rank, group.size
    rows = m // p
    rng = cupy.random.default_rng(100 + r)
    own, w = _codes(rng, (rows, k)), _codes(rng, (n, k))
    s = cupy.full(1, 0.01, np.float32)
    config = G.default_config(m, n, False, k=k)[:3] + (1,)
    full = cupy.empty((m, k), np.uint8)

    def gemm(a):
        return G.launch(config, a, E4M3, s, w, E4M3, s, tecupy.bfloat16, None)

    def nccl():
        group.all_gather_into(own, full)
        return gemm(full)

    # each chunk in `streams` slices, a copy stream per slice: the slices of one chunk
    # travel at once on several copy engines, the chunks still one after another (in the
    # order the GEMM reads them); a flag per slice (ready), and per slice a flag on the
    # pusher that the receiver has read it (free)
    sl = streams
    buf = PeerBuffer(group, m * k)
    flags, free = PeerBuffer(group, 4 * p * sl), PeerBuffer(group, 4 * p * sl)
    mine = buf.array((m, k), np.uint8)
    ready = flags.array((p * sl,), np.uint32)
    ready[r * sl:(r + 1) * sl] = 1  # (its own chunk: always there at the launch)
    free.array((p * sl,), np.uint32).fill(1)  # every peer's slot may be written
    cupy.cuda.Device().synchronize()
    group.barrier()
    pushes = [cupy.cuda.Stream(non_blocking=True) for _ in range(sl)]
    step = rows * k // sl

    def overlap():
        main = cupy.cuda.get_current_stream()
        mine[r * rows:(r + 1) * rows] = own  # (the layer's norm would write it here)
        ev = main.record()
        for push in pushes:
            push.wait_event(ev)
        for j in range(1, p):  # (to r - 1 first: rank r receives r + 1's chunk first, the
            q = (r - j) % p      # order its GEMM reads the chunks in after its own)
            for i, push in enumerate(pushes):
                f, off = 4 * (r * sl + i), (r * sl + i) * step
                wait_flag(free.ptr + 4 * (q * sl + i), 1, push)  # q has read the last one
                write_flag(free.ptr + 4 * (q * sl + i), 0, push)
                cupy.cuda.runtime.memcpyAsync(buf.peer[q] + off, buf.ptr + off, step,
                                              cupy.cuda.runtime.memcpyDefault, push.ptr)
                write_flag(flags.peer[q] + f, 1, push)
        pushed = [push.record() for push in pushes]
        y = G.gemm_chunked(mine, E4M3, s, w, E4M3, s, tecupy.bfloat16, None, ready, rows // sl,
                           r * sl)
        for c in range(p * sl):
            if c // sl != r:
                write_flag(flags.ptr + 4 * c, 0, main)  # reset by the waiter
                write_flag(free.peer[c // sl] + 4 * (r * sl + c % sl), 1, main)  # may push
        for e in pushed:  # (the pushes read the own slot; a graph joins them here)
            main.wait_event(e)
        return y

    gathered = nccl()
    got = overlap()
    cupy.cuda.Device().synchronize()
    same = bool((got.view(np.uint16) == gathered.view(np.uint16)).all())
    gathered_codes_same = bool((mine == full).all())

    def timed(fn):
        best = float("inf")
        for _ in range(rounds):
            group.barrier()
            cupy.cuda.Device().synchronize()
            start = cupy.cuda.get_current_stream().record()
            for _ in range(iters):
                fn()
            end = cupy.cuda.get_current_stream().record()
            end.synchronize()
            best = min(best, cupy.cuda.get_elapsed_time(start, end) * 1e3 / iters)
        return best

    res = {"gemm": timed(lambda: gemm(full)), "ag": timed(lambda: group.all_gather_into(
        own, full)), "nccl": timed(nccl), "overlap": timed(overlap)}
    if graph:
        stream = cupy.cuda.Stream(non_blocking=True)
        with stream:
            overlap()  # (plans made outside the capture)
            stream.synchronize()
            stream.begin_capture()
            overlap()
            g = stream.end_capture()
        group.barrier()
        with stream:
            res["overlap graphed"] = timed(lambda: g.launch(stream))
    cupy.cuda.Device().synchronize()
    group.barrier()
    for b in (buf, flags, free):
        b.close()
    return {"rank": r, "same": same, "codes_same": gathered_codes_same, **res}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--m", type=int, default=8192)
    ap.add_argument("--k", type=int, default=4096)
    ap.add_argument("--n", type=int, default=3072)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--streams", type=int, default=1, help="copy streams (slices of each chunk)")
    args = ap.parse_args()
    from tecupy.distributed.multiproc import spawn
    out = spawn(run, args.gpus, args.m, args.k, args.n, args.iters, args.rounds, args.graph,
                args.streams)
    print(f"M={args.m} K={args.k} N={args.n} on {args.gpus} GPUs, {args.streams} push "
          "streams, us per call")
    keys = [k for k in out[0] if k not in ("rank", "same", "codes_same")]
    print("rank  same  codes  " + "  ".join(f"{k:>15}" for k in keys))
    for o in out:
        print(f"{o['rank']:>4}  {o['same']!s:>5} {o['codes_same']!s:>6}  "
              + "  ".join(f"{o[k]:15.1f}" for k in keys))


if __name__ == "__main__":
    main()

"""python -m tecupy.bench distributed [--nproc N] [--sizes 1,4,16,64,256] [--no-torch]
[--layer small|medium|full] [--bucket-mb 25]: NcclGroup on the GPUs of this host, one process
each (spawned).

1. all_reduce of bf16 buffers of 1-256 MiB: time per call (CUDA events on rank 0, median of
   ITERS calls back to back after a warm-up) and bus bandwidth, nccl-tests' definition:
   bytes * 2 (n - 1) / n / time. PyTorch's torch.distributed all_reduce on the same sizes in
   separate processes (same run) is the peer, where torch is importable.
2. Data parallel: averaging the gradients of the quickstart TransformerLayer (hidden 4096,
   ffn 16384, 32 heads; bf16) with all_reduce_gradients: 25 MiB buckets, one bucket per
   parameter, and everything in one bucket; the time the 256 MiB bus bandwidth predicts.
3. The data-parallel step of the main job's TransformerLayer (--layer, default the
   quickstart layer at seq 2048, batch 4 per rank; bf16, high precision and FP8 delayed
   scaling): one forward + backward per rank and the gradients averaged over the ranks,
   (a) after the backward (tape.gradient, then all_reduce_gradients) and (b) overlapped
   with it (GradientReducer.gradient: Tape.gradient's on_grad hands each gradient over as
   it is final, each bucket is all-reduced on a side stream as it fills), against the
   single-GPU step (rank 0 alone, no all-reduce): ms per step on rank 0 (layer bench's
   rule: CUDA events around back-to-back steps, median of rounds) and weak-scaling
   efficiency = single-GPU step / data-parallel step (issue 25's target: >= 90% at 4 GPUs).
4. Tensor parallel: the same layer and global batch at TP = nproc with sequence parallel
   (heads and ffn split over the ranks, x [seq/n, batch, hidden] per rank; FP8's amaxes
   reduced over the group), one forward + backward, against the single-GPU step of part 3:
   ms per step on rank 0 and the ratio TP step / single-GPU step (issue 25's targets:
   <= 0.6x at TP=2, <= 0.35x at TP=4). --tp-only runs the single-GPU step and this part.
"""
import argparse
import statistics

ITERS, WARMUP = 20, 5
LAYER = (4096, 16384, 32)  # the quickstart layer: hidden, ffn, heads


def _events_ms(fn, iters):
    import cupy
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(iters):
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def _rank(g, sizes_mib, layer_size="full", bucket_mb=25, tp_only=False):
    """-> (all_reduce ms per size, DP rows, DP step rows, TP step rows) of this rank."""
    import cupy

    import tecupy
    out = {"all_reduce": [], "dp": []}
    if tp_only:
        out["steps"] = _step_rows(g, layer_size, bucket_mb, kinds=("single",))
        out["tp"] = _tp_rows(g, layer_size)
        return out
    for mib in sizes_mib:
        x = cupy.ones(mib * 2**20 // 2, dtype=tecupy.bfloat16)
        for _ in range(WARMUP):
            g.all_reduce(x)
        g.barrier()
        out["all_reduce"].append(_events_ms(lambda: g.all_reduce(x), ITERS))
    out["dp"], out["dp_bytes"], out["dp_count"] = _averaging(g)
    out["steps"] = _step_rows(g, layer_size, bucket_mb)
    out["tp"] = _tp_rows(g, layer_size)
    return out


def _averaging(g):
    """Part 2: -> ([(buckets, ms)], gradient bytes, gradient count)."""
    import cupy

    import tecupy
    from tecupy import distributed as dist
    hidden, ffn, heads = LAYER
    layer = tecupy.nn.TransformerLayer(hidden, ffn, heads, params_dtype=tecupy.bfloat16,
                                       device="cuda", seed=0)
    grads = [cupy.full(p.shape, 0.5, p.dtype) for p in reversed(layer.parameters())]
    del layer
    nbytes, rows = sum(a.nbytes for a in grads), []
    for name, mb in (("25 MiB buckets", 25), ("one per parameter", 0),
                     ("one bucket", nbytes / 2**20 + 1)):
        for _ in range(2):
            dist.all_reduce_gradients(grads, g, bucket_mb=mb)
        g.barrier()
        ms = _events_ms(lambda: dist.all_reduce_gradients(grads, g, bucket_mb=mb), 5)
        rows.append((name, ms))
    return rows, nbytes, len(grads)


def dp_steps(layer, x, dy, recipe, group, bucket_mb=25):
    """The three steps that part 3 times, each one forward + backward of `layer` on this
    rank's (x, dy) -> its gradients (a dict by parameter name): single (no all-reduce: the
    one-GPU step), after (tape.gradient, then all_reduce_gradients over the buckets the
    reducer uses) and overlapped (GradientReducer.gradient: buckets all-reduced during the
    backward). Any array module: tests run them on ThreadGroup ranks."""
    import tecupy
    from tecupy import distributed as dist
    reducer = dist.GradientReducer(group, layer, bucket_mb)

    def forward():
        with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=recipe is not None,
                                                        fp8_recipe=recipe):
            y = layer(x)
        return tape, y

    def single():
        tape, y = forward()
        return tape.gradient(y, layer, output_grad=dy)

    def after():
        grads = single()
        # the reducer's buckets: its default order is the reverse of the parameters'
        dist.all_reduce_gradients(list(grads.values())[::-1], group, bucket_mb)
        return grads

    def overlapped():
        tape, y = forward()
        return reducer.gradient(tape, y, output_grad=dy)
    return {"single": single, "after": after, "overlapped": overlapped}


def _step_rows(g, layer_size, bucket_mb, kinds=("single", "after", "overlapped")):
    """Part 3 on this rank: {precision: {step: (GPU ms, host ms) or None}} (rank 0 times
    "single" alone; the other ranks wait at a barrier meanwhile)."""
    import cupy

    from tecupy.__main__ import build
    from .layer import SIZES, _rate, _recipe
    rows = {}
    for name, recipe in (("HP", None), ("FP8", _recipe())):
        layer, x, dy = build(SIZES[layer_size], "cuda")
        steps = dp_steps(layer, x, dy, recipe, g, bucket_mb)
        rows[name] = {}
        for kind, fn in steps.items():
            if kind not in kinds:
                continue
            g.barrier()
            alone = kind == "single"
            rows[name][kind] = _rate(fn, cupy) if g.rank == 0 or not alone else None
            g.barrier()
        del layer, x, dy, steps
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


def tp_build(shape, group, device, sequence_parallel=True):
    """Part 4's layer: the quickstart TransformerLayer of `shape` (bench layer's SIZES) and
    seed 0 split over `group` (TP = its size, with sequence parallel: this rank's chunk of
    the sequence of x and dy, as tecupy.__main__.build makes them for one GPU)."""
    import numpy as np

    import tecupy
    from tecupy import distributed as dist
    hidden, ffn, heads, seq, batch = shape
    dtype = tecupy.bfloat16 if device == "cuda" else np.float32
    layer = tecupy.nn.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0,
                                       attention_dropout=0.0, params_dtype=dtype, device=device,
                                       seed=0, tp_group=group,
                                       sequence_parallel=sequence_parallel)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((seq, batch, hidden)).astype(dtype)
    dy = (rng.standard_normal((seq, batch, hidden)) * 1e-2).astype(dtype)
    if sequence_parallel:
        x, dy = dist.shard(x, group, 0), dist.shard(dy, group, 0)
    return layer, layer.xp.asarray(x), layer.xp.asarray(dy)


def tp_step(layer, x, dy, recipe):
    """One forward + backward of a tensor-parallel layer -> its gradients (by name)."""
    import tecupy

    def step():
        with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=recipe is not None,
                                                        fp8_recipe=recipe):
            y = layer(x)
        return tape.gradient(y, layer, output_grad=dy)
    return step


def _tp_rows(g, layer_size):
    """Part 4 on this rank: {precision: (GPU ms, host ms)} of the TP=size+SP step (every
    rank runs it: its collectives need them all)."""
    import cupy

    from .layer import SIZES, _rate, _recipe
    rows = {}
    for name, recipe in (("HP", None), ("FP8", _recipe())):
        layer, x, dy = tp_build(SIZES[layer_size], g, "cuda")
        g.barrier()
        rows[name] = _rate(tp_step(layer, x, dy, recipe), cupy)
        g.barrier()
        del layer, x, dy
        cupy.get_default_memory_pool().free_all_blocks()
    return rows


TP_TARGETS = {2: 0.6, 4: 0.35}  # issue 25: TP step / single-GPU step, sequence parallel on


def print_tp(tp_rows, step_rows, n, layer_size):
    """Part 4's table: rank 0's TP step against the single-GPU step, and the ratio."""
    from .layer import SIZES
    target = TP_TARGETS.get(n)
    print(f"\nTensor parallel TP={n} with sequence parallel, TransformerLayer {layer_size} "
          f"{SIZES[layer_size]} (the same global batch as one GPU); rank 0's GPU ms per step"
          f"; issue 25's target: {'<= %.2fx' % target if target else 'none at this size'}")
    print("| precision | 1 GPU ms | TP ms | host ms | TP / 1 GPU | target |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, (gpu, host) in tp_rows.items():
        one = step_rows[name]["single"][0]
        ratio = gpu / one
        verdict = "-" if target is None else ("met" if ratio <= target else "missed")
        print(f"| {name} | {one:.2f} | {gpu:.2f} | {host:.2f} | {ratio:.2f}x | {verdict} |")


def _torch_rank(rank, n, port, sizes_mib, queue):
    import os

    import torch
    import torch.distributed as tdist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    tdist.init_process_group("nccl", rank=rank, world_size=n)
    times = []
    for mib in sizes_mib:
        x = torch.ones(mib * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(WARMUP):
            tdist.all_reduce(x)
        torch.cuda.synchronize()
        ms = []
        for _ in range(ITERS):
            start = torch.cuda.Event(enable_timing=True)
            stop = torch.cuda.Event(enable_timing=True)
            start.record()
            tdist.all_reduce(x)
            stop.record()
            stop.synchronize()
            ms.append(start.elapsed_time(stop))
        times.append(statistics.median(ms))
    tdist.destroy_process_group()
    if rank == 0:
        queue.put(times)


def _torch_peer(n, sizes_mib):
    """torch.distributed all_reduce ms per size (None without torch, or if it fails)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return None
    import multiprocessing as mp

    from tecupy.distributed.multiproc import free_port
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, n, port, sizes_mib, queue))
             for r in range(n)]
    for p in procs:
        p.start()
    try:
        return queue.get(timeout=300)
    except Exception as e:  # noqa: BLE001 - the peer is optional: say why it is missing
        print(f"(PyTorch peer failed: {type(e).__name__}: {e})")
        return None
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tecupy.bench distributed", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU)")
    p.add_argument("--sizes", default="1,4,16,64,256", help="all_reduce sizes in MiB")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch peer")
    p.add_argument("--layer", choices=("small", "medium", "full"), default="full",
                   help="the data-parallel step's TransformerLayer (bench layer's --size)")
    p.add_argument("--bucket-mb", type=float, default=25,
                   help="the data-parallel step's bucket size in MiB")
    p.add_argument("--tp-only", action="store_true",
                   help="only the single-GPU step and part 4 (tensor parallel)")
    args = p.parse_args(argv)
    import tecupy
    if not tecupy.gpu_available():
        raise SystemExit("tecupy.bench needs a CUDA device (CuPy sees none)")
    run(args)


def run(args):
    import cupy

    from tecupy import distributed as dist
    from .timing import gpu_name
    n = args.nproc or cupy.cuda.runtime.getDeviceCount()
    if n < 2:
        raise SystemExit(f"tecupy.bench distributed needs 2+ GPUs (this host has {n})")
    sizes = [int(s) for s in args.sizes.split(",")]
    tp_only = getattr(args, "tp_only", False)
    got = dist.spawn(_rank, n, sizes, args.layer, args.bucket_mb, tp_only,
                     timeout=900)[0]
    if tp_only:
        print(f"GPU: {gpu_name()} x {n}")
        print_tp(got["tp"], got["steps"], n, args.layer)
        return got, None
    peer = None if args.no_torch else _torch_peer(n, sizes)
    print(f"GPU: {gpu_name()} x {n}; all_reduce of bf16, median of {ITERS} calls")
    print("| MiB | tecupy ms | bus GB/s | torch ms | bus GB/s | tecupy / torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    bus = lambda mib, ms: mib * 2**20 * 2 * (n - 1) / n / (ms * 1e-3) / 1e9  # noqa: E731
    for i, mib in enumerate(sizes):
        ms = got["all_reduce"][i]
        tail = "| - | - | - |" if peer is None else \
            f"| {peer[i]:.3f} | {bus(mib, peer[i]):.0f} | {peer[i] / ms:.2f}x |"
        print(f"| {mib} | {ms:.3f} | {bus(mib, ms):.0f} {tail}")
    big = bus(sizes[-1], got["all_reduce"][-1]) * 1e9
    mib = got["dp_bytes"] / 2**20
    ideal = got["dp_bytes"] * 2 * (n - 1) / n / big * 1e3
    print(f"\nData parallel: the quickstart layer's {got['dp_count']} gradients ({mib:.0f} MiB "
          f"bf16) averaged with all_reduce_gradients; {ideal:.2f} ms at the "
          f"{sizes[-1]} MiB bus bandwidth")
    print("| buckets | ms | vs that bandwidth |")
    print("| --- | --- | --- |")
    for name, ms in got["dp"]:
        print(f"| {name} | {ms:.2f} | {ideal / ms:.0%} |")
    print_steps(got["steps"], n, args.layer, args.bucket_mb)
    print_tp(got["tp"], got["steps"], n, args.layer)
    return got, peer


def print_steps(rows, n, layer_size, bucket_mb):
    """Part 3's table: ms per step on rank 0 and weak-scaling efficiency."""
    from .layer import SIZES
    print(f"\nData-parallel step of the TransformerLayer {layer_size} {SIZES[layer_size]} "
          f"(hidden, ffn, heads, seq, batch per rank), {bucket_mb:g} MiB buckets; rank 0's "
          "GPU ms and host ms per step; weak scaling = single-GPU step / this step")
    print("| precision | step | GPU ms | host ms | weak scaling |")
    print("| --- | --- | --- | --- | --- |")
    labels = {"single": "1 GPU, no all-reduce", "after": f"{n} GPUs, all-reduce after the "
              "backward", "overlapped": f"{n} GPUs, all-reduce overlapped (on_grad)"}
    for name, steps in rows.items():
        one = steps["single"][0]
        for kind, (gpu, host) in steps.items():
            print(f"| {name} | {labels[kind]} | {gpu:.2f} | {host:.2f} | {one / gpu:.1%} |")

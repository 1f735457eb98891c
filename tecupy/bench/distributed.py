"""python -m tecupy.bench distributed [--nproc N] [--sizes 1,4,16,64,256] [--no-torch]
[--layer small|medium|full] [--bucket-mb 25[,100,...]] [--nccl-channels 0[,8,...]]
[--reduce all_reduce[,reduce_scatter]] [--optimizer none|adamw|sgd] [--dp-only | --tp-only]:
NcclGroup on the GPUs of this host, one process each (spawned).

1. all_reduce of bf16 buffers of 1-256 MiB: time per call (CUDA events on rank 0, median of
   ITERS calls back to back after a warm-up) and bus bandwidth, nccl-tests' definition:
   bytes * 2 (n - 1) / n / time. PyTorch's torch.distributed all_reduce on the same sizes in
   separate processes (same run) is the peer, where torch is importable.
2. Data parallel: averaging the gradients of the quickstart TransformerLayer (hidden 4096,
   ffn 16384, 32 heads; bf16) with all_reduce_gradients: for each --bucket-mb (a gradient of
   at least that size all-reduced in place, smaller ones copied into buckets), one per
   parameter (everything in place) and everything in one bucket (everything copied); the
   time the largest size's bus bandwidth predicts.
3. The data-parallel sweep: the step of the main job's TransformerLayer (--layer, default
   the quickstart layer at seq 2048, batch 4 per rank; bf16, high precision and FP8 delayed
   scaling), one forward + backward per rank and the gradients averaged over the ranks,
   (a) after the backward and (b) overlapped with it (Tape.gradient's on_grad hands each
   gradient over as it is final, each bucket is reduced on a side stream as it fills),
   against the single-GPU step (rank 0 alone, no reduction), for every configuration:
   each NCCL channel count (--nccl-channels N: NCCL_MIN/MAX_NCHANNELS and NCCL_MIN/MAX_CTAS
   set to N in the ranks' environment; NCCL reads them once per process, so each count is
   a spawn of its own; 0: NCCL's own choice, or what the environment says), each bucket
   size and each reduction (--reduce all_reduce: GradientReducer / all_reduce_gradients;
   reduce_scatter: ZeroOptimizer, ZeRO-1, the optimizer over each rank's shard then the
   parameters all-gathered, which needs --optimizer). With --optimizer every step, the
   single-GPU one too, ends with that optimizer's step (lr 1e-6). One table row per
   configuration: rank 0's GPU ms per step (layer bench's rule: CUDA events around
   back-to-back steps, median of rounds) and weak-scaling efficiency = single-GPU step /
   data-parallel step (issue 25's target: >= 90% at 4 GPUs), with each channel count's bus
   bandwidth at 64 MiB.
4. Tensor parallel: the same layer and global batch at TP = nproc with sequence parallel
   (heads and ffn split over the ranks, x [seq/n, batch, hidden] per rank; FP8's amaxes
   reduced over the group), one forward + backward, against the single-GPU step of part 3:
   ms per step on rank 0 and the ratio TP step / single-GPU step (issue 25's targets:
   <= 0.6x at TP=2, <= 0.35x at TP=4), with the comm-GEMM overlap off (NCCL all-gather /
   reduce-scatter) and on (tecupy/distributed/overlap.py's rings), a row each.
Parts 1, 2 and 4 run in the first channel count's processes. --dp-only: part 3 alone (the
sweep); --tp-only: the single-GPU step and part 4.
"""
import argparse
import statistics

from .distributed_tp import _tp_rows, print_tp

ITERS, WARMUP = 20, 5
LAYER = (4096, 16384, 32)  # the quickstart layer: hidden, ffn, heads
REDUCES = ("all_reduce", "reduce_scatter")
OPTIMIZERS = {"adamw": ("AdamW", {"lr": 1e-6, "weight_decay": 0.01}),
              "sgd": ("SGD", {"lr": 1e-6, "momentum": 0.9})}
BUS_MIB = 64  # each channel count's bandwidth probe


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


def _rank(g, cfg, parts):
    """This rank's measurements; parts: "all" (1-4), "dp" (3) or "tp" (single step, 4)."""
    out = {}
    if parts == "tp":
        out["steps"] = _sweep_rows(g, cfg, single_only=True, graphed=True)
        out["tp"] = _tp_rows(g, cfg["layer"])
        return out
    out["bus"] = _bus(g, cfg["reduces"])
    if parts == "all":
        out["all_reduce"] = [_collective_ms(g, "all_reduce", mib) for mib in cfg["sizes"]]
        out["dp"], out["dp_bytes"], out["dp_count"] = _averaging(g, cfg["buckets"])
    out["steps"] = _sweep_rows(g, cfg, graphed=parts == "all")
    if parts == "all":
        out["tp"] = _tp_rows(g, cfg["layer"])
    return out


def _collective_ms(g, op, mib):
    """ms per call of g.<op> on mib MiB of bf16 (median of ITERS after WARMUP)."""
    import cupy

    import tecupy
    x = cupy.ones(mib * 2**20 // 2, dtype=tecupy.bfloat16)
    call = getattr(g, op)
    for _ in range(WARMUP):
        call(x)
    g.barrier()
    return _events_ms(lambda: call(x), ITERS)


def _bus(g, reduces):
    """{collective: bus GB/s at BUS_MIB MiB} (nccl-tests: all_reduce moves 2 (n - 1) / n of
    the bytes per rank, reduce_scatter (n - 1) / n)."""
    n, nbytes = g.size, BUS_MIB * 2**20
    return {op: nbytes * (2 if op == "all_reduce" else 1) * (n - 1) / n
            / (_collective_ms(g, op, BUS_MIB) * 1e-3) / 1e9
            for op in REDUCES if op == "all_reduce" or op in reduces}


def _averaging(g, buckets):
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
    for name, mb in ([(f"{mb:g} MiB buckets", mb) for mb in buckets]
                     + [("one per parameter", 0), ("one bucket", nbytes / 2**20 + 1)]):
        for _ in range(2):
            dist.all_reduce_gradients(grads, g, bucket_mb=mb)
        g.barrier()
        ms = _events_ms(lambda: dist.all_reduce_gradients(grads, g, bucket_mb=mb), 5)
        rows.append((name, ms))
    return rows, nbytes, len(grads)


def _optimizer(name):
    """(class, kwargs) of --optimizer `name`, or None for "none"."""
    if name == "none":
        return None
    import tecupy.optim
    cls, kw = OPTIMIZERS[name]
    return getattr(tecupy.optim, cls), dict(kw)


def dp_steps(layer, x, dy, recipe, group, bucket_mb=25, reduce="all_reduce", optimizer="none"):
    """The steps that part 3 times, each one forward + backward of `layer` on this rank's
    (x, dy), then the optimizer's step unless optimizer is "none": single (no reduction:
    the one-GPU step), after (the reduction after the backward) and overlapped (during
    it); reduce "all_reduce" (all_reduce_gradients over the reducer's buckets /
    GradientReducer.gradient, then the optimizer over every parameter) or "reduce_scatter"
    (ZeroOptimizer: reduce-scattered, this rank's shard stepped, the parameters
    all-gathered). -> {name: step}; a step returns the gradients it reduced (a dict by
    name; ShardedGradients under ZeRO). Any array module: tests run them on ThreadGroup
    ranks."""
    import tecupy
    from tecupy import distributed as dist
    spec, made = _optimizer(optimizer), {}
    if reduce == "reduce_scatter":
        if spec is None:
            raise ValueError("dp_steps: reduce='reduce_scatter' (ZeRO-1) steps an optimizer "
                             "over each rank's shard: pass optimizer='adamw' or 'sgd'")
        zero = dist.ZeroOptimizer(spec[0], layer, group, bucket_mb, **spec[1])
    else:
        reducer = dist.GradientReducer(group, layer, bucket_mb)

    def optimize(grads):  # (the plain optimizer made at its first step: single may not run)
        if spec is None:
            return grads
        if "opt" not in made:
            made["opt"] = spec[0](layer.named_parameters(), **spec[1])
        made["opt"].step(grads)
        return grads

    def forward():
        with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=recipe is not None,
                                                        fp8_recipe=recipe):
            y = layer(x)
        return tape, y

    def single():
        tape, y = forward()
        return optimize(tape.gradient(y, layer, output_grad=dy))

    def after():
        tape, y = forward()
        grads = tape.gradient(y, layer, output_grad=dy)
        if reduce == "reduce_scatter":
            zero.step(grads)
            return grads
        # the reducer's buckets: its default order is the reverse of the parameters'
        dist.all_reduce_gradients(list(grads.values())[::-1], group, bucket_mb)
        return optimize(grads)

    def overlapped():
        tape, y = forward()
        if reduce == "reduce_scatter":
            shards = zero.gradient(tape, y, output_grad=dy)
            zero.step(shards)
            return shards
        return optimize(reducer.gradient(tape, y, output_grad=dy))
    return {"single": single, "after": after, "overlapped": overlapped}


def _timed_graphed(g, layer, x, dy, recipe):
    """(GPU ms, host ms) of the layer's step captured in a CUDA graph (make_graphed_step),
    on rank 0 alone; None on the other ranks, off a GPU, or where the capture raised (it
    is said on stdout; the graphed TP rows then have nothing to compare with)."""
    import cupy

    from tecupy._array import is_cupy
    from .distributed_tp import graphed_rate
    g.barrier()
    got = None
    if g.rank == 0 and is_cupy(x):
        try:
            got = graphed_rate(layer, x, dy, recipe)
        except Exception as e:  # noqa: BLE001 - reported, not fatal: the eager rows stay
            print(f"single-GPU step not graphed: {type(e).__name__}: {e}", flush=True)
    cupy.get_default_memory_pool().free_all_blocks()
    g.barrier()
    return got


def _timed(g, step, alone=False):
    """(GPU ms, host ms) of `step` on rank 0 (alone: the other ranks wait meanwhile)."""
    import cupy

    from .layer import _rate
    g.barrier()
    got = _rate(step, cupy) if g.rank == 0 or not alone else None
    g.barrier()
    return got


def _sweep_rows(g, cfg, single_only=False, graphed=False):
    """Part 3 on this rank: {precision: {"single": (GPU ms, host ms) or None (ranks > 0),
    (bucket_mb, reduce, "after" | "overlapped"): (GPU ms, host ms)}}; graphed (for part
    4): "single graphed" too, the single step in a CUDA graph (None off a GPU)."""
    import cupy

    from tecupy.__main__ import build
    from .layer import SIZES, _recipe
    configs = [] if single_only else [(mb, red) for mb in cfg["buckets"]
                                      for red in cfg["reduces"]]
    pool, rows = cupy.get_default_memory_pool(), {}
    for name, recipe in (("HP", None), ("FP8", _recipe())):
        layer, x, dy = build(SIZES[cfg["layer"]], "cuda")
        single = dp_steps(layer, x, dy, recipe, g, optimizer=cfg["optimizer"])["single"]
        rows[name] = {"single": _timed(g, single, alone=True)}
        del single
        if graphed:  # (part 4's graphed rows compare with the single step graphed too)
            rows[name]["single graphed"] = _timed_graphed(g, layer, x, dy, recipe)
        for mb, red in configs:
            steps = dp_steps(layer, x, dy, recipe, g, mb, red, cfg["optimizer"])
            for kind in ("after", "overlapped"):
                rows[name][(mb, red, kind)] = _timed(g, steps[kind])
            del steps
            pool.free_all_blocks()
        del layer, x, dy
        pool.free_all_blocks()
    return rows


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
    p.add_argument("--bucket-mb", default="25",
                   help="bucket sizes in MiB, comma-separated (a gradient of at least that "
                        "size is reduced alone, with no copy)")
    p.add_argument("--nccl-channels", default="0",
                   help="NCCL channel counts, comma-separated (0: NCCL's choice); one spawn "
                        "each")
    p.add_argument("--reduce", default="all_reduce",
                   help="all_reduce and/or reduce_scatter (ZeRO-1; needs --optimizer), "
                        "comma-separated")
    p.add_argument("--optimizer", choices=("none", "adamw", "sgd"), default="none",
                   help="the optimizer step ending every step of part 3 (lr 1e-6)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--dp-only", action="store_true", help="only part 3 (the sweep)")
    only.add_argument("--tp-only", action="store_true",
                      help="only the single-GPU step and part 4 (tensor parallel)")
    args = p.parse_args(argv)
    cfg = config(args)
    import tecupy
    if not tecupy.gpu_available():
        raise SystemExit("tecupy.bench needs a CUDA device (CuPy sees none)")
    run(args, cfg)


def config(args):
    """The checked lists of the command line -> the ranks' configuration (a dict)."""
    def listed(text, conv, option):
        try:
            values = [conv(v) for v in str(text).split(",")]
        except ValueError:
            values = []
        if not values or any(v < 0 for v in values):
            raise SystemExit(f"{option}: a comma-separated list of numbers >= 0; got {text!r}")
        return values
    reduces = str(args.reduce).split(",")
    bad = [r for r in reduces if r not in REDUCES]
    if bad or not reduces:
        raise SystemExit(f"--reduce: all_reduce and/or reduce_scatter, comma-separated; got "
                         f"{args.reduce!r}")
    if "reduce_scatter" in reduces and args.optimizer == "none":
        raise SystemExit("--reduce reduce_scatter (ZeRO-1) steps an optimizer over each "
                         "rank's shard: add --optimizer adamw (or sgd)")
    return {"sizes": listed(args.sizes, int, "--sizes"), "layer": args.layer,
            "buckets": listed(args.bucket_mb, float, "--bucket-mb"),
            "channels": listed(args.nccl_channels, int, "--nccl-channels"),
            "reduces": reduces, "optimizer": args.optimizer}


def channel_env(channels):
    """The variables that pin NCCL to `channels` channels ({} for 0: NCCL's own choice, or
    the environment's). NCCL reads them once per process, at its first communicator."""
    if not channels:
        return {}
    v = str(int(channels))
    return {"NCCL_MIN_NCHANNELS": v, "NCCL_MAX_NCHANNELS": v, "NCCL_MIN_CTAS": v,
            "NCCL_MAX_CTAS": v}


def run(args, cfg=None):
    import cupy

    from tecupy import distributed as dist
    from .timing import gpu_name
    cfg = config(args) if cfg is None else cfg
    n = args.nproc or cupy.cuda.runtime.getDeviceCount()
    if n < 2:
        raise SystemExit(f"tecupy.bench distributed needs 2+ GPUs (this host has {n})")
    if args.tp_only:
        got = dist.spawn(_rank, n, cfg, "tp", env=channel_env(cfg["channels"][0]),
                         timeout=900)[0]
        print(f"GPU: {gpu_name()} x {n}")
        print_tp(got["tp"], got["steps"], n, args.layer)
        return got, None
    sweep = {}
    for k, channels in enumerate(cfg["channels"]):
        parts = "dp" if k or args.dp_only else "all"
        sweep[channels] = dist.spawn(_rank, n, cfg, parts, env=channel_env(channels),
                                     timeout=900)[0]
    first = sweep[cfg["channels"][0]]
    peer = None if args.no_torch or args.dp_only else _torch_peer(n, cfg["sizes"])
    print(f"GPU: {gpu_name()} x {n}")
    if not args.dp_only:
        print_all_reduce(first, peer, n, cfg["sizes"])
    print_sweep(sweep, n, cfg)
    if not args.dp_only:
        print_tp(first["tp"], first["steps"], n, args.layer)
    return sweep, peer


def _bus_gbs(nbytes, ms, n):
    return nbytes * 2 * (n - 1) / n / (ms * 1e-3) / 1e9


def print_all_reduce(got, peer, n, sizes):
    """Parts 1 and 2's tables."""
    print(f"all_reduce of bf16, median of {ITERS} calls")
    print("| MiB | tecupy ms | bus GB/s | torch ms | bus GB/s | tecupy / torch |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i, mib in enumerate(sizes):
        ms = got["all_reduce"][i]
        tail = "| - | - | - |" if peer is None else \
            f"| {peer[i]:.3f} | {_bus_gbs(mib * 2**20, peer[i], n):.0f} | {peer[i] / ms:.2f}x |"
        print(f"| {mib} | {ms:.3f} | {_bus_gbs(mib * 2**20, ms, n):.0f} {tail}")
    big = _bus_gbs(sizes[-1] * 2**20, got["all_reduce"][-1], n) * 1e9
    ideal = got["dp_bytes"] * 2 * (n - 1) / n / big * 1e3
    print(f"\nData parallel: the quickstart layer's {got['dp_count']} gradients "
          f"({got['dp_bytes'] / 2**20:.0f} MiB bf16) averaged with all_reduce_gradients (a "
          f"gradient of >= the bucket size in place); {ideal:.2f} ms at the {sizes[-1]} MiB "
          "bus bandwidth")
    print("| buckets | ms | vs that bandwidth |")
    print("| --- | --- | --- |")
    for name, ms in got["dp"]:
        print(f"| {name} | {ms:.2f} | {ideal / ms:.0%} |")


def print_sweep(sweep, n, cfg):
    """Part 3's table: a row per (NCCL channels, bucket, reduce); per precision the 1-GPU
    step's GPU ms, then after / overlapped: GPU ms (weak scaling = 1-GPU / this); then the
    best configuration of each column."""
    from .layer import SIZES
    opt = "" if cfg["optimizer"] == "none" else f", each step ending with {cfg['optimizer']}"
    print(f"\nData-parallel sweep at {n} GPUs: TransformerLayer {cfg['layer']} "
          f"{SIZES[cfg['layer']]} (hidden, ffn, heads, seq, batch per rank), bf16{opt}; "
          "rank 0's GPU ms per step (weak scaling = 1-GPU step / this step; issue 25's "
          "target: >= 90% at 4 GPUs); bus GB/s of the row's collective at 64 MiB")
    print("| NCCL channels | bucket MiB | reduce | bus GB/s | HP 1 GPU | HP after | "
          "HP overlapped | FP8 1 GPU | FP8 after | FP8 overlapped |")
    print("| --- " * 10 + "|")
    best = {}
    for channels, got in sweep.items():
        for mb in cfg["buckets"]:
            for red in cfg["reduces"]:
                cells = []
                for name in ("HP", "FP8"):
                    one = got["steps"][name]["single"][0]
                    cells.append(f"{one:.2f}")
                    for kind in ("after", "overlapped"):
                        eff = one / got["steps"][name][(mb, red, kind)][0]
                        cells.append(f"{one / eff:.2f} ({eff:.1%})")
                        if eff > best.get((name, kind), (0,))[0]:
                            best[(name, kind)] = (eff, channels, mb, red)
                print(f"| {channels or 'default'} | {mb:g} | {red} | {got['bus'][red]:.0f} | "
                      + " | ".join(cells) + " |")
    for (name, kind), (eff, channels, mb, red) in best.items():
        print(f"best {name} {kind}: {eff:.1%} (NCCL channels {channels or 'default'}, "
              f"{mb:g} MiB buckets, {red})")

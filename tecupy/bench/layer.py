"""python -m tecupy.bench layer [--size small|medium|full]: the main job's TransformerLayer
(bf16, pre-LayerNorm, causal attention, GELU MLP), one forward + backward per step:

- step time of tecupy eager and graphed (make_graphed_step), high precision and FP8 delayed
  scaling, against PyTorch bf16 (the same layer from torch.nn, SDPA attention) eager and with
  torch.cuda.make_graphed_callables, all in this run: GPU ms per step (CUDA events around
  STEPS back-to-back steps, median of 3 rounds) and host ms per step (the wall time of issuing
  them: near the GPU time, the step is host-bound), and the ratios; then the FP8 and
  PyTorch eager steps again in alternating rounds, best and median (the lent hosts' speed
  drifts: the eager FP8 step is host-bound there);
- whether graphed steps are bit-identical to eager ones (twin layers, 3 steps);
- memory (bench/memory.py: the pool's peak, what is kept for the backward by op; a graph's
  own pool);
- at the full size, where the FP8 step's GPU time goes: kernel time per kernel (summed
  over its launches), from torch.profiler's CUPTI trace, which records CuPy's kernels too.
PyTorch rows are skipped without torch.
"""
import statistics
import time

import numpy as np

from .memory import GIB, OPT_ABOVE, OPT_PEER, print_report, step_memory, torch_step_peak
from .timing import gpu_name, host_speed

STEPS, ROUNDS = 20, 3
SIZES = {  # hidden, ffn, heads, seq, batch (issue 21's sizes; full: TE's quickstart layer)
    "small": (1024, 4096, 16, 512, 2), "medium": (2048, 8192, 16, 2048, 2),
    "full": (4096, 16384, 32, 2048, 4)}


def _recipe():
    from tecupy.recipe import DelayedScaling, Format
    return DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                          amax_compute_algo="max")


def _rate(step, xp):
    """(GPU ms, host ms) per step over STEPS back-to-back steps, median of ROUNDS."""
    torch = xp.__name__ == "torch"
    sync = xp.cuda.synchronize if torch else xp.cuda.Device().synchronize
    for _ in range(3):
        step()
    sync()
    gpu, host = [], []
    for _ in range(ROUNDS):
        kw = {"enable_timing": True} if torch else {}
        start, stop = xp.cuda.Event(**kw), xp.cuda.Event(**kw)
        start.record()
        t0 = time.perf_counter()
        for _ in range(STEPS):
            step()
        host.append((time.perf_counter() - t0) * 1e3 / STEPS)
        stop.record()
        stop.synchronize()
        ms = start.elapsed_time(stop) if torch else xp.cuda.get_elapsed_time(start, stop)
        gpu.append(ms / STEPS)
    return statistics.median(gpu), statistics.median(host)


def _build(shape, fp8_weights=False, recipe=None):
    """The main job's layer, input and output gradient; with its GEMM weights as FP8 codes
    (quantized_model_init, under `recipe`: the delayed one by default) where fp8_weights."""
    import tecupy
    from tecupy.__main__ import build
    with tecupy.quantized_model_init(enabled=fp8_weights, recipe=recipe or _recipe()):
        return build(shape, "cuda")


def _tecupy_rows(shape):
    import cupy
    import tecupy
    from tecupy.__main__ import step
    rows, pools = {}, {}
    for name, r, w8 in (("HP", None, False), ("FP8", _recipe(), False),
                        ("FP8 weights", _recipe(), True)):
        layer, x, dy = _build(shape, w8)
        rows[f"tecupy {name} eager"] = _rate(lambda: step(layer, x, dy, r), cupy)
        g = tecupy.make_graphed_step(layer, (x, dy), fp8_recipe=r)
        rows[f"tecupy {name} graphed"] = _rate(lambda: g(x, dy), cupy)
        pools[name] = g.pool.total_bytes()
    return rows, pools


def _torch_layer(hidden, ffn, heads):
    """The same layer in torch.nn: pre-LayerNorm, causal SDPA, GELU (tanh) MLP, bf16."""
    import torch
    import torch.nn.functional as F

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
            self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden,
                                                                                       hidden)
            self.fc1, self.fc2 = torch.nn.Linear(hidden, ffn), torch.nn.Linear(ffn, hidden)

        def forward(self, x):  # x [seq, batch, hidden]
            s, b, _ = x.shape
            qkv = self.qkv(self.ln1(x)).view(s, b, 3, heads, hidden // heads)
            q, k, v = qkv.permute(2, 1, 3, 0, 4).unbind(0)  # [b, heads, s, d]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            h = x + self.proj(o.permute(2, 0, 1, 3).reshape(s, b, hidden))
            return h + self.fc2(F.gelu(self.fc1(self.ln2(h)), approximate="tanh"))
    return Layer().cuda().to(torch.bfloat16)


def _torch_step(shape):
    """(torch's layer, a function of its module -> one eager step of it (gradients reset),
    x)."""
    import torch
    hidden, ffn, heads, seq, batch = shape
    layer = _torch_layer(hidden, ffn, heads)
    x = torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    dy = torch.randn_like(x) * 1e-2

    def step(fn):
        def run():
            for p in (*layer.parameters(), x):
                p.grad = None
            fn(x).backward(dy)
        return run
    return layer, step, x


def _torch_rows(shape):
    try:
        import torch
    except ImportError:
        return {}
    layer, step, x = _torch_step(shape)
    rows = {"PyTorch bf16 eager": _rate(step(layer), torch)}
    graphed = torch.cuda.make_graphed_callables(layer, (x,))
    rows["PyTorch bf16 graphed"] = _rate(step(graphed), torch)
    return rows


EAGER_ROUNDS = 7


def _eager_interleaved(shape):
    """The FP8 eager step and PyTorch's eager step in alternating rounds of STEPS steps
    (EAGER_ROUNDS each): {name: (best, median) ms per step}. The eager FP8 step is
    host-bound on the lent machines, whose host speed drifts by up to 40% from one process
    or second to the next (PERFLOG.md, session 17); alternating puts both in the same
    moments, and the best round is the code's cost without the drift."""
    import cupy
    import torch
    from tecupy.__main__ import step
    layer, x, dy = _build(shape)
    tl, tstep, _ = _torch_step(shape)
    runs = {"tecupy FP8 eager": (lambda: step(layer, x, dy, _recipe()), cupy.cuda.Device()),
            "PyTorch bf16 eager": (tstep(tl), torch.cuda)}
    times = {name: [] for name in runs}
    for _ in range(EAGER_ROUNDS):
        for name, (fn, dev) in runs.items():
            fn()
            dev.synchronize()
            t0 = time.perf_counter()
            for _ in range(STEPS):
                fn()
            dev.synchronize()
            times[name].append((time.perf_counter() - t0) * 1e3 / STEPS)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def _print_interleaved(shape):
    got = _eager_interleaved(shape)
    (fb, fm), (tb, tm) = got["tecupy FP8 eager"], got["PyTorch bf16 eager"]
    print(f"  eager, {EAGER_ROUNDS} alternating rounds of {STEPS} steps (best / median ms): "
          f"tecupy FP8 {fb:.3f} / {fm:.3f}, PyTorch bf16 {tb:.3f} / {tm:.3f}: "
          f"ratio {fb / tb:.2f} / {fm / tm:.2f}")


def _graphs_match(shape):
    """Twin layers, 3 steps each, eager and graphed (FP8): the last step's output and
    gradients and the FP8 state bit-identical? Both twins run attention's deterministic
    backward (as NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 would): by default its dQ is summed by
    float atomics in an order that varies from run to run at the full size, eager or not."""
    import tecupy
    from tecupy.__main__ import build, step
    from tecupy.kernels import attention
    print("  (the twins run attention's deterministic backward: dQ summed in a fixed order)")
    r, before = _recipe(), attention.CONFIG["deterministic"]
    attention.CONFIG["deterministic"] = True
    try:
        (a, x, dy), (b, _, _) = build(shape, "cuda"), build(shape, "cuda")
        for _ in range(3):
            y, grads = step(a, x, dy, r)
        g = tecupy.make_graphed_step(b, (x, dy), fp8_recipe=r)
        for _ in range(2):
            y_g, grads_g, (dx_g,) = g(x, dy)
    finally:
        attention.CONFIG["deterministic"] = before
    want = [y, *grads.values()]
    got = [y_g, *grads_g.values(), dx_g]
    same = all(bool((u.view(np.uint16) == v.view(np.uint16)).all()) for u, v in zip(got, want))
    sa, sb = a.state_dict(), b.state_dict()
    return same and all(np.array_equal(sa[k], sb[k]) for k in sa if isinstance(sa[k],
                                                                                  np.ndarray))


def header(args, what=""):
    """The layer's size from args (default full) and its shape, printed with the GPU and
    the timing method; `what` goes after "bf16"."""
    size = getattr(args, "size", None) or "full"
    shape = SIZES[size]
    print(f"GPU: {gpu_name()}; TransformerLayer {size} (hidden, ffn, heads, seq, batch) = "
          f"{shape}, bf16{what}, forward + backward; {STEPS} steps back to back, median of "
          f"{ROUNDS}")
    try:  # (a diagnostic line: the bench's rows do not depend on it)
        empty, launch = host_speed()
        print(f"host: cupy.empty {empty:.1f} us, a kernel launch {launch:.1f} us (the eager "
              "rows and host ms move with these; lent hosts seen: 2.1-5.7 and 6.0-10.5)")
    except Exception as err:  # noqa: BLE001
        print(f"host: speed not measured ({type(err).__name__}: {err})")
    return size, shape


def run(args):
    if getattr(args, "recipe", "tensor") == "block":
        return _block_run(args)
    size, shape = header(args)
    rows, pools = _tecupy_rows(shape)
    rows.update(_torch_rows(shape))
    eager, graphed = rows.get("PyTorch bf16 eager"), rows.get("PyTorch bf16 graphed")
    print(f"  {'':24s}{'ms/step':>9s}{'host ms':>9s}{'/ torch eager':>15s}"
          f"{'/ torch graphed':>17s}")
    for name, (ms, host) in rows.items():
        ratios = "".join(f"{ms / ref[0]:>15.2f}" if ref else f"{'-':>15s}"
                         for ref in (eager, graphed))
        print(f"  {name:24s}{ms:9.3f}{host:9.3f}{ratios}")
    if eager is not None:
        _print_interleaved(shape)
    print("  graphed FP8 steps bit-identical to eager ones (3 steps): "
          f"{'yes' if _graphs_match(shape) else 'NO'}")
    print("  memory kept by each graph (its pool): " +
          ", ".join(f"{k} {v / GIB:.2f} GiB" for k, v in pools.items()))
    _memory(shape)
    if getattr(args, "layers", 1) > 1:
        _stack_memory(shape, args.layers)
    if size == "full":
        _kernel_time(shape)


def _block_run(args):
    """--recipe block: the layer's FP8 step under Float8BlockScaling (1x128 activation and
    gradient blocks, 128x128 weight blocks) against delayed scaling's, eager and graphed,
    the same run, and each one's memory peak (issue 20: block step <= 1.15x delayed); and
    block scaling with 128x128-blocked FP8 weights (quantized_model_init)."""
    from tecupy.recipe import Float8BlockScaling
    _, shape = header(args, ", FP8 block scaling against delayed scaling")
    rows = {}
    for name, r, w8 in (("delayed", _recipe(), False), ("block", Float8BlockScaling(), False),
                        ("block, FP8 weights", Float8BlockScaling(), True)):
        rows.update(_recipe_rows(name, r, shape, w8))
    print(f"  {'':27s}{'ms/step':>9s}{'host ms':>9s}{'/ delayed':>11s}  (target <= 1.15)")
    for name, (ms, host) in rows.items():
        ref = rows[f"delayed {name.split()[-1]}"]  # (eager or graphed)
        print(f"  {name:27s}{ms:9.3f}{host:9.3f}{ms / ref[0]:>11.2f}")


def _recipe_rows(name, r, shape, fp8_weights=False):
    """{name eager/graphed: (ms, host ms)} of the FP8 step under recipe r (the layer's
    weights FP8 codes made under r where fp8_weights); prints its peak (a step that cannot
    be captured says why, and has no graphed row)."""
    import cupy
    import tecupy
    from tecupy.__main__ import step
    layer, x, dy = _build(shape, fp8_weights, r)
    rows = {f"{name} eager": _rate(lambda: step(layer, x, dy, r), cupy)}
    try:
        g = tecupy.make_graphed_step(layer, (x, dy), fp8_recipe=r)
        rows[f"{name} graphed"] = _rate(lambda: g(x, dy), cupy)
    except RuntimeError as err:
        print(f"  {name}: not graphed: {str(err)[:160]}")
    print(f"  {name}: step peak {step_memory(layer, x, dy, r)[0] / GIB:.2f} GiB above "
          "parameters and inputs")
    return rows


def _memory(shape):
    ref = None
    try:
        import torch
        hidden, ffn, heads, seq, batch = shape
        t_layer = _torch_layer(hidden, ffn, heads)
        x = torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16,
                        requires_grad=True)
        torch_step_peak(t_layer, x, torch.randn_like(x))  # (its first step makes .grad)
        ref = torch_step_peak(t_layer, x, torch.randn_like(x))
        del t_layer, x
        torch.cuda.empty_cache()
        print(f"memory: PyTorch bf16 peak {ref / GIB:.2f} GiB above parameters and inputs")
    except ImportError:
        print("memory:")
    for name, r, ckpt, w8 in (("high precision", None, False, False),
                              ("FP8 delayed scaling", _recipe(), False, False),
                              ("FP8, FP8 weights (quantized_model_init)", _recipe(), False, True),
                              ("FP8, checkpoint(layer, x)", _recipe(), True, False)):
        layer, x, dy = _build(shape, w8)
        print_report(name, *step_memory(layer, x, dy, r, ckpt), ref=ref)
        del layer, x, dy
    for name, ckpt, w8 in (("FP8, optimizer in backward", False, False),
                           ("FP8, FP8 weights, optimizer in backward", False, True),
                           ("FP8, checkpoint(layer, x), optimizer in backward", True, False)):
        layer, x, dy = _build(shape, w8)
        _optimizer_row(name, layer, x, dy, ckpt, ref)
        del layer, x, dy


def _optimizer_row(name, model, x, dy, checkpointed, ref):
    """The FP8 step of `model` (a layer or a Stack) with AdamW's step in the backward
    (Optimizer.step_in_backward): the peak above the parameters, the optimizer's state (made
    first) and the inputs, against PyTorch's plain step (issue 22: the parameters'
    gradients, applied and freed as they come, leave the peak)."""
    from tecupy.optim import AdamW
    opt = AdamW(model.named_parameters(), lr=1e-6)  # (float32 moments: the default)
    print_report(name, *step_memory(model, x, dy, _recipe(), checkpointed, opt), ref=ref,
                 above=OPT_ABOVE, peer=OPT_PEER)


class Stack:
    """n of the main job's layers in sequence, each through tecupy.checkpoint when
    `checkpointed` (what TE's users do per layer): the memory of a deep model, where the
    saved activations of every layer add up and one layer's backward transient comes on top.
    A tecupy.nn-like object: call, named_parameters."""

    def __init__(self, layers, checkpointed=False):
        self.layers, self.checkpointed = list(layers), checkpointed

    def __call__(self, x):
        import tecupy
        for layer in self.layers:
            x = tecupy.checkpoint(layer, x) if self.checkpointed else layer(x)
        return x

    def named_parameters(self):
        return {f"layer{i}.{k}": p for i, layer in enumerate(self.layers)
                for k, p in layer.named_parameters().items()}

    def parameters(self):
        return list(self.named_parameters().values())


def _stack_memory(shape, n):
    """The peak of one step of n layers above parameters and inputs: PyTorch bf16 (plain,
    and with torch.utils.checkpoint per layer), tecupy high precision, FP8, and FP8 with
    each layer checkpointed (issue 22's target for checkpoint: <= 0.3x PyTorch bf16); the
    last with AdamW's step in the backward (its peak above the optimizer's state too: the
    parameters' gradients never all alive)."""
    ref = _torch_stack_peak(shape, n)
    if ref:
        print(f"memory of {n} layers: PyTorch bf16 peak {ref[0] / GIB:.2f} GiB, with "
              f"torch.utils.checkpoint per layer {ref[1] / GIB:.2f} GiB")
    _, x, dy = _build(shape)
    for w8 in (False, True):
        layers = [_build(shape, w8)[0] for _ in range(n)]
        for name, r, ckpt in (("high precision", None, False), ("FP8", _recipe(), False),
                              ("FP8, checkpoint per layer", _recipe(), True))[w8:]:
            name += ", FP8 weights" if w8 else ""
            peak, by_op, held = step_memory(Stack(layers, ckpt), x, dy, r)
            print_report(f"{n} layers, {name}", peak, by_op, held, ref=ref and ref[0])
        name = "FP8, checkpoint per layer, optimizer in backward" + (
            ", FP8 weights" if w8 else "")  # (last: the step changes the weights)
        _optimizer_row(f"{n} layers, {name}", Stack(layers, True), x, dy, False,
                       ref and ref[0])
        del layers


def _torch_stack_peak(shape, n):
    """(peak, peak with checkpoint per layer) of PyTorch's n-layer stack; None without it."""
    try:
        import torch
        from torch.utils.checkpoint import checkpoint
    except ImportError:
        return None
    hidden, ffn, heads, seq, batch = shape
    layers = [_torch_layer(hidden, ffn, heads) for _ in range(n)]

    def plain(x):
        for layer in layers:
            x = layer(x)
        return x

    def ckpt(x):
        for layer in layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return x
    x = torch.randn(seq, batch, hidden, device="cuda", dtype=torch.bfloat16,
                    requires_grad=True)
    out = []
    for fn in (plain, ckpt):
        stack = _Call(fn, layers)
        torch_step_peak(stack, x, torch.randn_like(x))  # (its first step makes .grad)
        out.append(torch_step_peak(stack, x, torch.randn_like(x)))
    layers.clear()  # (their memory back to the GPU before tecupy's stack is built)
    x = stack = None
    torch.cuda.empty_cache()
    return out


class _Call:
    """fn as torch_step_peak's layer: called, with the layers' parameters."""

    def __init__(self, fn, layers):
        self.fn, self.layers = fn, layers

    def __call__(self, x):
        return self.fn(x)

    def parameters(self):
        return [p for layer in self.layers for p in layer.parameters()]


def kernel_table(fn, rows=25):
    """[(kernel name, total ms, launches)] of one call of fn, largest first; None without
    torch."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    import cupy
    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        cupy.cuda.Device().synchronize()
    totals = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            t, n = totals.get(e.name, (0.0, 0))
            totals[e.name] = (t + e.device_time / 1e3, n + 1)
    return sorted(((k, t, n) for k, (t, n) in totals.items()), key=lambda r: -r[1])[:rows]


def _kernel_time(shape):
    from tecupy.__main__ import build, step
    layer, x, dy = build(shape, "cuda")
    r = _recipe()
    step(layer, x, dy, r)
    table = kernel_table(lambda: step(layer, x, dy, r))
    if table is None:
        print("(torch is not importable: no kernel table)")
        return
    total = sum(t for _, t, _ in table)
    print(f"FP8 step, kernel time of the {len(table)} largest kernels: {total:.2f} ms")
    for k, t, n in table:
        print(f"  {t / total * 100:5.1f}% {t:7.3f} ms  x{n:<3d} {k[:90]}")

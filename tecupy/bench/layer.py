"""python -m tecupy.bench layer: Transformer Engine's quickstart layer (the main job's
TransformerLayer, bf16), one forward + backward step in high precision and under FP8 delayed
scaling, its memory (bench/memory.py: the pool's peak, what is kept for the backward by op),
and where the FP8 step's GPU time goes: kernel time per kernel (summed over its
launches), from torch.profiler's CUPTI trace, which records CuPy's kernels too (skipped
without torch). Everything that is not a GEMM, attention or a fused kernel shows up here.
"""
import numpy as np

from .memory import print_report, step_memory
from .timing import gpu_name, time_ms


def _layer():
    import cupy
    import tecupy
    from tecupy.__main__ import SIZES
    hidden, ffn, heads, seq, batch = SIZES["full"]
    layer = tecupy.nn.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0,
                                       attention_dropout=0.0, params_dtype=tecupy.bfloat16,
                                       device="cuda", seed=0)
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal((seq, batch, hidden)).astype(tecupy.bfloat16))
    dy = cupy.asarray((rng.standard_normal((seq, batch, hidden)) * 1e-2)
                      .astype(tecupy.bfloat16))
    return layer, x, dy


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


def run(args):
    import cupy
    from tecupy.__main__ import step
    from tecupy.recipe import DelayedScaling, Format
    layer, x, dy = _layer()
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                            amax_compute_algo="max")
    print(f"GPU: {gpu_name()}; "
          f"TransformerLayer {tuple(x.shape)} bf16, fwd+bwd")
    for name, r in (("high precision", None), ("FP8 delayed scaling", recipe)):
        ms = time_ms(lambda: step(layer, x, dy, r), cupy, warmup=2, repeat=5)
        print(f"  {name:22s} {ms:8.2f} ms/step")
    print("memory:")
    for name, r in (("high precision", None), ("FP8 delayed scaling", recipe)):
        print_report(name, *step_memory(layer, x, dy, r))
    table = kernel_table(lambda: step(layer, x, dy, recipe))
    if table is None:
        print("(torch is not importable: no kernel table)")
        return
    total = sum(t for _, t, _ in table)
    print(f"FP8 step, kernel time of the {len(table)} largest kernels: {total:.2f} ms")
    for k, t, n in table:
        print(f"  {t / total * 100:5.1f}% {t:7.3f} ms  x{n:<3d} {k[:90]}")

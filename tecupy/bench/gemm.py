"""python -m tecupy.bench gemm: the FP8 GEMM (E4M3 x E4M3, bf16 out) in TFLOP/s against
torch._scaled_mm (cuBLASLt, per-tensor scales) measured in the same run, with fast
accumulation on (ours: "fast") and off (ours: split accumulator), for 4096^3, 8192^3 and the
transformer-layer shapes. Times are medians of CUDA-event timings of back-to-back calls
(kernel time: the inputs fit in L2 for both sides alike), ours and the peer interleaved,
best of two medians each (the clocks drift by up to 10% between runs under FP8 load). Also
reports the largest difference between our output and cuBLASLt's, relative to the output's
magnitude.
"""
import numpy as np

from .timing import first_call, gpu_name, gpu_time_ms, torch_time_ms

SHAPES = [("4096^3", 4096, 4096, 4096), ("8192^3", 8192, 8192, 8192),
          ("qkv", 8192, 12288, 4096), ("proj", 8192, 4096, 4096),
          ("fc1", 8192, 16384, 4096), ("fc2", 8192, 4096, 16384)]


def _operands(m, n, k):
    import cupy
    import tecupy
    rng = cupy.random.default_rng(0)
    a = tecupy.quantize(rng.standard_normal((m, k), np.float32), 1.0, "e4m3")
    b = tecupy.quantize(rng.standard_normal((n, k), np.float32), 1.0, "e4m3")
    return a, b


def _torch_peer(a, b, fast):
    try:
        import torch
    except ImportError:
        return None, None
    ta = torch.from_dlpack(a.data).view(torch.float8_e4m3fn)
    tb = torch.from_dlpack(b.data).view(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda", dtype=torch.float32)

    def call():
        return torch._scaled_mm(ta, tb.t(), one, one, out_dtype=torch.bfloat16,
                                use_fast_accum=fast)
    return call, lambda y: y.float().cpu().numpy()


def run(args):
    import cupy
    from tecupy import bfloat16
    from tecupy.kernels import fp8_gemm as K
    print(f"GPU: {gpu_name()}")
    print(f"{'shape':8s} {'M':>6s} {'N':>6s} {'K':>6s} {'accum':5s} {'first s':>8s} "
          f"{'ours TF/s':>10s} {'cuBLASLt':>9s} {'ratio':>6s} {'max|diff|':>9s}")
    ratios = {True: [], False: []}
    for label, m, n, k in SHAPES:
        a, b = _operands(m, n, k)
        for split in (False, True):
            def ours():
                return K.fp8_gemm(a.data, a.fmt, a.scale_inv, b.data, b.fmt, b.scale_inv,
                                  bfloat16, split_accumulator=split)
            y, first = first_call(ours)
            peer, to_np = _torch_peer(a, b, fast=not split)
            ms, pms = [], []
            for _ in range(2):  # interleaved, best of two: clocks drift under FP8 load
                ms.append(gpu_time_ms(ours, [()], calls=30))
                if peer is not None:
                    pms.append(torch_time_ms(peer, calls=30))
            tf = 2 * m * n * k / min(ms) / 1e9
            ptf, diff = float("nan"), float("nan")
            if peer is not None:
                ptf = 2 * m * n * k / min(pms) / 1e9
                ref = to_np(peer())
                diff = float(np.abs(cupy.asnumpy(y.astype(np.float32)) - ref).max()
                             / max(np.abs(ref).max(), 1e-30))
                ratios[split].append(tf / ptf)
            print(f"{label:8s} {m:6d} {n:6d} {k:6d} {'split' if split else 'fast':5s} "
                  f"{first / 1e3:8.2f} {tf:10.0f} {ptf:9.0f} {tf / ptf:6.2f} {diff:9.1e}")
    for split, r in ratios.items():
        if r:
            print(f"geomean ours/cuBLASLt ({'split' if split else 'fast'} accumulation): "
                  f"{np.exp(np.mean(np.log(r))):.3f}, min {min(r):.3f}")

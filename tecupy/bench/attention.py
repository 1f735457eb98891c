"""python -m tecupy.bench attention: fused attention against PyTorch's SDPA backends.

Batch 4, 32 heads, seq 2048, head dim 128, bf16, layout bshd; causal and not; forward and
forward+backward. TFLOP/s count the matrix products: forward 4 b h s^2 d (halved for
causal), forward+backward 3.5x the forward (FlashAttention's convention). Ours is timed
through the backend registry (the `cuda` implementation), the peers are
F.scaled_dot_product_attention under sdpa_kernel(FLASH_ATTENTION) and
sdpa_kernel(CUDNN_ATTENTION), measured in the same run when torch is importable. The
largest difference of our output from the flash backend's is printed as a sanity check.
TECUPY_BENCH_VARIANTS=1 times every forward and backward variant
(kernels.attention.FWD_VARIANTS, BWD_VARIANTS).
"""
import os

import numpy as np

import tecupy
from tecupy import backends
from tecupy.ops.attention import MASKS

from .timing import first_call, gpu_name, gpu_time_ms, torch_time_ms

B, H, S, D = 4, 32, 2048, 128
BF16 = tecupy.bfloat16


def _flops(causal, backward):
    f = 4 * B * H * S * S * D / (2 if causal else 1)
    return f * 3.5 if backward else f


def _inputs(torch):
    """q, k, v, do as bshd bf16 CuPy arrays (and torch tensors sharing the memory)."""
    import cupy
    if torch is None:
        rng = np.random.default_rng(0)
        return [cupy.asarray(rng.standard_normal((B, S, H, D), np.float32)).astype(BF16)
                for _ in range(4)], None
    ts = [torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    return [cupy.from_dlpack(t.view(torch.int16)).view(BF16) for t in ts], ts


def _ours(arrays, causal):
    q, k, v, do = arrays
    mask, scale = MASKS["causal" if causal else "no_mask"], 1 / np.sqrt(D)

    def fwd():
        return backends.dispatch("attention_fwd", q, k, v, scale, mask, None, None, 0.0, None)

    def fwd_bwd():
        o, lse = fwd()
        return backends.dispatch("attention_bwd", do, q, k, v, o, lse, scale, mask, None,
                                 None, 0.0, None)
    return fwd, fwd_bwd


def _peer(torch, ts, causal, backend):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v, do = (t.transpose(1, 2) for t in ts)  # SDPA wants [b, h, s, d]
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    kind = getattr(SDPBackend, backend)

    def fwd():
        with sdpa_kernel(kind):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def fwd_bwd():
        with sdpa_kernel(kind):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
        return torch.autograd.grad(o, (qg, kg, vg), do)
    return fwd, fwd_bwd


def _time(fn, peer):
    try:
        return torch_time_ms(fn, calls=10) if peer else gpu_time_ms(fn, [()], calls=10)
    except Exception as err:  # a peer backend missing on this build
        print(f"  (not timed: {type(err).__name__}: {str(err)[:80]})")
        return float("nan")


def _sanity(torch, arrays, ts, causal):
    import cupy
    fwd, _ = _ours(arrays, causal)
    ours = fwd()[0].astype(np.float32)
    ref = _peer(torch, ts, causal, "FLASH_ATTENTION")[0]().transpose(1, 2).contiguous()
    ref = cupy.from_dlpack(ref.view(torch.int16)).view(BF16).astype(np.float32)
    return float(cupy.abs(ours - ref).max())


def run(args):
    from tecupy.kernels import attention as kernel
    try:
        import torch
    except ImportError:
        torch = None
    arrays, ts = _inputs(torch)
    print(f"{gpu_name()}: attention b{B} h{H} s{S} d{D} bf16 bshd, TFLOP/s (ms)")
    every = os.environ.get("TECUPY_BENCH_VARIANTS") == "1"
    default = dict(kernel.CONFIG)
    rows = []
    for causal in (False, True):
        fwd, fwd_bwd = _ours(arrays, causal)
        _, first = first_call(fwd_bwd)
        for label, fn, bwd in (("fwd", fwd, False), ("fwd+bwd", fwd_bwd, True)):
            key = "bwd" if bwd else "fwd"
            values = (kernel.BWD_VARIANTS if bwd else kernel.FWD_VARIANTS) if every else \
                [default[key]]
            for value in values:
                kernel.CONFIG.update({key: value})
                ms = _time(fn, False)
                tag = f"{label} {value}".replace(", ", ",") if every else label
                rows.append((("causal " if causal else "full   ") + tag, ms, bwd, causal))
            kernel.CONFIG.update(default)
        if torch is not None:
            diff = _sanity(torch, arrays, ts, causal)
            print(f"  {'causal' if causal else 'full'}: first call {first:.0f} ms; "
                  f"max |ours - flash| = {diff:.3g}")
    peers = {}
    if torch is not None:
        for causal in (False, True):
            for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION"):
                f, fb = _peer(torch, ts, causal, backend)
                peers[(causal, False, backend)] = _time(f, True)
                peers[(causal, True, backend)] = _time(fb, True)
    _table(rows, peers)


def _table(rows, peers):
    print(f"{'case':32s} {'ours ms':>8s} {'TFLOP/s':>8s} {'flash':>8s} {'x flash':>8s} "
          f"{'cudnn':>8s} {'x cudnn':>8s}")
    for label, ms, bwd, causal in rows:
        fl = _flops(causal, bwd)
        tf = fl / ms / 1e9
        pf = fl / peers.get((causal, bwd, "FLASH_ATTENTION"), float("nan")) / 1e9
        pc = fl / peers.get((causal, bwd, "CUDNN_ATTENTION"), float("nan")) / 1e9
        print(f"{label:32s} {ms:8.3f} {tf:8.1f} {pf:8.1f} {tf / pf:7.2f}x {pc:8.1f} "
              f"{tf / pc:7.2f}x")

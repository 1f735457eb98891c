"""python -m tecupy: a TransformerLayer forward and backward under FP8 delayed scaling.

Runs on the GPU when CuPy sees one (Transformer Engine's quickstart sizes, bf16), else on the
CPU reference (small sizes, float32). Prints the time per step in high precision and in FP8
and the FP8-vs-high-precision error of the output and of the gradients.
"""
import argparse

import numpy as np

import tecupy
from tecupy.recipe import DelayedScaling, Format
from tecupy.timing import time_ms

SIZES = {  # hidden, ffn, heads, seq, batch
    "full": (4096, 16384, 32, 2048, 4),   # Transformer Engine's quickstart layer
    "small": (256, 1024, 4, 64, 2),
}


def parse():
    p = argparse.ArgumentParser(prog="python -m tecupy", description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=SIZES, help="default: full on a GPU, small on the CPU")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when present")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--backends", action="store_true", help="print the backend table and exit")
    return p.parse_args()


def rel_err(a, b):
    a, b = (tecupy._array.to_numpy(t).astype(np.float64) for t in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def step(layer, x, dy, recipe):
    """One forward + backward; returns (output, gradients by parameter name, dx)."""
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = layer(x)
    grads = tape.gradient(y, dict(layer.named_parameters(), x=x), output_grad=dy)
    return y, grads


def main():
    args = parse()
    if args.backends:
        print(tecupy.backends.describe())
        return
    device = args.device or ("cuda" if tecupy.gpu_available() else "cpu")
    size = args.size or ("full" if device == "cuda" else "small")
    hidden, ffn, heads, seq, batch = SIZES[size]
    dtype = tecupy.bfloat16 if device == "cuda" else np.float32
    layer = tecupy.nn.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0,
                                       attention_dropout=0.0, params_dtype=dtype,
                                       device=device, seed=0)
    xp, rng = layer.xp, np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((seq, batch, hidden)).astype(dtype))
    dy = xp.asarray((rng.standard_normal((seq, batch, hidden)) * 1e-2).astype(dtype))
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                            amax_compute_algo="max")
    print(f"tecupy {tecupy.__version__}: TransformerLayer hidden={hidden} ffn={ffn} "
          f"heads={heads} seq={seq} batch={batch} {np.dtype(dtype).name} on {device}")
    hp_ms = time_ms(lambda: step(layer, x, dy, None), xp, warmup=1, repeat=args.steps)
    fp8_ms = time_ms(lambda: step(layer, x, dy, recipe), xp, warmup=1, repeat=args.steps)
    y_hp, g_hp = step(layer, x, dy, None)
    y_8, g_8 = step(layer, x, dy, recipe)
    print(f"{'':28s}{'ms/step':>10s}")
    print(f"{'high precision fwd+bwd':28s}{hp_ms:10.1f}")
    print(f"{'FP8 delayed scaling fwd+bwd':28s}{fp8_ms:10.1f}")
    print(f"FP8 vs high precision, relative error (L2): output {rel_err(y_8, y_hp):.3e}")
    worst = max(g_hp, key=lambda k: rel_err(g_8[k], g_hp[k]))
    print(f"  gradients: dx {rel_err(g_8['x'], g_hp['x']):.3e}, worst parameter {worst} "
          f"{rel_err(g_8[worst], g_hp[worst]):.3e}")
    kinds = sorted({k for impls in tecupy.backends.registered().values() for k, _ in impls})
    print(f"backends registered: {', '.join(kinds)} (python -m tecupy --backends lists them)")


if __name__ == "__main__":
    main()

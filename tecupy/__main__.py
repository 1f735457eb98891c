"""python -m tecupy: a TransformerLayer forward and backward under FP8 delayed scaling.

Runs on the GPU when CuPy sees one (Transformer Engine's quickstart sizes, bf16), else on the
CPU reference (small sizes, float32). Prints the time per step in high precision and in FP8
and the FP8-vs-high-precision error of the output and of the gradients, against the error
that the tests accept.
"""
import argparse
import sys
import time

import numpy as np

import tecupy
from tecupy._progress import Progress
from tecupy.check import gpu_problem
from tecupy.recipe import DelayedScaling, Format
from tecupy.bench.timing import once_ms

SIZES = {  # hidden, ffn, heads, seq, batch
    "full": (4096, 16384, 32, 2048, 4),   # Transformer Engine's quickstart layer
    "small": (256, 1024, 4, 64, 2),
}
# Transformer Engine's FP8 test tolerances (tests/pytorch/utils.py): the forward is cast to
# E4M3, the gradients to E5M2; a relative L2 error above these means a scaling problem.
TOLERANCE = {"output": 0.125, "dx": 0.25, "parameter": 0.25}
FP8_CPU_SLOWDOWN = 2.0  # the reference FP8 step against its high-precision step, large sizes
SLOW_S = 60             # estimated run time above which the job warns and shows progress


def parse(argv=None):
    p = argparse.ArgumentParser(prog="python -m tecupy", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", choices=("auto",) + tuple(SIZES), default="auto",
                   help="layer size; auto: full on a GPU, small on the CPU")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda when CuPy sees a usable GPU, else cpu")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--backends", action="store_true", help="print the backend table and exit")
    p.add_argument("--check", action="store_true",
                   help="compile and run one kernel of each family on this GPU, print which "
                        "implementation each op uses, and exit")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    return args


def pick_device(asked):
    """'cuda' or 'cpu', or exit with one line when a GPU was asked for and cannot be used."""
    problem = None if asked == "cpu" else gpu_problem()
    if asked == "cuda" and problem:
        sys.exit(f"tecupy: --device cuda, but {problem}. Use --device cpu for the NumPy "
                 "reference; the README's 'What you need' lists the GPU requirements.")
    if asked == "auto" and problem:
        print(f"no GPU ({problem}): running the NumPy reference on the CPU")
    return "cpu" if problem or asked == "cpu" else "cuda"


def step_flops(hidden, ffn, heads, seq, batch):
    """Matmul FLOPs of one forward + backward (backward = 2x forward)."""
    tokens = seq * batch
    gemms = 2 * tokens * (4 * hidden * hidden + 2 * hidden * ffn)
    attention = 4 * batch * seq * seq * hidden
    return 3 * (gemms + attention)


def cpu_gflops():
    """This machine's float32 matmul speed (one 512^3 product, best of 3)."""
    a = np.ones((512, 512), np.float32)
    best = min(_timed(lambda: a @ a) for _ in range(3))
    return 2 * 512 ** 3 / best / 1e9


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def estimate_s(shape, steps, device):
    """Seconds the whole job should take on the CPU (None on the GPU: seconds at most)."""
    if device != "cpu":
        return None
    per_step = step_flops(*shape) / (cpu_gflops() * 1e9)
    return (steps + 2) * per_step * (1 + FP8_CPU_SLOWDOWN)


def rel_err(a, b):
    a, b = (tecupy._array.to_numpy(t).astype(np.float64) for t in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def step(layer, x, dy, recipe):
    """One forward + backward; returns (output, gradients by parameter name and 'x')."""
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = layer(x)
    grads = tape.gradient(y, dict(layer.named_parameters(), x=x), output_grad=dy)
    return y, grads


def timed_steps(fn, xp, steps, progress):
    """Median ms of `steps` calls of fn() after one warm-up, advancing `progress` each call."""
    times = []
    for n in range(steps + 1):
        ms = once_ms(fn, xp)
        if n:
            times.append(ms)
        progress.advance()
    return float(np.median(times))


def build(shape, device):
    hidden, ffn, heads, seq, batch = shape
    dtype = tecupy.bfloat16 if device == "cuda" else np.float32
    layer = tecupy.nn.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0,
                                       attention_dropout=0.0, params_dtype=dtype,
                                       device=device, seed=0)
    xp, rng = layer.xp, np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((seq, batch, hidden)).astype(dtype))
    dy = xp.asarray((rng.standard_normal((seq, batch, hidden)) * 1e-2).astype(dtype))
    return layer, x, dy


def report(y_hp, g_hp, y_8, g_8, x):
    """The FP8 error of the output and gradients against the tests' tolerances, with one
    E4M3 round trip of the input as a yardstick."""
    worst = max((k for k in g_hp if k != "x"), key=lambda k: rel_err(g_8[k], g_hp[k]))
    rows = [("output", rel_err(y_8, y_hp), TOLERANCE["output"]),
            ("dx", rel_err(g_8["x"], g_hp["x"]), TOLERANCE["dx"]),
            (f"worst parameter grad: {worst}", rel_err(g_8[worst], g_hp[worst]),
             TOLERANCE["parameter"])]
    x_rt = tecupy.dequantize(tecupy.fp8.quantize_current(x, tecupy.fp8.E4M3),
                             dtype=np.float32)
    print("FP8 vs high precision, relative L2 error (this run / accepted by the tests):")
    for name, err, tol in rows:
        verdict = "ok" if err <= tol else "OUTSIDE: check the amax history and scales"
        print(f"  {name:68s} {err:9.2e} / {tol:.3g}  {verdict}")
    print(f"  {'for scale: one E4M3 round trip of the input x':68s} {rel_err(x_rt, x):9.2e}")
    print("  Casting a tensor to E4M3 costs ~2-3% (E5M2, the gradients' format, ~5%). The output"
          " keeps\n  the unquantized residual, so it stays well inside; gradients of norm weights"
          " and biases\n  sum many tokens' E5M2 errors and may reach 10-20%. The bounds are "
          "Transformer Engine's\n  FP8 test tolerances (E4M3 rtol 0.125, E5M2 rtol 0.25).")



def main(argv=None):
    args = parse(argv)
    if args.backends:
        print(tecupy.backends.describe())
        return
    if args.check:
        from tecupy import check
        return check.main()
    device = pick_device(args.device)
    size = args.size if args.size != "auto" else ("full" if device == "cuda" else "small")
    shape = SIZES[size]
    hidden, ffn, heads, seq, batch = shape
    print(f"tecupy {tecupy.__version__}: TransformerLayer hidden={hidden} ffn={ffn} "
          f"heads={heads} seq={seq} batch={batch} "
          f"{'bfloat16' if device == 'cuda' else 'float32'} on {device}")
    eta = estimate_s(shape, args.steps, device)
    if eta is not None and eta > SLOW_S:
        print(f"this will take about {eta / 60:.0f} min on this CPU (estimated from its matmul "
              "speed); --size small runs in seconds")
    layer, x, dy = build(shape, device)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16,
                            amax_compute_algo="max")
    total = 2 * (args.steps + 1) + 2
    with Progress(total, "steps", show=eta is not None and eta > SLOW_S) as progress:
        hp_ms = timed_steps(lambda: step(layer, x, dy, None), layer.xp, args.steps, progress)
        fp8_ms = timed_steps(lambda: step(layer, x, dy, recipe), layer.xp, args.steps,
                             progress)
        y_hp, g_hp = step(layer, x, dy, None)
        progress.advance()
        y_8, g_8 = step(layer, x, dy, recipe)
        progress.advance()
    print(f"{'':28s}{'ms/step':>10s}")
    print(f"{'high precision fwd+bwd':28s}{hp_ms:10.1f}")
    print(f"{'FP8 delayed scaling fwd+bwd':28s}{fp8_ms:10.1f}")
    report(y_hp, g_hp, y_8, g_8, x)
    kinds = sorted({k for impls in tecupy.backends.registered().values() for k, _ in impls})
    print(f"backends registered: {', '.join(kinds)} (python -m tecupy --backends lists them)")


if __name__ == "__main__":
    sys.exit(main())

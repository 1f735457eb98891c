"""Step time and host time per step of the main job's TransformerLayer at three sizes, for
one or more source trees in the same run (A/B of a change's cost on the eager path).

    python scripts/step_times.py [--rounds R] [--sizes small,medium] [TREE ...]

Each tree runs in its own process (PYTHONPATH=TREE), the trees taking turns for R rounds
(host-bound steps vary by tens of percent from process to process on the lent machines).
Per size and precision: GPU ms per step (CUDA events around one step, median of 30) and
host ms per step (wall time of issuing the step, before synchronising: where it is near the
GPU time, the step is host-bound).
"""
import json
import os
import subprocess
import sys

SIZES = {"small": (1024, 4096, 16, 512, 2), "medium": (2048, 8192, 16, 2048, 2),
         "full": (4096, 16384, 32, 2048, 4)}

# The main job's layer, x and dy in a child process (self-contained: it runs against older
# trees too); the shape comes as JSON in argv[1]. Shared with scripts/peak_memory.py.
LAYER = r"""
import json, statistics, sys, time
import cupy, numpy as np, tecupy
from tecupy.recipe import DelayedScaling, Format
hidden, ffn, heads, seq, batch = json.loads(sys.argv[1])
layer = tecupy.nn.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0,
                                   attention_dropout=0.0, params_dtype=tecupy.bfloat16,
                                   device="cuda", seed=0)
rng = np.random.default_rng(0)
x = cupy.asarray(rng.standard_normal((seq, batch, hidden)).astype(tecupy.bfloat16))
dy = cupy.asarray((rng.standard_normal((seq, batch, hidden)) * 1e-2).astype(tecupy.bfloat16))
"""

CHILD = LAYER + r"""
recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")
def step(r):
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(enabled=r is not None, fp8_recipe=r):
            y = layer(x)
    return tape.gradient(y, layer, output_grad=dy)
out = {}
for name, r in (("hp", None), ("fp8", recipe)):
    for _ in range(3):
        step(r)
    cupy.cuda.Device().synchronize()
    gpu, host = [], []
    for _ in range(30):
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        t0 = time.perf_counter()
        step(r)
        host.append((time.perf_counter() - t0) * 1e3)
        stop.record()
        stop.synchronize()
        gpu.append(cupy.cuda.get_elapsed_time(start, stop))
    out[name] = (statistics.median(gpu), statistics.median(host))
print("RESULT " + json.dumps(out))
"""


LINEAR = r"""
import json, statistics, time
import cupy, numpy as np, tecupy
from tecupy.recipe import DelayedScaling
lin = tecupy.nn.Linear(4096, 4096, params_dtype=tecupy.bfloat16, device="cuda", seed=0)
x = cupy.asarray(np.random.default_rng(0).standard_normal((256, 4096)).astype(tecupy.bfloat16))
r = DelayedScaling(amax_history_len=16)
def fwd():
    with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=r):
        lin(x)
def fwd_bwd():
    with tecupy.Tape() as t, tecupy.fp8_autocast(fp8_recipe=r):
        y = lin(x)
    t.gradient(y, lin, output_grad=y)
out = {}
for name, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
    for _ in range(5):
        fn()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        fn()
    host = (time.perf_counter() - t0) / 200 * 1e3
    cupy.cuda.Device().synchronize()
    out[name] = host
print("RESULT " + json.dumps(out))
"""


def run(tree, shape, child=CHILD, extra=()):
    """The child's RESULT (JSON) for `tree`; extra: more argv strings for the child."""
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree) + os.pathsep +
               os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", child, json.dumps(shape), *extra], env=env,
                          capture_output=True, text=True, timeout=900)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"{tree} {shape}: {proc.stderr[-2000:]}")


def main():
    import argparse
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--linear", action="store_true",
                   help="host ms per FP8 nn.Linear call instead (M=256, K=N=4096, issue 21)")
    p.add_argument("trees", nargs="*", default=["."])
    args = p.parse_args()
    import cupy
    print(f"GPU: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    if args.linear:
        for tree in [t for _ in range(args.rounds) for t in args.trees]:
            r = run(tree, None, LINEAR)
            print(f"FP8 Linear 256x4096x4096 {tree[-20:]:20s} host ms per call: fwd "
                  f"{r['fwd']:.3f}, fwd+bwd {r['fwd+bwd']:.3f}", flush=True)
        return
    print(f"{'size':8s}{'tree':28s}{'hp ms':>9s}{'host':>8s}{'fp8 ms':>9s}{'host':>8s}")
    for size in args.sizes.split(","):
        for tree in [t for _ in range(args.rounds) for t in args.trees]:
            r = run(tree, SIZES[size])
            print(f"{size:8s}{tree[-28:]:28s}{r['hp'][0]:9.2f}{r['hp'][1]:8.2f}"
                  f"{r['fp8'][0]:9.2f}{r['fp8'][1]:8.2f}", flush=True)


if __name__ == "__main__":
    main()

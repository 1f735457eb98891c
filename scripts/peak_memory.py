"""Peak GPU memory of one forward + backward of the main job's TransformerLayer, above what
was allocated before the step, for one or more source trees in the same run (issue 22).

    python scripts/peak_memory.py [TREE ...]

Exact: CuPy's allocator is wrapped so that the pool's used bytes are read after every
allocation (they only grow there), so no temporary is missed.
"""
import json
import os
import subprocess
import sys

CHILD = r"""
import json, sys
import cupy, numpy as np, tecupy
from tecupy.recipe import DelayedScaling
hidden, ffn, heads, seq, batch = 4096, 16384, 32, 2048, 4
layer = tecupy.nn.TransformerLayer(hidden, ffn, heads, hidden_dropout=0.0,
                                   attention_dropout=0.0, params_dtype=tecupy.bfloat16,
                                   device="cuda", seed=0)
rng = np.random.default_rng(0)
x = cupy.asarray(rng.standard_normal((seq, batch, hidden)).astype(tecupy.bfloat16))
dy = cupy.asarray((rng.standard_normal((seq, batch, hidden)) * 1e-2).astype(tecupy.bfloat16))
pool = cupy.get_default_memory_pool()
peak = [0]
def malloc(size):
    mem = pool.malloc(size)
    peak[0] = max(peak[0], pool.used_bytes())
    return mem
cupy.cuda.set_allocator(malloc)
def step(r):
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(enabled=r is not None, fp8_recipe=r):
            y = layer(x)
    g = tape.gradient(y, dict(layer.named_parameters(), x=x), output_grad=dy)
    return g
out = {}
for name, r in (("hp", None), ("fp8", DelayedScaling(amax_history_len=16))):
    step(r)
    cupy.cuda.Device().synchronize()
    start = pool.used_bytes()
    peak[0] = start
    g = step(r)
    del g
    out[name] = (peak[0] - start) / 2**30
print("RESULT " + json.dumps(out))
"""


def main():
    trees = sys.argv[1:] or ["."]
    for tree in trees:
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree) + os.pathsep +
                   os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                              text=True, timeout=600)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if not lines:
            print(tree, proc.stderr[-1500:])
            continue
        r = json.loads(lines[0][7:])
        print(f"{tree[-24:]:24s} peak above params+inputs: high precision {r['hp']:.2f} GiB, "
              f"FP8 {r['fp8']:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()

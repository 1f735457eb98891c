"""Peak GPU memory of one forward + backward of the main job's TransformerLayer, above what
was allocated before the step, for one or more source trees in the same run (issue 22).

    python scripts/peak_memory.py [TREE ...]

Exact: CuPy's allocator is wrapped so that the pool's used bytes are read after every
allocation (they only grow there), so no temporary is missed.
"""
import sys

from step_times import LAYER, SIZES, run  # (scripts/ is on the path when run as a script)

CHILD = LAYER + r"""
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
    for tree in sys.argv[1:] or ["."]:
        r = run(tree, SIZES["full"], CHILD)
        print(f"{tree[-24:]:24s} peak above params+inputs: high precision {r['hp']:.2f} GiB, "
              f"FP8 {r['fp8']:.2f} GiB", flush=True)


if __name__ == "__main__":
    main()

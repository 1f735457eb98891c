"""Where the step's memory peak is: the CuPy pool's used bytes after every allocation of one
forward + backward of the main job's TransformerLayer, with the tecupy code that allocated
(issue 22).

    python scripts/mem_trace.py [--size full] [--min-mib 16] [--recipe fp8|hp]

Prints every allocation of at least --min-mib (used GiB after it, its size, the innermost
tecupy frames), the peak marked, and the allocation at the peak. Above what was allocated
before the step (parameters, inputs), as bench/memory.py counts.
"""
import argparse
import json
import os
import sys

from step_times import LAYER, SIZES, run  # (scripts/ is on the path when run as a script)

CHILD = LAYER + r"""
import os, traceback
min_bytes, use_fp8 = json.loads(sys.argv[2]), json.loads(sys.argv[3])
recipe = DelayedScaling(amax_history_len=16) if use_fp8 else None
pool = cupy.get_default_memory_pool()
log, start = [], [0]
def label():
    frames = [f for f in traceback.extract_stack()[:-2] if "tecupy" in f.filename]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno}:{f.name}"
                      for f in reversed(frames[-4:]))
def malloc(size):
    mem = pool.malloc(size)
    log.append((pool.used_bytes() - start[0], size, label() if size >= min_bytes else ""))
    return mem
def step():
    with tecupy.Tape() as tape:
        with tecupy.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
            y = layer(x)
    log.append((None, 0, "--- backward ---"))
    return tape.gradient(y, dict(layer.named_parameters(), x=x), output_grad=dy)
step()
cupy.cuda.Device().synchronize()
start[0] = pool.used_bytes()
cupy.cuda.set_allocator(malloc)
g = step()
cupy.cuda.set_allocator(pool.malloc)
print("RESULT " + json.dumps(log))
"""


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="full", choices=sorted(SIZES))
    p.add_argument("--min-mib", type=float, default=16)
    p.add_argument("--recipe", default="fp8", choices=("fp8", "hp"))
    a = p.parse_args()
    min_bytes = int(a.min_mib * 2**20)
    log = run(".", SIZES[a.size], CHILD, extra=[json.dumps(min_bytes),
                                                     json.dumps(a.recipe == "fp8")])
    used = [u for u, _, _ in log if u is not None]
    peak = max(used)
    for used_after, size, where in log:
        if used_after is None:
            print(where)
        elif size >= min_bytes:
            mark = "  <== PEAK" if used_after == peak else ""
            print(f"{used_after / 2**30:6.2f} GiB  +{size / 2**20:7.1f} MiB  {where}{mark}")
    at = next(w for u, s, w in log if u == peak)
    print(f"peak {peak / 2**30:.3f} GiB above parameters and inputs ({a.recipe}, {a.size}) "
          f"at: {at or '(a small allocation)'}")


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()

"""python -m tecupy.bench inspect [--size small|medium|full] [--recipe block]: what FP8Inspector
costs on the main job's TransformerLayer FP8 step (bf16, delayed scaling, or
Float8BlockScaling with --recipe block; forward + backward; bench layer's layer and timing).
Issue 24's target: with the inspector off, the step within 1% of the step without the
inspector's hooks; with it on, within 15%.

Rows, all in this run (GPU ms per step from CUDA events around layer.STEPS back-to-back
steps, median of layer.ROUNDS, and host ms: bench layer's _rate), against "no hooks":
    no hooks     the casts' inspector hooks replaced by functions that do nothing (the step
                 as before issue 24, less a Python call per cast)
    off          the library as it ships, no inspector active (one contextvar read per cast)
    on           FP8Inspector(layer) active and ins.step() after every step (its one host
                 read per step)
    on, exact    the same with exact=True (rel_error on every element, dact_cast's dx
                 recomputed)
The configurations take turns over PASSES passes, every other one in reverse order, and
each keeps its fastest median, so that a drift of the GPU's clocks does not land on one of
them.
"""
import contextlib

from .layer import _rate, _recipe, header
from .timing import in_turns

PASSES = 2
CONFIGS = ("no hooks", "off", "on", "on, exact")


@contextlib.contextmanager
def no_hooks():
    """The inspector's hooks taken out of the casts: quantization._inspected returns the
    cast as it is, fp8's hooks (direct quantize, dact_cast) see no inspector."""
    from tecupy import fp8, quantization
    saved = quantization._inspected, fp8._active_inspector
    quantization._inspected = lambda quantizer, x, out: out
    fp8._active_inspector = lambda: None
    try:
        yield
    finally:
        quantization._inspected, fp8._active_inspector = saved


def _config(name, layer, every):
    """(context manager, the FP8Inspector or None) of a row; every: an inspector of every
    cast (current and block scaling keep no state per module to scope it by)."""
    from tecupy.inspect import FP8Inspector
    if name == "no hooks":
        return no_hooks(), None
    if name == "off":
        return contextlib.nullcontext(), None
    ins = FP8Inspector(None if every else layer, exact=name == "on, exact")
    return ins, ins


def measure(shape, device, rate=_rate, passes=PASSES, recipe=None):
    """{row: (GPU ms, host ms)} per step of the FP8 layer step in each configuration, and
    {row: the inspector's steps and tensors} for the inspected rows. rate(step, xp) times a
    step function (bench layer's _rate on the GPU); recipe: delayed scaling's by default."""
    from tecupy.__main__ import build, step
    from tecupy.recipe import DelayedScaling
    layer, x, dy = build(shape, device)
    xp, recipe = layer.xp, recipe or _recipe()
    rate(lambda: step(layer, x, dy, recipe), xp)  # untimed: the first config timed on a cool
    best, seen = {}, {}                           # GPU ran ~2% faster (in either order)
    for name in in_turns(CONFIGS, passes):
        ctx, ins = _config(name, layer, not isinstance(recipe, DelayedScaling))
        with ctx:
            def one():
                step(layer, x, dy, recipe)
                if ins is not None:
                    ins.step()
            ms, host = rate(one, xp)
        if ins is not None:
            seen[name] = (ins.steps, len(ins.labels))
        old = best.get(name)
        best[name] = (ms, host) if old is None or ms < old[0] else old
    return best, seen


def run(args):
    from tecupy.recipe import Float8BlockScaling
    block = getattr(args, "recipe", "tensor") == "block"
    name = "Float8BlockScaling" if block else "delayed scaling"
    _, shape = header(args, f", FP8 {name} (best of {PASSES} passes)")
    rows, seen = measure(shape, "cuda", recipe=Float8BlockScaling() if block else None)
    base = rows["no hooks"][0]
    print(f"  {'':12s}{'ms/step':>9s}{'host ms':>9s}{'/ no hooks':>12s}  target")
    for name, (ms, host) in rows.items():
        target = {"off": "<= 1.01", "on": "<= 1.15"}.get(name, "")
        print(f"  {name:12s}{ms:9.3f}{host:9.3f}{ms / base:12.3f}  {target}")
    for name, (steps, tensors) in seen.items():
        print(f"  {name}: the inspector recorded {tensors} tensors over {steps} steps")

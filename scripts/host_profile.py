"""Host (Python) cost per call of the FP8 eager path, on NumPy (no GPU needed).

    python scripts/host_profile.py [--calls N] [--profile CASE] [--top K]

Tiny shapes (16 x 32), so the arithmetic is ~nothing and what is timed is the Python around
it: the module, the op, the quantizers, the FP8 state, dispatch, the tape, the autocast.
Cases: an FP8 nn.Linear forward, and forward + backward, under fp8_autocast (DelayedScaling,
the module's own FP8State) inside a Tape; the same for LayerNormMLP and a TransformerLayer.
Per case: us per call (best of 15 rounds), backends.dispatch calls per call by op name (on a
GPU each is a kernel launch or more), and the arrays made per call by tecupy outside the
NumPy reference (xp.empty / zeros / ones / full / asarray from tecupy's own modules: the
allocations the CUDA path makes too). --profile CASE prints the top of cProfile by tottime.
--stub replaces every reference kernel by a copy of the outputs it gave for the same
shapes (its effects skipped): what is left is the Python around the kernels, which is what
a GPU run pays on the host besides the CUDA wrappers (their allocations and launches).
"""
import argparse
import collections
import cProfile
import os
import pstats
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import tecupy  # this checkout's, not an installed copy
from tecupy import backends
from tecupy.recipe import DelayedScaling

RECIPE = DelayedScaling(amax_history_len=16)
ALLOCATORS = ("empty", "zeros", "ones", "full", "asarray", "empty_like", "zeros_like")


def _linear():
    lin = tecupy.nn.Linear(32, 32, device="cpu", seed=0)
    return lin, np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)


def _mlp():
    mlp = tecupy.nn.LayerNormMLP(32, 64, device="cpu", seed=0)
    return mlp, np.random.default_rng(0).standard_normal((16, 32)).astype(np.float32)


def _layer():
    layer = tecupy.nn.TransformerLayer(32, 64, 2, hidden_dropout=0.0, attention_dropout=0.0,
                                       device="cpu", seed=0)
    return layer, np.random.default_rng(0).standard_normal((16, 1, 32)).astype(np.float32)


def _cases():
    """name -> a function running one call of the case."""
    cases = {}
    for name, make in (("Linear", _linear), ("LayerNormMLP", _mlp),
                       ("TransformerLayer", _layer)):
        module, x = make()

        def fwd(module=module, x=x):
            with tecupy.Tape(), tecupy.fp8_autocast(fp8_recipe=RECIPE):
                module(x)

        def fwd_bwd(module=module, x=x):
            with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=RECIPE):
                y = module(x)
            tape.gradient(y, module, output_grad=y)
        cases[f"{name} fwd"], cases[f"{name} fwd+bwd"] = fwd, fwd_bwd
    return cases


def time_call(fn, calls, rounds=15):
    for _ in range(20):
        fn()
    best = float("inf")
    for _ in range(rounds):  # the best round: other work on the machine only adds time
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def count_call(fn):
    """(dispatches by op name, tecupy's own array allocations by function) of one call."""
    dispatches, allocs = collections.Counter(), collections.Counter()
    real_dispatch = backends.dispatch

    def dispatch(op, *args, **kwargs):
        dispatches[op] += 1
        return real_dispatch(op, *args, **kwargs)

    def counted(name, real):
        def alloc(*args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if caller.startswith("tecupy") and not caller.startswith("tecupy.reference"):
                allocs[f"{caller}.{sys._getframe(1).f_code.co_name}:{name}"] += 1
            return real(*args, **kwargs)
        return alloc
    reals = {name: getattr(np, name) for name in ALLOCATORS}
    backends.dispatch = dispatch
    for name, real in reals.items():
        setattr(np, name, counted(name, real))
    try:
        fn()
    finally:
        backends.dispatch = real_dispatch
        for name, real in reals.items():
            setattr(np, name, real)
    return dispatches, allocs


def stub_references():
    """Each reference implementation runs once per op and argument shapes; later calls
    get copies of its outputs (a copy: the tape tells arrays apart by identity). The stub
    itself costs ~1-2 us a call."""
    def memo(op, fn):
        seen = {}

        def stub(*args, **kwargs):
            key = tuple([a.shape if type(a) is np.ndarray else type(a) for a in args])
            out = seen.get(key, seen)  # (seen: not yet; None is an op's result too)
            if out is seen:
                out = seen[key] = fn(*args, **kwargs)
            if type(out) is tuple:
                return tuple([o.copy() if type(o) is np.ndarray else o for o in out])
            return out.copy() if type(out) is np.ndarray else out
        return stub
    for op, impls in backends._registry.items():
        for impl in impls:
            if impl.kind == "reference":
                impl.fn = memo(op, impl.fn)
    backends._order_cache.clear()


def profile(fn, calls, top):
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    print(f"cProfile, {calls} calls (ncalls are totals; divide by {calls}):")
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--profile", default=None, help="a case name, e.g. 'Linear fwd'")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--stub", action="store_true", help="reference kernels stubbed out")
    args = p.parse_args()
    if args.stub:
        stub_references()
    cases = _cases()
    print(f"{'case':26s}{'us/call':>9s}{'dispatches':>12s}{'allocs':>8s}  dispatches by op")
    for name, fn in cases.items():
        us = time_call(fn, args.calls)
        dispatches, allocs = count_call(fn)
        ops = ", ".join(f"{op} {n}" for op, n in sorted(dispatches.items()))
        print(f"{name:26s}{us:9.1f}{sum(dispatches.values()):12d}{sum(allocs.values()):8d}"
              f"  {ops}")
        if args.profile == "all":
            print("   allocations:", dict(allocs))
    if args.profile and args.profile != "all":
        fn = cases[args.profile]
        print("allocations:", dict(count_call(fn)[1]))
        profile(fn, args.calls, args.top)


if __name__ == "__main__":
    main()

"""Activation recompute: `tecupy.checkpoint(fn, *args, **kwargs)`, Transformer Engine's
`te.checkpoint` (transformer_engine/pytorch/distributed.py) on the tape.

    with tecupy.Tape() as tape, tecupy.fp8_autocast(fp8_recipe=recipe):
        y = tecupy.checkpoint(layer, x)     # nothing inside the layer is kept
    grads = tape.gradient(y, layer, output_grad=dy)   # the layer runs again here

The first forward runs with nothing kept for a backward (tape.discarding); one node is
recorded whose inputs are fn's array arguments (positional and keyword) and the parameters
of every tecupy.nn Module found as fn, fn.__self__ or an argument. Its backward runs fn
again under a fresh Tape, as the first forward ran:
- under the same autocast (enabled, recipe), re-entered without its exit's forward update;
- with each FP8 state's forward scales, scale_inv and amax history as the first forward
  left them (snapshot then), swapped in for the recompute and back out by in-place copies
  (array identities never change: CUDA graphs hold addresses). The recompute's amaxes land
  in the snapshot, so nothing is recorded or updated twice; the backward slots are updated
  once, after the recompute's backward, as in a plain step;
- with every module's dropout generator (Module.rng) at its state before the first
  forward (the same masks), then put back as it was.
FP8 states and generators are found on those modules and on FP8State arguments only: one
that fn reaches otherwise (a closure) is not restored. Dropout with seed=None draws a fresh
mask: give seeds, or use modules.
"""
import numpy as np

from . import _check
from ._array import is_cupy
from .autocast import _stack
from .fp8_state import META_ARRAYS, FP8State
from .nn.module import Module
from .quantization import FP8_ONCE
from .tape import Tape, _active, discarding, keeping, record

OP = "tecupy.checkpoint"


def checkpoint(fn, *args, **kwargs):
    """fn(*args, **kwargs), its activations recomputed in the backward instead of kept.
    fn: a callable (a tecupy.nn Module, a bound method, a function of arrays) returning an
    array or a tuple/list of arrays. Without a recording Tape it just calls fn."""
    if not callable(fn):
        _check.fail(OP, "fn", "a callable (a tecupy.nn module or a function returning "
                    "arrays)", fn, TypeError)
    if not keeping():
        return fn(*args, **kwargs)
    modules = _modules((fn, getattr(fn, "__self__", None), *args, *kwargs.values()))
    states = _fp8_states(modules, (*args, *kwargs.values()))
    rngs = [m.rng.bit_generator.state for m in modules]
    stack = _stack.get()
    # (enabled, recipe, amax group) of the call
    autocast = (stack[-1][0], stack[-1][1], stack[-1][3]) if stack else None
    with discarding():
        out = fn(*args, **kwargs)
    outs = _outputs(out)
    # the forward scales the first forward used, and its amaxes (row 0 of the histories):
    # the forward update runs only when the outermost autocast exits, after this
    meta = [(s.fwd, _copies(s.fwd)) for s in states if s.fwd is not None]
    replay = _Replay(fn, args, kwargs, modules, rngs, meta, autocast)
    inputs = _unique([a for a in (*args, *kwargs.values()) if _is_array(a)]
                     + [p for m in modules for p in m.parameters()])
    n_outs = len(outs)  # (the closure must not hold the outputs)
    # delayed scaling: the recompute's backward records amaxes and updates the backward
    # scales, as an FP8 op's does: it may run once
    fp8 = autocast is not None and autocast[0]
    once = FP8_ONCE if fp8 and any(s.recipe is autocast[1] for s in states) else None
    record(lambda *ogs: replay.backward(inputs, n_outs, ogs), inputs, outs, once=once)
    return out


class _Replay:
    """What the backward needs to run fn again as its first forward ran: fn, its arguments,
    the modules' generator states before it, the FP8 forward metas after it, the autocast
    (enabled, recipe, amax group); no array that fn made."""

    def __init__(self, fn, args, kwargs, modules, rngs, meta, autocast):
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.modules, self.rngs, self.meta, self.autocast = modules, rngs, meta, autocast

    def backward(self, inputs, n_outs, ogs):
        """The gradients of fn's outputs (weighted by ogs) w.r.t. inputs (None where fn's
        recompute did not use one)."""
        inner, outs = self._recompute()
        if len(outs) != n_outs:
            raise RuntimeError(f"{OP}: fn gave {n_outs} outputs in the forward but "
                               f"{len(outs)} when recomputed; fn must be deterministic")
        known = inner._known_ids()
        got = iter(inner.gradient(list(outs), [a for a in inputs if id(a) in known],
                                  output_grad=list(ogs)))
        return tuple(next(got) if id(a) in known else None for a in inputs)

    def _recompute(self):
        """fn again under a fresh Tape (only it records), the first forward's autocast (a
        scratch list of used states: the exit's forward update must not run again), its
        generator states and FP8 forward metas; everything put back after."""
        enabled, recipe, group = self.autocast or (None, None, None)
        frame = ((enabled, recipe, [], group),) if self.autocast else ()
        stack, tapes = _stack.set(frame), _active.set(())
        now = self._swap_in()
        try:
            with Tape() as inner:
                outs = _outputs(self.fn(*self.args, **self.kwargs))
        finally:
            self._swap_out(now)
            _active.reset(tapes)
            _stack.reset(stack)
        return inner, outs

    def _swap_in(self):
        now = ([m.rng.bit_generator.state for m in self.modules],
               [(meta, _copies(meta)) for meta, _ in self.meta])
        for m, state in zip(self.modules, self.rngs):
            m.rng.bit_generator.state = state
        for meta, values in self.meta:
            _copy_into(meta, values)
        return now

    def _swap_out(self, now):
        rngs, metas = now
        for m, state in zip(self.modules, rngs):
            m.rng.bit_generator.state = state
        for meta, values in metas:
            _copy_into(meta, values)


def _is_array(a):
    return isinstance(a, np.ndarray) or is_cupy(a)


def _unique(items):
    """items without repeats (by identity): the tape adds a node's gradients per input."""
    return list({id(a): a for a in items}.values())


def _modules(candidates):
    """Every tecupy.nn Module among candidates and below them, each once."""
    found = {}
    for c in candidates:
        if isinstance(c, Module):
            found.update((id(m), m) for _, m in c.named_modules())
    return list(found.values())


def _fp8_states(modules, args):
    """The FP8States of the modules (their attributes) and among the arguments, each once."""
    found = [s for m in modules for s in vars(m).values() if isinstance(s, FP8State)]
    return _unique(found + [a for a in args if isinstance(a, FP8State)])


def _outputs(out):
    """fn's output as a tuple of arrays, or a TypeError naming what is not an array."""
    if _is_array(out):
        return (out,)
    if not isinstance(out, (tuple, list)) or not out:
        _check.fail(OP, "fn's output", "an array or a non-empty tuple/list of arrays", out,
                    TypeError)
    for n, a in enumerate(out):
        if not _is_array(a):
            _check.fail(OP, f"fn's output[{n}]", "a numpy or cupy array", a, TypeError)
    return tuple(out)


def _copies(meta):
    return [meta_array.copy() for meta_array in _meta_arrays(meta)]


def _meta_arrays(meta):
    return [getattr(meta, name) for name in META_ARRAYS]


def _copy_into(meta, values):
    """In place: the state's arrays keep their identity (views of them, graph addresses)."""
    for dst, src in zip(_meta_arrays(meta), values):
        dst[...] = src

"""A small autodiff tape.

    with tecupy.Tape() as tape:
        y = tecupy.linear(x, w, b)
    dx, dw = tape.gradient(y, [x, w], output_grad=dy)

Every tecupy op calls `record(backward, inputs, outputs)` when a tape is active; the
backward closure sits beside its forward in the op and captures what it saved. Arrays are
identified by object identity: the tape keeps each array it saw, or a placeholder standing
for it, alive, so ids stay unique. An array only the tape holds (no variable, no closure,
no view refers to it) can never be passed to a later op nor asked for: a sweep
(tape_memory.py) swaps it for a placeholder with its shape and dtype and so frees its
memory, every _SWEEP_EVERY records, when a backward starts and after each node's backward
(issue 22).
Arrays made outside tecupy ops (slicing, reshape, arithmetic) are new objects the tape never
saw: use tecupy.add / reshape / split, or ask for the gradient of the array that went into
the op.

The tape runs nodes and hooks and knows nothing of what they do: a node may ask for work
after the whole backward (after_backward: FP8 ops update their states' backward scales
there, all in one call) and may say its backward can run only once (once: FP8 ops, whose
backward records amaxes).
"""
import contextlib
import contextvars

import numpy as np

from ._array import unbroadcast, xp_of
from .tape_memory import _ids, _Released, _release, _sweep, saved_bytes  # noqa: F401 (tests)

# The open tapes of this thread (a tuple, rebuilt on enter/exit): every op records into all
# of them. A context variable, so each thread (and each asyncio task) has its own: one
# thread's ops never land on another thread's tape.
_active = contextvars.ContextVar("tecupy_tapes", default=())

# While recording, every _SWEEP_EVERY records the newest _SWEEP_WINDOW nodes are swept:
# constant work per record, and a layer's intermediates are freed soon after its forward
# returns; a sweep of the whole tape starts every backward.
_SWEEP_EVERY, _SWEEP_WINDOW = 16, 32

# True while a backward runs with retain_graph=True (see retaining()).
_retain = contextvars.ContextVar("tecupy_retain", default=False)

# The stand-in tape of discarding(): ops see a tape, but what they record is dropped.
_DISCARD = object()


class _Node:
    __slots__ = ("after", "backward", "inputs", "once", "outputs", "partial", "spent")

    def __init__(self, inputs, outputs, backward, after, once, partial):
        self.inputs, self.outputs, self.backward = inputs, outputs, backward
        self.after, self.once, self.partial = after, once, partial
        self.spent = False  # a run-once node whose backward has run (see Tape.gradient)


def _zeros_like(a):
    if isinstance(a, _Released) or getattr(a, "_tecupy_codes", False):  # (an FP8 weight)
        return a.xp.zeros(a.shape, a.dtype)
    return xp_of(a).zeros_like(a)


def _sum(a, b):
    """The sum of two gradients of one array: through the add op (one pass, float32 sum
    rounded once) where shape and dtype match, else array arithmetic (broadcast grads)."""
    if a.shape == b.shape and a.dtype == b.dtype and type(a) is type(b):
        from . import backends
        return backends.dispatch("add_fwd", a, b)
    return a + b


def recording():
    """True when a Tape is open in this thread (gradients are being recorded)."""
    return bool(_active.get())


def record(backward, inputs, outputs, after_backward=(), once=None, partial=None):
    """Record an op: backward(*output_grads) -> one gradient (or None) per input.

    after_backward: (fn, item) pairs. After the whole backward of a Tape.gradient, each
    distinct fn runs once, fn(items), with the distinct items (by identity) of the nodes
    whose backward ran: many nodes' work batched in one call.
    once: None, or (what, why) where the backward may run only once (it has effects beyond
    its gradients): a second backward through the node is refused, before anything runs,
    with "the backward of <what> on this tape already ran <why>".
    partial: None, or the index of an input whose gradient the backward can sum in its own
    pass: it is then called backward(*output_grads, partial=g), g the gradient that input
    already has from the consumers whose backward ran (None if none, or if g's shape or
    dtype differ from the input's), and returns that input's whole gradient, g included
    (issue 21: a norm adds the residual branch's gradient in its kernel, no add kernel)."""
    tapes = _active.get()
    if tapes and tapes[0] is _DISCARD:
        tapes = tapes[1:]  # (a Tape opened inside discarding() still records)
    if not tapes:
        return
    node = _Node(tuple(inputs), tuple(outputs), backward, tuple(after_backward), once, partial)
    for tape in tapes:
        tape._nodes.append(node)
    nodes = tapes[0]._nodes  # the outermost tape: every node of the inner ones is on it
    if len(nodes) % _SWEEP_EVERY == 0:
        _sweep(nodes[-_SWEEP_WINDOW:])


@contextlib.contextmanager
def discarding():
    """Inside, ops run as under a tape (they note their FP8 states for the forward update)
    but nothing is kept for a backward: tecupy.checkpoint's first forward, whose backward
    recomputes. (An op could ask keeping() to skip work only a backward needs.)"""
    token = _active.set((_DISCARD,))
    try:
        yield
    finally:
        _active.reset(token)


def keeping():
    """True when a recorded op's backward may run: a Tape records (not discarding())."""
    tapes = _active.get()  # (discarding() puts _DISCARD first, Tapes opened in it follow:
    return len(tapes) > 1 or (len(tapes) == 1 and tapes[0] is not _DISCARD)  # no generator)


def retaining():
    """True inside a backward that may run again (retain_graph=True): a node's backward
    must then leave what it saved in place; otherwise it may drop each saved array as soon
    as it is used (the node runs once)."""
    return _retain.get()


def _as_list(x):
    return (list(x), True) if isinstance(x, (list, tuple)) else ([x], False)


def _check_arrays(what, items):
    """Each item an array (anything with shape and dtype), else a TypeError naming it."""
    for n, a in enumerate(items):
        if not (hasattr(a, "shape") and hasattr(a, "dtype")):
            raise TypeError(f"Tape.gradient: {what}[{n}] must be a numpy or cupy array, got "
                            f"{type(a).__name__} {a!r:.40}; wrt may be an array, a list/tuple "
                            "or dict of arrays, or a tecupy.nn module")


class Tape:
    def __init__(self):
        self._nodes = []

    def __enter__(self):
        _active.set(_active.get() + (self,))
        return self

    def __exit__(self, *exc):
        _active.set(tuple(t for t in _active.get() if t is not self))
        return False

    def _known_ids(self):
        ids = set()
        for node in self._nodes:
            ids.update(id(a) for a in node.inputs if a is not None)
            ids.update(id(a) for a in node.outputs)
        return ids

    def gradient(self, outputs, wrt, output_grad=None, retain_graph=False, on_grad=None,
                 keep_grads=True):
        """Gradients of `outputs` (weighted by `output_grad`, default ones) w.r.t. `wrt`.

        `wrt` may be one array, a list/tuple (a list comes back), a dict name -> array (a dict
        comes back) or a tecupy.nn module (a dict by parameter name comes back). Arrays that
        are on the tape but do not reach `outputs` get zeros.

        As in PyTorch, each node's backward releases what its op saved for it (FP8 codes,
        norm statistics, attention's log-sum-exp, ...) as soon as it has run, so memory is
        freed during the backward; a second gradient() through the same ops is then a clear
        error, unless the first call passed retain_graph=True. Ops whose backward may run
        only once (FP8 ops; see _check_once) refuse a second run even so.

        on_grad: None, or a callable on_grad(i, grad) called once per wrt[i] (i: the position
        in the list, or in the key order of a dict or of a module's named_parameters()), as
        soon as that gradient is final, during the backward: right after the backward of the
        earliest-recorded node that takes wrt[i] as an input (the last of its consumers to
        run; also when that node gets no gradient and is skipped), in backward order. grad is
        the very array this call returns for wrt[i] (unbroadcast, in wrt[i]'s dtype), so a
        data-parallel reducer can start its all-reduce while the backward goes on and write
        the mean back in place (tecupy.distributed.GradientReducer). A wrt[i] that got no
        gradient by then (no node reached it, or every backward gave it None) is passed
        after the backward, in index order, as the zeros that are returned, so every rank
        hands every index over and the buckets' all-reduces line up; so is an output asked
        for that no node consumes (its output_grad). Read grad, do not write into it, before
        this call returns: the backward may still read that array (an intermediate's producer
        reads its gradient; an add hands one dy to both inputs, so a leaf's gradient can be
        another array's too).

        keep_grads: True, or False with on_grad: the tape drops each gradient as soon as
        on_grad(i, grad) returns and the call returns None, so the gradients of `wrt` are
        never all alive at once: on_grad consumes them as they come (an optimizer updating
        each parameter: Optimizer.step_in_backward). wrt[i] itself may then be changed in
        place by on_grad: every node that takes it as an input has run, and an op's backward
        reads only its own inputs and what it saved of them (test_tape.py overwrites each
        parameter of FP8, checkpointed and FP8-weight layers as it is handed over).
        """
        _check_on_grad(on_grad, keep_grads)
        if callable(getattr(wrt, "named_parameters", None)):  # a module (the tape knows no nn)
            wrt = wrt.named_parameters()
        if isinstance(wrt, dict):
            got = self.gradient(outputs, list(wrt.values()), output_grad, retain_graph,
                                on_grad, keep_grads)
            return None if got is None else dict(zip(wrt, got))
        # the peak is at the start of the backward: free what only the tape holds first
        # (what the caller passed here is referenced by this frame, so it stays)
        index = _sweep(self._nodes)
        outs, _ = _as_list(outputs)
        targets, many = _as_list(wrt)
        _check_arrays("outputs", outs)
        _check_arrays("wrt", targets)
        if output_grad is not None:
            _check_arrays("output_grad", _as_list(output_grad)[0])
        known = self._known_ids()
        grads = self._seed(outs, output_grad, known)
        self._check_known(targets, known)
        reached = self._reached(grads)
        self._check_once(reached)
        keep = {id(t) for t in targets}  # gradients kept in grads past their producer
        hand = None if on_grad is None else _Handover(on_grad, targets, reached,
                                                      None if keep_grads else keep)
        del reached
        token = _retain.set(bool(retain_graph))
        try:
            self._backprop(grads, None if retain_graph else index, keep, hand)
        finally:
            _retain.reset(token)
        del index
        if not keep_grads:
            hand.drain(grads)
            return None
        result = []
        for i, t in enumerate(targets):
            g = grads.get(id(t)) if hand is None else hand.given.get(i, grads.get(id(t)))
            result.append(_final(t, g))
        if hand is not None:
            hand.rest(result)
        return result if many else result[0]

    def _seed(self, outs, output_grad, known):
        ogs = [None] * len(outs) if output_grad is None else _as_list(output_grad)[0]
        if len(ogs) != len(outs):
            raise ValueError(f"Tape.gradient: {len(outs)} outputs but {len(ogs)} output grads")
        grads = {}
        for n, (o, g) in enumerate(zip(outs, ogs)):
            if id(o) not in known:
                raise ValueError(f"Tape.gradient: output {n} (shape {tuple(o.shape)}) was not "
                                 "produced by a tecupy op recorded on this tape")
            g = xp_of(o).ones_like(o) if g is None else g
            if tuple(g.shape) != tuple(o.shape):
                raise ValueError(f"Tape.gradient: output_grad {n} has shape {tuple(g.shape)}, "
                                 f"output has {tuple(o.shape)}")
            grads[id(o)] = grads[id(o)] + g if id(o) in grads else g
        return grads

    def _check_known(self, targets, known):
        for n, t in enumerate(targets):
            if id(t) not in known:
                raise ValueError(
                    f"Tape.gradient: wrt[{n}] (shape {tuple(t.shape)}, {t.dtype}) is not on this "
                    "tape: no recorded tecupy op used it. Arrays made by slicing, reshape or "
                    "arithmetic outside tecupy are new arrays; use tecupy.add/reshape/split.")

    def _reached(self, grads):
        """The nodes a backward from `grads` may run (all inputs of a reached node count as
        reached, whether or not its backward gives them a gradient)."""
        live, out = set(grads), []
        for node in reversed(self._nodes):
            if any(id(o) in live for o in node.outputs):
                out.append(node)
                live.update(id(x) for x in node.inputs if x is not None)
        return out

    def _check_once(self, reached):
        """A node recorded with `once` has a backward with effects beyond its gradients:
        FP8 ops record the gradients' amaxes and then the backward scales are updated, once
        per backward, as Transformer Engine does; a second backward through them would
        quantize with the new scales and record the amaxes again (a different result, a
        corrupted history). PyTorch likewise refuses a second backward through a freed
        graph. Checked before anything runs: nothing is half-applied. reached: _reached's
        nodes."""
        spent = next((n for n in reached if n.once and n.spent), None)
        if spent is not None:
            what, why = spent.once
            raise RuntimeError(
                f"Tape.gradient: the backward of {what} on this tape already ran {why}. Ask "
                "for every gradient in one call, tape.gradient(outputs, [a, b, ...]), or "
                "record the forward again under a new Tape.")
        if any(n.backward is None for n in reached):
            raise RuntimeError(
                "Tape.gradient: the backward of ops on this tape already ran and released what "
                "they saved for it. Pass retain_graph=True to the first tape.gradient to run "
                "it again (as in PyTorch), ask for every gradient in one call, "
                "tape.gradient(outputs, [a, b, ...]), or record the forward again.")

    def _backprop(self, grads, index, keep, hand=None):
        """Run the reached nodes' backwards in reverse. index: None (retain_graph), else the
        tape's _index: after each node's backward its closure is dropped, and what only the
        tape then holds of its inputs and outputs is freed (issue 22: the tuples would keep
        what the closure released alive until the tape dies). A node's output gradients are
        complete when it runs (every consumer ran before it) and are handed to it, not kept,
        unless asked for (ids in `keep`): an intermediate gradient lives no longer than in
        PyTorch's autograd (issue 22: 0.6 GiB of them at the quickstart layer's attention).
        hand: None, or the call's _Handover: after each node (run or skipped), the
        gradients it completed go to on_grad."""
        hooks = {}  # fn -> {id(item): item}, in the order first met
        for node in reversed(self._nodes):
            if any(id(o) in grads for o in node.outputs):
                _accumulate(node, _run(node, _output_grads(node, grads, keep), grads), grads)
                node.spent = node.once is not None
                if index is not None:
                    node.backward = None  # the closure held the op's saved arrays: freed now
                    _release(index, _ids(node), grads)
                for fn, item in node.after:
                    hooks.setdefault(fn, {}).setdefault(id(item), item)
            if hand is not None and id(node) in hand.due:
                hand.give(node, grads)
        for fn, items in hooks.items():
            fn(list(items.values()))


def _check_on_grad(on_grad, keep_grads):
    if on_grad is not None and not callable(on_grad):
        raise TypeError(f"Tape.gradient: on_grad must be None or a callable "
                        f"on_grad(i, grad); got {type(on_grad).__name__} {on_grad!r:.40}")
    if not isinstance(keep_grads, (bool, np.bool_)):
        raise TypeError(f"Tape.gradient: keep_grads must be a bool; got "
                        f"{type(keep_grads).__name__} {keep_grads!r:.40}")
    if not keep_grads and on_grad is None:
        raise ValueError("Tape.gradient: keep_grads=False needs an on_grad(i, grad) that "
                         "consumes each gradient (nothing would be returned)")


def _final(t, g):
    """The gradient returned for target t: g in t's dtype, zeros where none came."""
    return _zeros_like(t) if g is None else g.astype(t.dtype, copy=False)


class _Handover:
    """Tape.gradient's on_grad: which gradients each node completes, and those handed over.

    due: {id(node): [i, ...]}, node the last of wrt[i]'s consumers to run (the earliest
    recorded among the reached nodes): built in one pass over them, in backward order, each
    later consumer overwriting. given: {i: the array passed}, which gradient() returns (the
    caller gets it: no array is kept beyond those). Holds no node and no input array.
    drop: None (keep_grads), else the backward's `keep` set: a gradient handed over leaves
    grads (a leaf's) or that set (an intermediate's, which its producer then takes as any
    other), and `given` stays empty: the tape holds no gradient once on_grad returns."""

    def __init__(self, on_grad, targets, reached, drop=None):
        self.on_grad, self.targets, self.given = on_grad, targets, {}
        self.drop, self.handed = drop, set()
        want = {}
        for i, t in enumerate(targets):
            want.setdefault(id(t), []).append(i)
        last, made = {}, set()  # made: targets some reached node outputs
        for node in reached:
            for x in node.inputs:
                if id(x) in want:
                    last[id(x)] = id(node)
            for o in node.outputs:
                if id(o) in want:
                    made.add(id(o))
        self.made = made
        self.due = {}
        for k, node in last.items():
            self.due.setdefault(node, []).extend(want[k])

    def give(self, node, grads):
        """Hand over the gradients that `node` completed (after it ran, or was skipped), in
        index order (the indices of an array that wrt holds twice together)."""
        by_array = {}
        for i in sorted(self.due.pop(id(node))):
            by_array.setdefault(id(self.targets[i]), []).append(i)
        for k, indices in by_array.items():
            self._give(k, indices, grads)

    def _give(self, k, indices, grads):
        """wrt[indices] (one array, id k) handed over (a function of its own: no gradient
        stays bound in give's frame once dropped)."""
        t = self.targets[indices[0]]
        g = grads.get(k)
        if g is None:
            return  # no gradient came: zeros, after the backward (rest)
        g = g.astype(t.dtype, copy=False)  # (as gradient() returns it)
        if k not in self.made:
            grads[k] = g  # a leaf: nothing reads the uncast one again
        for i in indices:
            self._pass(i, g)
        if self.drop is not None:
            if k in self.made:
                self.drop.discard(k)  # its producer takes it, as any intermediate's
            else:
                del grads[k]

    def _pass(self, i, g):
        if self.drop is None:
            self.given[i] = g
        self.handed.add(i)
        self.on_grad(i, g)

    def rest(self, result):
        """After the backward: the gradients not handed over yet (zeros, or an output's
        seed), in index order."""
        for i, g in enumerate(result):
            if i not in self.handed:
                self._pass(i, g)

    def drain(self, grads):
        """rest() for keep_grads=False: each made when it is passed, dropped after."""
        for i, t in enumerate(self.targets):
            if i not in self.handed:
                self._pass(i, _final(t, grads.get(id(t))))


def _output_grads(node, grads, keep):
    """The gradients of node's outputs (zeros where none arrived), taken out of grads
    unless kept (a function of its own: no gradient stays bound in _backprop's frame)."""
    ogs = [grads.get(id(o)) if id(o) in keep else grads.pop(id(o), None)
           for o in node.outputs]
    return [_zeros_like(o) if g is None else g for o, g in zip(node.outputs, ogs)]


def _run(node, ogs, grads):
    """node's backward on its output gradients `ogs`; with the gradient its `partial` input
    already has, taken out of grads, where the node sums it in its own pass (see record)."""
    if node.partial is None:
        return node.backward(*ogs)
    x = node.inputs[node.partial]
    g = grads.get(id(x))
    fits = g is not None and tuple(g.shape) == tuple(x.shape) and g.dtype == x.dtype and (
        xp_of(g) is (x.xp if isinstance(x, _Released) else xp_of(x)))
    return node.backward(*ogs, partial=grads.pop(id(x)) if fits else None)


def _accumulate(node, in_grads, grads):
    """Add a node's input gradients into grads (a function of its own: no input stays bound
    in the backward's frame, where it would keep the input from being released)."""
    for x, g in zip(node.inputs, in_grads):
        if x is None or g is None:
            continue
        g = unbroadcast(g, x.shape)
        grads[id(x)] = _sum(grads[id(x)], g) if id(x) in grads else g

"""A small autodiff tape.

    with tecupy.Tape() as tape:
        y = tecupy.linear(x, w, b)
    dx, dw = tape.gradient(y, [x, w], output_grad=dy)

Every tecupy op calls `record(backward, inputs, outputs)` when a tape is active; the
backward closure sits beside its forward in the op and captures what it saved. Arrays are
identified by object identity (the tape keeps them alive, so ids stay unique). Arrays made
outside tecupy ops (slicing, reshape, arithmetic) are new objects the tape never saw: use
tecupy.add / reshape / split, or ask for the gradient of the array that went into the op.

The tape runs nodes and hooks and knows nothing of what they do: a node may ask for work
after the whole backward (after_backward: FP8 ops update their states' backward scales
there, all in one call) and may say its backward can run only once (once: FP8 ops, whose
backward records amaxes).
"""
import contextvars
import types

from ._array import unbroadcast, xp_of

# The open tapes of this thread (a tuple, rebuilt on enter/exit): every op records into all
# of them. A context variable, so each thread (and each asyncio task) has its own: one
# thread's ops never land on another thread's tape.
_active = contextvars.ContextVar("tecupy_tapes", default=())


class _Node:
    __slots__ = ("inputs", "outputs", "backward", "after", "once", "spent")

    def __init__(self, inputs, outputs, backward, after, once):
        self.inputs, self.outputs, self.backward = inputs, outputs, backward
        self.after, self.once = after, once
        self.spent = False  # a run-once node whose backward has run (see Tape.gradient)


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


def record(backward, inputs, outputs, after_backward=(), once=None):
    """Record an op: backward(*output_grads) -> one gradient (or None) per input.

    after_backward: (fn, item) pairs. After the whole backward of a Tape.gradient, each
    distinct fn runs once, fn(items), with the distinct items (by identity) of the nodes
    whose backward ran: many nodes' work batched in one call.
    once: None, or (what, why) where the backward may run only once (it has effects beyond
    its gradients): a second backward through the node is refused, before anything runs,
    with "the backward of <what> on this tape already ran <why>"."""
    tapes = _active.get()
    if not tapes:
        return
    node = _Node(tuple(inputs), tuple(outputs), backward, tuple(after_backward), once)
    for tape in tapes:
        tape._nodes.append(node)


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

    def gradient(self, outputs, wrt, output_grad=None, retain_graph=False):
        """Gradients of `outputs` (weighted by `output_grad`, default ones) w.r.t. `wrt`.

        `wrt` may be one array, a list/tuple (a list comes back), a dict name -> array (a dict
        comes back) or a tecupy.nn module (a dict by parameter name comes back). Arrays that
        are on the tape but do not reach `outputs` get zeros.

        As in PyTorch, each node's backward releases what its op saved for it (FP8 codes,
        norm statistics, attention's log-sum-exp, ...) as soon as it has run, so memory is
        freed during the backward; a second gradient() through the same ops is then a clear
        error, unless the first call passed retain_graph=True. Ops whose backward may run
        only once (FP8 ops; see _check_once) refuse a second run even so.
        """
        if callable(getattr(wrt, "named_parameters", None)):  # a module (the tape knows no nn)
            wrt = wrt.named_parameters()
        if isinstance(wrt, dict):
            return dict(zip(wrt, self.gradient(outputs, list(wrt.values()), output_grad,
                                               retain_graph)))
        outs, _ = _as_list(outputs)
        targets, many = _as_list(wrt)
        _check_arrays("outputs", outs)
        _check_arrays("wrt", targets)
        if output_grad is not None:
            _check_arrays("output_grad", _as_list(output_grad)[0])
        known = self._known_ids()
        grads = self._seed(outs, output_grad, known)
        self._check_known(targets, known)
        self._check_once(grads)
        self._backprop(grads, bool(retain_graph))
        result = []
        for t in targets:
            g = grads.get(id(t))
            result.append(xp_of(t).zeros_like(t) if g is None else g.astype(t.dtype, copy=False))
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

    def _check_once(self, grads):
        """A node recorded with `once` has a backward with effects beyond its gradients:
        FP8 ops record the gradients' amaxes and then the backward scales are updated, once
        per backward, as Transformer Engine does; a second backward through them would
        quantize with the new scales and record the amaxes again (a different result, a
        corrupted history). PyTorch likewise refuses a second backward through a freed
        graph. Checked before anything runs: nothing is half-applied."""
        reached = self._reached(grads)
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

    def _backprop(self, grads, retain):
        hooks = {}  # fn -> {id(item): item}, in the order first met
        for node in reversed(self._nodes):
            if not any(id(o) in grads for o in node.outputs):
                continue
            ogs = [grads.get(id(o)) for o in node.outputs]
            ogs = [xp_of(o).zeros_like(o) if g is None else g for o, g in zip(node.outputs, ogs)]
            in_grads = node.backward(*ogs)
            for x, g in zip(node.inputs, in_grads):
                if x is None or g is None:
                    continue
                g = unbroadcast(g, x.shape)
                grads[id(x)] = _sum(grads[id(x)], g) if id(x) in grads else g
            node.spent = node.once is not None
            if not retain:
                node.backward = None  # the closure held the op's saved arrays: freed now
            for fn, item in node.after:
                hooks.setdefault(fn, {}).setdefault(id(item), item)
        for fn, items in hooks.items():
            fn(list(items.values()))


def _arrays_in(obj, depth=3):
    """Arrays (anything with an int nbytes and a shape) in obj, in a tuple or list, in the
    closure of a function it wraps (a few levels), or one attribute down (an FP8 tensor's
    codes, transposed codes and scale_inv)."""
    if isinstance(obj, (tuple, list)):
        return [a for item in obj for a in _arrays_in(item, depth)]
    if isinstance(obj, types.FunctionType):
        cells = obj.__closure__ or () if depth else ()
        return [a for c in cells for a in _arrays_in(c.cell_contents, depth - 1)]
    if _is_array(obj):
        return [obj]
    attrs = None if isinstance(obj, type) else getattr(obj, "__dict__", None)
    return [] if attrs is None else [v for v in attrs.values() if _is_array(v)]


def _is_array(obj):
    return not isinstance(obj, type) and isinstance(getattr(obj, "nbytes", None), int) \
        and hasattr(obj, "shape")


def _root(a):
    """The array that owns a view's memory (numpy and cupy both keep it as .base)."""
    while _is_array(getattr(a, "base", None)):
        a = a.base
    return a


def saved_bytes(tape, exclude=()):
    """What `tape` keeps alive for the backward: ([(op, bytes)] per node whose backward has
    not run, the memory its backward closure keeps; held bytes), where held is the memory
    of the nodes' inputs and outputs that no closure keeps (alive only because the tape
    holds them). Memory is counted once over the tape, by the array that owns it (a view
    counts as its base); arrays whose id is in `exclude` (a module's parameters) are left
    out. op is the function that recorded the node."""
    seen, rows = set(exclude), []

    def new_bytes(arrays):
        size = 0
        for a in map(_root, arrays):
            if id(a) not in seen:
                seen.add(id(a))
                size += a.nbytes
        return size
    for node in tape._nodes:
        if node.backward is not None:
            op = node.backward.__qualname__.split(".<locals>")[0]
            rows.append((op, new_bytes(_arrays_in(node.backward))))
    held = new_bytes(a for node in tape._nodes for a in (*node.inputs, *node.outputs)
                     if a is not None and id(a) not in set(exclude))
    return rows, held

"""What the tape frees and what it keeps (issue 22): the sweep that swaps an array only the
tape holds for a placeholder (_Released), so its memory goes as soon as nothing else can
ask for it, and saved_bytes, the memory report of what a tape keeps for its backward
(python -m tecupy.bench layer prints it). tape.py runs them; see its docstring."""
import sys
import types

import numpy as np

from ._array import xp_of

try:  # (read per sweep: a test may stand another class in for cupy.ndarray)
    import cupy as _cupy
except ImportError:  # pragma: no cover - cupy is a declared dependency
    _cupy = None
_ARRAY_KINDS = (np.ndarray,)


class _Released:
    """Stands, in the nodes, for an array that only the tape held (see _sweep): what the
    backward still needs of it (shape for unbroadcasting, shape, dtype and array module for
    zero gradients), with an identity of its own: a new array may reuse the freed one's id,
    never this object's."""
    __slots__ = ("dtype", "shape", "xp")

    def __init__(self, a):
        self.shape, self.dtype, self.xp = tuple(a.shape), a.dtype, xp_of(a)

    def __repr__(self):
        return f"<released {self.xp.__name__} array {self.shape} {self.dtype}>"


def _refs(entry):
    """References to entry[0] (its holders, the entry, the call's argument)."""
    return sys.getrefcount(entry[0])


# What _refs reads of an object held by nothing but its entry: measured, not assumed, as
# the interpreter's own temporaries may differ between Python versions.
_ALONE = _refs([object(), []])


def _index(nodes):
    """{id: [array, [the node of each reference to it from these nodes' tuples]]}. A
    function of its own: its loop variables, which hold arrays, are gone when references
    are counted."""
    index = {}
    get = index.get
    kinds = _ARRAY_KINDS if _cupy is None else (np.ndarray, _cupy.ndarray)
    for node in nodes:  # (one isinstance of a tuple and one lookup per array: every
        for a in node.inputs + node.outputs:  # record's sweep pays this, issue 21)
            if isinstance(a, kinds):  # (not None, not a _Released, not an FP8 weight)
                entry = get(id(a))
                if entry is None:
                    index[id(a)] = [a, [node]]
                else:
                    entry[1].append(node)
    return index


def _ids(node):
    return list(map(id, node.inputs + node.outputs))


def _bases(index, keys):
    """The keys of `index` that are bases of the arrays of `keys` (a helper: no array stays
    bound in the caller's frame)."""
    return [id(b) for b in (getattr(index[k][0], "base", None) for k in keys)
            if b is not None and id(b) in index]


def _sweep(nodes):
    """Free every array that nothing but `nodes` holds (see _release)."""
    index = _index(nodes)
    _release(index, list(index))
    return index


def _release(index, keys, grads=None):
    """Of the arrays of `keys`, free each that nothing but its nodes' tuples holds: it is
    swapped for a _Released in those tuples and dropped from `index` (its last reference).
    Nothing else refers to such an array, so no later op can take it and no caller can ask
    for it. Conservative: a reference from anywhere else (a variable, a backward closure
    that saved it, a view's .base, a node not indexed, another tape's) keeps it. Repeats on
    the bases of what was freed: freeing a view can leave its base alone. grads: a running
    backward's {id: gradient}, whose keys move to the placeholders."""
    get = index.get
    while keys:  # (loops, not comprehensions: each backward node runs this, issue 21)
        dead = {}
        for k in keys:
            entry = get(k)
            if entry is not None and _refs(entry) - len(entry[1]) == _ALONE:
                dead[k] = _Released(entry[0])
        if not dead:  # (the common case: every array of the node is held elsewhere)
            return
        holders = {id(n): n for k in dead for n in index[k][1]}
        for node in holders.values():  # (the dead arrays are alive here: their ids are theirs)
            node.inputs = _swapped(node.inputs, dead)
            node.outputs = _swapped(node.outputs, dead)
        if grads is not None:
            for k, placeholder in dead.items():
                if k in grads:
                    grads[id(placeholder)] = grads.pop(k)
        keys = _bases(index, dead)
        for k in dead:
            del index[k]  # the last reference: the array is freed


def _swapped(group, dead):
    for a in group:  # (a loop: any() of a generator costs ~1 us more, per node swept)
        if id(a) in dead:
            return tuple([dead.get(id(b), b) for b in group])
    return group


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
    of the nodes' inputs and outputs that no closure keeps. The tape is swept first (as a
    backward starts: what only the tape held is freed), so held counts only arrays that
    something else (the caller) holds too. Memory is counted once over the tape, by the
    array that owns it (a view counts as its base); arrays whose id is in `exclude` (a
    module's parameters) are left out. op is the function that recorded the node."""
    _sweep(tape._nodes)
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
                     if _is_array(a) and id(a) not in set(exclude))
    return rows, held

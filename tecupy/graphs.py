"""CUDA graphs of whole training steps: `make_graphed_step`.

    step = tecupy.make_graphed_step(layer, (x, dy), fp8_recipe=recipe)  # warm-up + capture
    for batch in data:
        x[...] = batch                      # or step(new_x, new_dy): copied into x, dy
        y, grads = step(x, dy)              # one graph launch: forward, backward, FP8 update

Transformer Engine's make_graphed_callables graphs callables that then sit inside PyTorch's
autograd (a forward graph and a backward graph per callable). tecupy's tape is not autograd
and a step is short: the whole step (forward, tape.gradient, the FP8 scale updates, an
optimizer) is captured as one graph and replayed with one launch, hence `make_graphed_step`.

What a replay reproduces, bit for bit, as the same number of eager steps would:
- every kernel of the step, reading the static inputs (the sample arrays) and writing the
  static outputs (the arrays the capture returned: each replay overwrites them);
- the FP8 state: the amax history roll, scale update and casts run inside the graph;
- dropout: each seed drawn during the capture (a module's `next_seed`, or a fresh one for
  `seed=None`) is drawn again on the host before each replay, in the same order, and the
  kernels read it from the graph's seed table (the table is one small copy per replay).
What cannot be captured is an error when capturing: NumPy arrays, a host sync (reading a
GPU value into Python), a host-to-device copy. Other shapes need another capture.
"""
import contextvars

import numpy as np

from ._array import is_cupy

# The capture in progress in this thread (a _Capture), or None.
_capturing = contextvars.ContextVar("tecupy_capture", default=None)
MAX_SEEDS = 1024  # dropout seeds one step may draw (the seed table: 8 KiB)
SEED_RING = 4  # pinned host buffers the seed uploads cycle through


class _Capture:
    """What a capture collects: the seeds drawn (value -> slot of the seed table, and the
    callable that draws it again) and objects its kernels read that must outlive it."""

    def __init__(self, seed_table):
        self.seed_table = seed_table  # cupy uint64 [MAX_SEEDS]
        self.slots, self.draws, self.values = {}, [], []
        self.keep = []

    def note_seed(self, value, draw):
        # A value drawn again in the capture (a checkpoint's recompute restores the
        # generator and draws the same seed) is the same draw: one slot.
        if value in self.slots:
            return
        if len(self.draws) >= MAX_SEEDS:
            raise RuntimeError(f"make_graphed_step: the step draws more than {MAX_SEEDS} "
                               "dropout seeds; raise tecupy.graphs.MAX_SEEDS")
        self.slots[value] = len(self.draws)
        self.draws.append(draw)
        self.values.append(value)


def capturing():
    """True while make_graphed_step captures in this thread."""
    return _capturing.get() is not None


def draw_seed(draw):
    """draw() -> a dropout seed (an int in [0, 2**64)). Under a capture the draw is also
    remembered, to be made again before each replay (Module.next_seed and the ops' fresh
    seeds come through here)."""
    value = draw()
    cap = _capturing.get()
    if cap is not None:
        cap.note_seed(value, draw)
    return value


def _random():
    return int(np.random.default_rng().integers(0, 2**63))


def fresh_seed():
    """A random dropout seed (the ops' seed=None), drawn afresh by each replay too."""
    return draw_seed(_random)


def seed_pointer(seed):
    """The kernels' seed_ptr argument for `seed`: 0 (use the value passed), or under a
    capture, where the seed was drawn in it, the address of its slot in the seed table."""
    cap = _capturing.get()
    slot = None if cap is None or seed is None else cap.slots.get(seed)
    return np.uint64(0 if slot is None else cap.seed_table.data.ptr + 8 * slot)


def keep_alive(obj):
    """Under a capture, keep `obj` (an array the captured kernels read, made outside the
    step, e.g. a cached pointer table) alive as long as the graph."""
    cap = _capturing.get()
    if cap is not None:
        cap.keep.append(obj)


def make_graphed_step(fn, sample_args, warmup_steps=1, fp8_enabled=None, fp8_recipe=None):
    """Capture one training step in a CUDA graph; returns a GraphedStep, whose calls replay
    it. `fn` is a step function fn(*sample_args) -> arrays (an array, None, or tuples,
    lists and dicts of them), or a tecupy.nn.Module: then sample_args are its inputs then the
    gradient of its output, and a step is, under a Tape (and fp8_autocast(fp8_enabled,
    fp8_recipe) around the forward), y = module(*inputs) and the gradients of y (weighted by
    that gradient) w.r.t. the module's parameters and the inputs: it returns
    (y, {name: grad}, [grad of each input]).

    sample_args: CuPy arrays; they become the graph's static inputs (read in place by every
    replay). warmup_steps (>= 1) eager steps run first on them, as real steps (FP8 amaxes
    recorded, dropout seeds drawn): they compile the kernels and make the FP8 states and
    pointer tables a capture may not make. fp8_enabled: None (FP8 iff fp8_recipe is given) or
    a bool. The capture runs on a stream of its own with a memory pool of its own, which the
    graph keeps (its temporaries' memory, as in PyTorch)."""
    from . import _check
    op = "make_graphed_step"
    if not callable(fn):
        _check.fail(op, "fn", "a step function or a tecupy.nn.Module", fn, TypeError)
    warmup_steps = _check.integer(op, "warmup_steps", warmup_steps, 1)
    if not isinstance(sample_args, (tuple, list)):
        sample_args = (sample_args,)
    if callable(getattr(fn, "named_parameters", None)):  # a module
        fn = _module_step(fn, len(sample_args), fp8_enabled, fp8_recipe)
    elif fp8_enabled is not None or fp8_recipe is not None:
        raise TypeError(f"{op}: fp8_enabled and fp8_recipe are for a module; a step function "
                        "opens fp8_autocast itself (around its forward)")
    _check_no_autocast(op)
    for n, a in enumerate(sample_args):
        if not is_cupy(a):
            _check.fail(op, f"sample_args[{n}]", "a cupy array (CUDA graphs run on the GPU)",
                        a, TypeError)
    for _ in range(warmup_steps):
        fn(*sample_args)
    return GraphedStep(fn, tuple(sample_args))


def _module_step(module, nargs, fp8_enabled, fp8_recipe):
    from .autocast import fp8_autocast
    from .tape import Tape
    if nargs < 2:
        raise ValueError("make_graphed_step: for a module, sample_args are its inputs and "
                         f"then the gradient of its output (at least 2 arrays), got {nargs}")
    enabled = fp8_recipe is not None if fp8_enabled is None else fp8_enabled

    def step(*args):
        inputs, dy = args[:-1], args[-1]
        with Tape() as tape, fp8_autocast(enabled=enabled, fp8_recipe=fp8_recipe):
            y = module(*inputs)
        params = module.named_parameters()
        grads = tape.gradient(y, list(params.values()) + list(inputs), output_grad=dy)
        return y, dict(zip(params, grads)), grads[len(params):]
    return step


def _check_no_autocast(op):
    from .autocast import _stack
    if _stack.get():
        raise RuntimeError(f"{op}: called inside fp8_autocast. The forward scales update "
                           "when the outermost autocast exits, which must happen inside the "
                           "captured step: open the autocast inside the step function (or "
                           "pass fp8_recipe= with a module)")


class GraphedStep:
    """A captured step. Calling it with arrays of the sample arrays' shapes and dtypes copies
    them into the static inputs (none is copied when passed itself), draws the step's
    dropout seeds, launches the graph on the current stream and returns the static outputs
    (overwritten by the next call)."""

    def __init__(self, fn, static_inputs):
        import cupy
        self.static_inputs = static_inputs
        self.pool = cupy.cuda.MemoryPool()  # the graph's temporaries live here for good
        self.replays = 0
        cap = _Capture(cupy.zeros((MAX_SEEDS,), np.uint64))
        self.graph, self.static_outputs = _capture(fn, static_inputs, self.pool, cap)
        self._seeds, self._keep = cap, cap.keep
        self._ring = [(cupy.cuda.alloc_pinned_memory(8 * MAX_SEEDS), cupy.cuda.Event())
                      for _ in range(SEED_RING if cap.draws else 0)]

    def __call__(self, *args):
        import cupy
        self._take_inputs(args)
        stream = cupy.cuda.get_current_stream()
        self._upload_seeds(stream)
        self.graph.launch(stream)
        self.replays += 1
        return self.static_outputs

    def _take_inputs(self, args):
        import cupy
        if len(args) != len(self.static_inputs):
            raise TypeError(f"GraphedStep: captured with {len(self.static_inputs)} arrays, "
                            f"called with {len(args)}")
        for n, (a, s) in enumerate(zip(args, self.static_inputs)):
            if a is s:
                continue
            if not is_cupy(a) or a.shape != s.shape or a.dtype != s.dtype:
                what = (f"{type(a).__name__} shape {getattr(a, 'shape', None)} "
                        f"{getattr(a, 'dtype', '')}")
                raise ValueError(f"GraphedStep: argument {n} must be a cupy array of shape "
                                 f"{s.shape} and dtype {s.dtype} (as captured; other shapes "
                                 f"need another make_graphed_step), got {what}")
            cupy.copyto(s, a)

    def _upload_seeds(self, stream):
        """This replay's seeds into the seed table: the capture's own draws for the first
        replay (the capture drew them, as the eager step would have), fresh draws after."""
        cap = self._seeds
        if not cap.draws:
            return
        values = cap.values if self.replays == 0 else [d() for d in cap.draws]
        mem, done = self._ring[self.replays % len(self._ring)]
        done.synchronize()  # this buffer's previous upload has been read
        host = np.frombuffer(mem, np.uint64, len(values))
        host[...] = values
        cap.seed_table.data.copy_from_host_async(mem.ptr, 8 * len(values), stream)
        done.record(stream)


def _capture(fn, static_inputs, pool, cap):
    """(graph, outputs) of fn(*static_inputs) captured on a stream of its own."""
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    cupy.cuda.Device().synchronize()  # the warm-up's work is done before the capture reads
    token = _capturing.set(cap)
    try:
        with cupy.cuda.using_allocator(pool.malloc), stream:
            stream.begin_capture()
            try:
                outputs = fn(*static_inputs)
            except BaseException as err:
                _abandon(stream)
                raise _capture_error(err) from err
            graph = stream.end_capture()
    finally:
        _capturing.reset(token)
    _check_outputs(outputs, "output")
    return graph, outputs


def _abandon(stream):
    try:
        stream.end_capture()
    except Exception:
        pass  # an invalidated capture ends in an error of its own


def _capture_error(err):
    """A CUDA or cuBLAS refusal while capturing, explained; other errors as they are."""
    import cupy
    refusals = (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError,
                NotImplementedError)
    # (CuPy refuses copies while capturing with a plain RuntimeError: "... is capturing")
    if not (isinstance(err, refusals) or "captur" in str(err)):
        return err
    return RuntimeError(
        f"make_graphed_step: the step could not be captured in a CUDA graph "
        f"({type(err).__name__}: {err}).{_reference_note(err)} A captured step may not read "
        "a GPU value on the host (float(x), x.get(), x.item(), printing it), copy host data "
        "to the GPU, or call a library that refuses capture; move that work out of the step, "
        "or run it eagerly")


def _reference_note(err):
    """Where the refusal came from a reference implementation (an op whose CUDA kernels do
    not take these inputs, run on CuPy: its cuBLAS matmul is refused), the op's name."""
    import traceback
    for frame in traceback.extract_tb(err.__traceback__):  # (the outermost: the op's own)
        parts = frame.filename.replace("\\", "/").split("/")
        if len(parts) > 2 and parts[-3:-1] == ["tecupy", "reference"]:
            return (f" It came from the reference implementation "
                    f"{parts[-1][:-3]}.{frame.name}: no CUDA kernel takes its inputs (their "
                    "shape, dtype or layout), so it ran on CuPy.")
    return ""


def _check_outputs(out, where):
    if out is None or is_cupy(out):
        return
    if isinstance(out, (tuple, list)):
        for n, o in enumerate(out):
            _check_outputs(o, f"{where}[{n}]")
    elif isinstance(out, dict):
        for k, o in out.items():
            _check_outputs(o, f"{where}[{k!r}]")
    else:
        raise TypeError(f"make_graphed_step: the step's {where} must be a cupy array, None, "
                        f"or a tuple, list or dict of them (a replay overwrites arrays in "
                        f"place), got {type(out).__name__}")

"""Memory of one training step on the GPU (issue 22): the CuPy pool's peak above what was
allocated before the step (parameters, inputs), exact: CuPy's allocator is wrapped so that
the pool's used bytes are read after every allocation (they only grow there); and what the
tape keeps for the backward at the end of the forward, by op (what the backward closures
keep, and the inputs and outputs alive only because the tape holds them)."""
from tecupy.tape_memory import saved_bytes

GIB, MIB = 2.0 ** 30, 2.0 ** 20
# what the rows of a step with the optimizer in the backward count, and their yardstick
OPT_ABOVE = "parameters, AdamW state (float32 masters and moments) and inputs"
OPT_PEER = "PyTorch bf16's plain step, gradients included, no optimizer"


def step_memory(layer, x, dy, recipe, checkpointed=False, optimizer=None):
    """(peak bytes above the start, {op: bytes kept for its backward}, bytes held by the
    tape) of one forward + backward of `layer` under `recipe` (None: high precision),
    through tecupy.checkpoint when `checkpointed` (activation recompute). The backward
    makes the gradients of the parameters and of x; with `optimizer` (built on the layer's
    parameters), its step in the backward instead (Optimizer.step_in_backward: each
    parameter's gradient applied and freed as it comes; no gradient of x): the start then
    counts the optimizer's state (master copies, moments) too, allocated before."""
    # (the optimizer's rows: print_report(..., above=OPT_ABOVE, peer=OPT_PEER))
    import cupy
    import tecupy
    pool = cupy.get_default_memory_pool()
    cupy.cuda.Device().synchronize()
    start = pool.used_bytes()
    peak = [start]

    def malloc(size):
        mem = pool.malloc(size)
        peak[0] = max(peak[0], pool.used_bytes())
        return mem
    cupy.cuda.set_allocator(malloc)
    try:
        with tecupy.Tape() as tape:
            with tecupy.fp8_autocast(enabled=recipe is not None, fp8_recipe=recipe):
                y = tecupy.checkpoint(layer, x) if checkpointed else layer(x)
        rows, held = saved_bytes(tape, {id(p) for p in layer.parameters()})
        if optimizer is None:
            tape.gradient(y, dict(layer.named_parameters(), x=x), output_grad=dy)
        else:
            optimizer.step_in_backward(tape, y, output_grad=dy)
    finally:
        cupy.cuda.set_allocator(pool.malloc)
    by_op = {}
    for op, size in rows:
        by_op[op] = by_op.get(op, 0) + size
    return peak[0] - start, by_op, held


def torch_step_peak(layer, x, dy):
    """PyTorch's peak above what was allocated before one forward + backward (its caching
    allocator's exact count), the gradients included."""
    import torch
    for p in (*layer.parameters(), x):
        p.grad = None
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    layer(x).backward(dy)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def print_report(name, peak, by_op, held, ref=None, above="parameters and inputs",
                 peer="PyTorch bf16"):
    """ref: PyTorch bf16's peak, for the ratio (peer names it); above: what the start
    held."""
    ratio = f" ({peak / ref:.2f}x {peer})" if ref else ""
    print(f"  {name}: peak {peak / GIB:.2f} GiB above {above}{ratio}; kept for "
          f"the backward {sum(by_op.values()) / GIB:.2f} GiB, of which the tape alone holds "
          f"{held / GIB:.2f} GiB")
    for op, size in sorted(by_op.items(), key=lambda kv: -kv[1]):
        if size:
            print(f"    {op:28s} {size / MIB:9.1f} MiB")

"""Tensor parallelism: collectives the tape differentiates, and the parallel linears.

Megatron-LM's conjugate pairs, each forward's collective mirrored by its backward's:

    copy_to_tp       identity         | all-reduce    (f: before a column-parallel linear)
    reduce_from_tp   all-reduce       | identity      (g: after a row-parallel linear)
    scatter_to_tp    split, own chunk | all-gather
    gather_from_tp   all-gather       | split, own chunk
    gather_sequence  all-gather       | reduce-scatter  (sequence parallel, around norms)
    reduce_scatter_sequence  reduce-scatter | all-gather

Every rank runs the same ops in the same order, so the backward's collectives (run by each
rank's own tape, which is per thread) pair up across the ranks as the forward's did.
A column->row pair (y = row(act(column(x)))) costs one all-reduce forward, one backward.

Sequence parallel (Megatron-LM / Transformer Engine): activations outside the column->row
pair are this rank's chunk of the sequence (axis 0, [s/tp, b, h]); the column GEMM's input
is all-gathered (under FP8: its uint8 codes, fp8_gather.py), the row GEMM's output
reduce-scattered. Parameters that act on sequence chunks (norm weights, the row GEMM's
bias) get their gradients all-reduced (replicated_grad). Under FP8 delayed scaling with the
amaxes reduced over the group, LayerNormLinear and LayerNormMLP skip these compositions and
run as one node each, the collectives inside (fp8_blocks.py).

Comm-GEMM overlap (overlap.py; TECUPY_TP_OVERLAP, default on): under sequence parallel the
column GEMM's all-gather and dgrad reduce-scatter, and the row GEMM's reduce-scatter
(row_parallel_linear), are rings whose chunks' GEMMs run while the chunks travel.
reduce_row_output (a GEMM computed elsewhere) has no GEMM to overlap with and stays a plain
reduce-scatter; act_then_row_parallel is LayerNormMLP's activation + fc2 + reduction with
the ring.
"""
from .._array import xp_of
from ..ops import add, add_bias, linear
from ..tape import record
from . import overlap
from .fp8_gather import SequenceReduce, gather_sequence_linear, linear_reduce_scatter
from .group import ProcessGroup
from .ring_linear import ring_act_row_linear, ring_row_linear, row_ring_ok

SEQUENCE_AXIS = 0  # sequence parallel splits [s, b, h] activations along s (TE: sbhd)


def _check_group(op, group):
    if not isinstance(group, ProcessGroup):
        raise TypeError(f"{op}: group must be a tecupy.distributed ProcessGroup; got "
                        f"{type(group).__name__}")


def shard(a, group, axis=0):
    """This rank's contiguous chunk of `a` along `axis` (not recorded: for parameters and
    inputs). a.shape[axis] must be a multiple of the group's size."""
    _check_group("shard", group)
    axis = axis % a.ndim
    if a.shape[axis] % group.size:
        raise ValueError(f"shard: axis {axis} of shape {tuple(a.shape)} does not split into "
                         f"{group.size} equal parts")
    return _chunk(a, axis, group.rank, group.size)


def shard_parts(a, group, parts, axis=0):
    """shard() of each of consecutive parts of `a` along `axis` (sizes `parts`, summing to
    a.shape[axis]), this rank's chunks concatenated: the rows of a fused weight whose parts
    split separately ([q | k | v] heads, a gated activation's [value | gate] halves)."""
    _check_group("shard_parts", group)
    axis = axis % a.ndim
    starts = [sum(parts[:i]) for i in range(len(parts))]
    index = (slice(None),) * axis
    chunks = [shard(a[index + (slice(s, s + n),)], group, axis)
              for s, n in zip(starts, parts)]
    return xp_of(a).concatenate(chunks, axis=axis)


def rank_seed(seed, rank):
    """A dropout seed of this rank's own from the module's seed: rank 0 keeps it (one rank
    is the single device), rank r adds r * 0x9E3779B97F4A7C15 (mod 2**63), so each rank's
    masks over its own activations are reproducible from (seed, rank)."""
    return (int(seed) + int(rank) * 0x9E3779B97F4A7C15) % 2**63


def replicated_grad(p, group):
    """p itself forward; its gradient all-reduced over the group (None stays None): a
    parameter that each rank applies to its own sequence chunk (copy_to_tp)."""
    return None if p is None else copy_to_tp(p, group)


def _chunk(a, axis, rank, size):
    n = a.shape[axis] // size
    index = (slice(None),) * axis + (slice(rank * n, (rank + 1) * n),)
    return a[index].copy()  # (contiguous: the GEMMs and collectives want it)


def copy_to_tp(x, group):
    """Identity forward; the gradient is all-reduced (summed) over the group."""
    _check_group("copy_to_tp", group)
    y = x.view()  # a new array for the tape, sharing x's memory

    def backward(dy):
        return (group.all_reduce(dy.copy()),)
    record(backward, (x,), (y,))
    return y


def reduce_from_tp(x, group):
    """x summed over the group (a new array); the gradient passes through."""
    _check_group("reduce_from_tp", group)
    y = group.all_reduce(x.copy())
    record(lambda dy: (dy,), (x,), (y,))
    return y


def scatter_to_tp(x, group, axis=-1):
    """This rank's chunk of x along `axis`; the gradient is all-gathered."""
    _check_group("scatter_to_tp", group)
    axis = axis % x.ndim
    y = shard(x, group, axis)
    record(lambda dy: (group.all_gather(dy, axis),), (x,), (y,))
    return y


def gather_from_tp(x, group, axis=-1):
    """The ranks' x concatenated along `axis`; the gradient's own chunk flows back."""
    _check_group("gather_from_tp", group)
    axis = axis % x.ndim
    y = group.all_gather(x, axis)
    record(lambda dy: (_chunk(dy, axis, group.rank, group.size),), (x,), (y,))
    return y


def gather_sequence(x, group, axis=0):
    """Sequence parallel: all-gather along the sequence axis; the gradient is
    reduce-scattered (each rank's partial gradient of the full sequence is summed)."""
    _check_group("gather_sequence", group)
    axis = axis % x.ndim
    y = group.all_gather(x, axis)
    record(lambda dy: (group.reduce_scatter(dy, axis),), (x,), (y,))
    return y


def reduce_scatter_sequence(x, group, axis=0):
    """Sequence parallel: reduce-scatter along the sequence axis; the gradient is
    all-gathered."""
    _check_group("reduce_scatter_sequence", group)
    axis = axis % x.ndim
    y = group.reduce_scatter(x, axis)
    record(lambda dy: (group.all_gather(dy, axis),), (x,), (y,))
    return y


def column_parallel_linear(x, weight, bias, group, gather_output=False, fp8_state=None,
                           gemm_index=0, sequence_parallel=False):
    """linear with weight [out/tp, in] and bias [out/tp] (this rank's rows of the full
    ones): -> this rank's [..., out/tp] of y, or all of y [..., out] with gather_output.
    x (replicated) gets its gradient all-reduced in backward; with sequence_parallel, x is
    this rank's sequence chunk [s/tp, ...], all-gathered first (its gradient
    reduce-scattered), as FP8 codes under fp8_autocast."""
    _check_group("column_parallel_linear", group)
    if sequence_parallel:
        y = gather_sequence_linear(x, weight, bias, group, fp8_state, gemm_index)
    else:
        y = linear(copy_to_tp(x, group), weight, bias, fp8_state, gemm_index)
    return gather_from_tp(y, group) if gather_output else y


def row_parallel_linear(x, weight, bias, group, input_is_parallel=True, fp8_state=None,
                        gemm_index=0, sequence_parallel=False, residual=None):
    """linear with weight [out, in/tp] (this rank's columns of the full one) and bias [out]
    (replicated, added once after the reduction): x is this rank's [..., in/tp] (or the
    full [..., in], split here, with input_is_parallel=False); -> y [..., out], summed
    over the group in forward. With sequence_parallel, y is reduce-scattered to this
    rank's sequence chunk [s/tp, ...] instead, and the bias's gradient all-reduced.
    residual: None or an array of y's shape added after the bias (in the bias's pass)."""
    _check_group("row_parallel_linear", group)
    if not input_is_parallel:
        x = scatter_to_tp(x, group)
    if sequence_parallel and row_ring_ok(x, group) and overlap.enabled(group, x):
        y = ring_row_linear(x, weight, group, fp8_state, gemm_index)  # (overlap.py)
        return bias_residual(y, replicated_grad(bias, group), residual)
    if sequence_parallel:  # (under FP8 dy comes back as gathered FP8 codes: fp8_gather.py)
        return linear_reduce_scatter(x, weight, group, fp8_state, gemm_index, bias, residual)
    return reduce_row_output(linear(x, weight, None, fp8_state, gemm_index), bias, group,
                             sequence_parallel, residual)


def act_then_row_parallel(xp, h, fc1_bias, activation, fc2_weight, fc2_bias, group,
                          fp8_state=None, sequence_parallel=False, residual=None):
    """LayerNormMLP's second half under tensor parallel: fc2(act(h + fc1_bias)) with fc2
    row parallel (GEMM 1 of fp8_state), summed over the group (reduce_row_output: the bias
    added once, after). Under sequence parallel with the comm-GEMM overlap the
    reduce-scatter is a ring whose steps' fc2 GEMMs run while the sums travel
    (ring_linear.ring_act_row_linear); else ops.blocks._act_then_linear and the
    collective."""
    _check_group("act_then_row_parallel", group)
    if sequence_parallel and row_ring_ok(h, group) and overlap.enabled(group, h):
        y = ring_act_row_linear(xp, h, fc1_bias, activation, fc2_weight, group, fp8_state)
        return bias_residual(y, replicated_grad(fc2_bias, group), residual)
    from ..ops.blocks import _act_then_linear
    if sequence_parallel:  # one FP8 node with the reduce-scatter (fp8_gather.py), or None
        y = _act_then_linear(xp, h, fc1_bias, activation, fc2_weight, None, fp8_state,
                             comm=SequenceReduce(group, fp8_state))
        if y is not None:
            return bias_residual(y, replicated_grad(fc2_bias, group), residual)
    y = _act_then_linear(xp, h, fc1_bias, activation, fc2_weight, None, fp8_state)
    return reduce_row_output(y, fc2_bias, group, sequence_parallel, residual)


def reduce_row_output(y, bias, group, sequence_parallel=False, residual=None):
    """A row-parallel GEMM's partial output y [s, ..., out] summed over the group: all of it
    (all-reduce), or this rank's sequence chunk (reduce-scatter, the bias's gradient then
    all-reduced) under sequence parallel; the bias added once, after (and the residual,
    where given, in the same pass)."""
    if sequence_parallel:
        y = reduce_scatter_sequence(y, group, SEQUENCE_AXIS)
        bias = replicated_grad(bias, group)
    else:
        y = reduce_from_tp(y, group)
    return bias_residual(y, bias, residual)


def bias_residual(y, bias, residual):
    """y + bias (a row, or None) + residual (y's shape, or None): one op for both (add_bias:
    one pass on the GPU, the bits of two adds)."""
    if bias is None:
        return y if residual is None else add(y, residual)
    return add_bias(y, bias, residual)

"""Comm-GEMM overlap for sequence parallel: Transformer Engine's userbuffers ring exchange,
over NCCL send/recv (ProcessGroup.shift) on a side stream.

All-gather + column GEMM (ring_gather): the gathered input [tp * m, k] is the ranks' row
chunks in rank order. At step j (0..tp-1) rank r holds chunk c = (r - j) mod tp: the main
stream runs the GEMM of that chunk (its output rows c * m .. (c + 1) * m, contiguous)
while the side stream sends the chunk to rank r + 1 and receives chunk c - 1 from rank
r - 1 into its slice of the gathered buffer (which the backward's wgrad still reads). The
main stream waits for that receive (an event) before the next GEMM. Same bytes as the
all-gather, the same GEMM per row: bit-identical to all-gather then one GEMM wherever the
GEMM's rows do not depend on M (the FP8 kernel and cuBLAS pick their tiles per shape; a
row's sums do not change with them on the kernels measured, and the GPU tests check it).

Row GEMM + reduce-scatter (ring_reduce_scatter): the partial output of chunk c travels
c + 1 -> c + 2 -> ... -> c around the ring. At step j rank r computes its partial of chunk
c = (r - j - 1) mod tp, adds the running sum received from r - 1 (its own partial first,
then the received sum: p_r + s) and sends it on; at the last step c = r, its own chunk,
complete. The GEMM of step j + 1 runs while step j's sum travels. Order of the sums: for
chunk c, ((p_{c+1} + p_{c+2}) + ...) + p_c, with tp = 2 the one sum p_{c+1} + p_c, which
IEEE addition gives bit for bit as NCCL's reduce-scatter and the ThreadGroup reference
(rank order) do; with tp >= 3 it is another order than theirs (a rounding of the output
dtype per step, as NCCL's ring has too): equal within the dtype's tolerance, not bit for bit.

On a ThreadGroup (CPU, no streams) the same steps run one after another, so CI checks the
ring's indices and sums. A group without shift() (the fake NCCL of the tests), or
OVERLAP off, runs the plain collectives.

Switch: TECUPY_TP_OVERLAP=1 at import, or overlap.OVERLAP = True at run time (the
bench's A/B). Default off: on 4 H100s it made the quickstart layer's step slower, not
faster (TP=2 FP8 7.61 -> 7.89 ms, TP=4 FP8 6.38 -> 9.85, HP 6.16 -> 8.02; PERFLOG.md,
session 16): NCCL's send/recv kernels only run around the persistent FP8 GEMM, which holds
every SM, and each ring step adds a launch and an event wait. TECUPY_TP_OVERLAP_DY=0 /
OVERLAP_DY = False keeps the row GEMMs' backward on the plain all-gather of dy
(ring_linear.py) with the rest overlapped.

Bulk overlap (BULK, on by default; fp8_gather.bulk_grads): without the rings, the FP8
sequence-parallel column GEMM's backward runs dgrad first and reduce-scatters it on the
side stream while wgrad runs on the main one, its persistent GEMM launched on SM_MARGIN
fewer SMs (kernels/launch.sm_margin) so that NCCL's kernels find free SMs: the same GEMMs
and collective as the plain order, bit for bit. Graphed quickstart layer on H100s (PERFLOG.md
session 20): TP=2 FP8 6.85-7.00 -> 6.74 ms, TP=4 4.24-4.26 -> 4.13-4.20; margins 16-32 alike,
8 and 0 less. The rings' GEMMs leave SM_MARGIN SMs too while an exchange is in flight.

The side stream must not free what the main stream reuses: every array a step sends or
receives stays referenced until the main stream has waited for the last exchange.
"""
import os

from .._array import is_cupy, xp_of

OVERLAP = os.environ.get("TECUPY_TP_OVERLAP", "0").strip() not in ("", "0")
# the row GEMMs' backward: dy gathered by a ring with dgrad's chunks (ring_linear.py); only
# where OVERLAP put the row GEMM on its ring path
OVERLAP_DY = os.environ.get("TECUPY_TP_OVERLAP_DY", "1").strip() not in ("", "0")
# Bulk overlap (Transformer Engine's ub_bulk_dgrad idea, on NCCL): the backward of the
# sequence-parallel column GEMM runs dgrad first, reduce-scatters it on the side stream and
# runs wgrad meanwhile (its GEMM leaving SM_MARGIN SMs to NCCL); on the plain path (rings
# off) of an NcclGroup. TECUPY_TP_BULK=0 / BULK = False: wgrad, dgrad, then the collective.
BULK = os.environ.get("TECUPY_TP_BULK", "1").strip() not in ("", "0")
# SMs the FP8 GEMMs leave free while an exchange is in flight (kernels/launch.sm_margin):
# NCCL's send/recv kernels need SMs, and the persistent GEMM otherwise holds every one.
SM_MARGIN = int(os.environ.get("TECUPY_TP_SM_MARGIN", "16"))
_side_streams = {}  # device id -> the non-blocking side stream of the exchanges


def _margin(in_flight):
    """sm_margin(SM_MARGIN) while an exchange is in flight, else no margin."""
    from ..kernels.launch import sm_margin
    return sm_margin(SM_MARGIN if in_flight else 0)


def bulk(group, *arrays):
    """Whether the bulk-overlapped backward runs for these arrays on this group."""
    return BULK and group.size > 1 and _nccl(group) and all(
        is_cupy(a) for a in arrays if a is not None)


def enabled(group, *arrays):
    """Whether the overlapped path runs for these arrays on this group."""
    if not OVERLAP or group.size < 2 or not group.can_shift:
        return False
    gpu = _nccl(group)
    return all(is_cupy(a) == gpu for a in arrays if a is not None)


def _nccl(group):
    from .nccl import NcclGroup
    return isinstance(group, NcclGroup)


class _Side:
    """The exchanges' stream: on an NcclGroup a side stream ordered against the current
    (main) one by events; elsewhere (threads on NumPy) nothing: steps run in order."""

    def __init__(self, group):
        self.group, self.stream, self.keep = group, None, []
        if _nccl(group):
            import cupy
            dev = cupy.cuda.runtime.getDevice()
            s = _side_streams.get(dev)
            if s is None:
                s = _side_streams[dev] = cupy.cuda.Stream(non_blocking=True)
            self.stream, self.main = s, cupy.cuda.get_current_stream()

    def shift(self, x, out, after_main=True):
        """x to rank + 1, rank - 1's into out, after the main stream's work so far (or
        only after the side stream's own, after_main False); -> the event the main stream
        waits for before it reads out (None on the host)."""
        self.keep += (x, out)
        if self.stream is None:
            self.group.shift(x, out)
            return None
        if after_main:
            self.stream.wait_event(self.main.record())
        with self.stream:
            self.group.shift(x, out)
            return self.stream.record()

    def collective(self, fn, *args):
        """fn(*args) (a collective) on the side stream after the main stream's work so far
        -> (its result, the event the main stream waits for before reading it; None on the
        host, where fn ran in order). args (what fn reads) are held until then."""
        self.keep += args
        if self.stream is None:
            return fn(*args), None
        self.stream.wait_event(self.main.record())
        with self.stream:
            out = fn(*args)
            self.keep.append(out)
            return out, self.stream.record()

    def wait(self, event):
        if event is not None:
            self.main.wait_event(event)


def ring_gather(group, local, gemm):
    """The all-gather of `local` [m, ...] along axis 0 (-> [size * m, ...], rank order,
    a new array) with gemm(c, chunk c of it) called for every chunk c, each while the next
    chunk is on its way (module doc). gemm's own results are its business (it writes its
    output rows); the chunks passed are views of the returned array."""
    xp, n, r = xp_of(local), group.size, group.rank
    m = local.shape[0]
    full = xp.empty((n * m,) + tuple(local.shape[1:]), local.dtype)
    chunk = [full[c * m:(c + 1) * m] for c in range(n)]
    chunk[r][...] = local
    side = _Side(group)
    for j in range(n):
        c = (r - j) % n
        # (after step 0 the exchanges need only each other: back to back on the side)
        event = side.shift(chunk[c], chunk[(c - 1) % n], j == 0) if j < n - 1 else None
        with _margin(event is not None):
            gemm(c, chunk[c])
        side.wait(event)
    side.keep.clear()  # (the main stream has waited for every exchange)
    return full


def ring_reduce_scatter(group, partial):
    """This rank's chunk of the sum over the ranks of [size * m, ...] outputs whose row
    chunk c each rank computes as partial(c) (a new [m, ...] array), each GEMM while the
    previous step's sum travels (module doc) -> [m, ...]."""
    n, r = group.size, group.rank
    side = _Side(group)
    acc = event = recv = None
    for j in range(n):
        with _margin(j > 0):  # (step j - 1's sum travels)
            p = partial((r - j - 1) % n)
        if j:
            side.wait(event)
            p += recv  # own partial + the sum received (set at step j - 1)
        acc = p
        if j < n - 1:
            recv = xp_of(p).empty_like(p)
            event = side.shift(acc, recv)
    side.keep.clear()
    return acc

"""Per-warp rings of rows (WarpRing, cuda/bulk.cuh): how many warps share a row, how many
slots fit in shared memory, and the launch of a ring kernel (its slots, grid and row
counters)."""
import numpy as np

from .launch import balanced_grid, launch, opt_in_smem, resident_blocks, sm_count
from .pools import ring_counters

# Per-warp rings of rows (WarpRing in cuda/bulk.cuh), in groups of G warps per row (each
# streams its portion of the row, at most RING_WARP_BYTES: the best for the norm and
# the softmax on an H200; the norm with an FP8 output takes 4096), blocks of min(16, warps per
# SM) warps: per SM the rings (and `extra` bytes per block) take at most RING_SMEM bytes,
# with the most warps (of RING_WARPS per SM) that still get 2+ slots each, at most
# RING_MAX_SLOTS or the caller's max_slots. Fewer than 8 warps per SM leave too few rows in
# flight. ring_launch also caps the slots at a third of the rows each group streams (at
# least 2): the first fills are one burst of reads before any output is written, and past
# a third of the tensor that burst measured slower (H200, rows of 4 KB: +3-6 points of copy
# with 2 slots instead of 3; PERFLOG.md).
RING_SMEM = 220 << 10
RING_WARPS = (32, 16, 8)
RING_MAX_SLOTS = 8
RING_GROUPS = (1, 2, 4)
RING_WARP_BYTES = 2048


def ring_group(row_bytes, warp_bytes=RING_WARP_BYTES):
    """Warps per row (G) for rows of `row_bytes`: the fewest that give each warp at most
    `warp_bytes` of the row."""
    return next((g for g in RING_GROUPS if row_bytes <= g * warp_bytes), RING_GROUPS[-1])


def ring_portion(chunks, group, align=1):
    """Chunks of the largest portion of a row of `chunks` split over `group` warps (the
    kernels' Portion): ceil(chunks / group), rounded up to a multiple of `align`."""
    per = -(-chunks // group)
    return -(-per // align) * align


def ring_plan(slot_bytes, extra=0, max_slots=RING_MAX_SLOTS):
    """(warps per block, blocks per SM, slots per warp, dynamic shared bytes per block) for
    per-warp rings of slots of `slot_bytes`, `extra` bytes after the rings, or None when 2
    slots do not fit."""
    for warps in RING_WARPS:
        per_block = min(16, warps)
        blocks = warps // per_block
        slots = min(max_slots, RING_MAX_SLOTS,
                    (RING_SMEM // blocks - extra - 1024) // (per_block * slot_bytes))
        if slots >= 2:
            rings = ((16 * per_block * slots + 127) & ~127) + per_block * slots * slot_bytes
            return per_block, blocks, slots, rings + extra
    return None


def ring_settings():
    """The settings above and below that ring_plan and ring_launch read (for the callers'
    caches of launch plans)."""
    return RING_SMEM, RING_WARPS, RING_MAX_SLOTS, RING_GROUPS, RING_DYNAMIC_ROWS


# Rows handed out by counters (RowTaker, bulk.cuh) where each ring group streams at least
# RING_DYNAMIC_ROWS rows; below, the fixed split. H200, same run, fixed -> counters, % of
# copy, bf16 out: 12288 x 4096 (12 rows per group) LN 80.1 -> 86.0, RMS 81.5 -> 88.4,
# softmax 77.4 -> 85.1; 16384 x 4096 +9 to +10; 8192 x 4096 (8 rows) -1 / +1 / +0.5; 8192 x
# 2048 and 2048 x 4096 -2 to -18. LN with FP8 out -7 to -10 at every size (not understood;
# PERFLOG.md): the callers with FP8 outputs pass dynamic=False.
RING_DYNAMIC_ROWS = 12


def ring_launch(k, rows, slot_bytes, extra=0, group=1, max_slots=RING_MAX_SLOTS,
                dynamic=True):
    """(launch(grid, block, args, shared_mem) appending the row counters (null for the
    fixed split) and the slot count (its attributes kernel, counted and slots say which),
    grid, threads, shared bytes) for a kernel `k` (loader
    function) whose groups of `group` warps stream rows through WarpRings, or None (see
    ring_plan). `dynamic`: the kernel may take rows from counters (RING_DYNAMIC_ROWS)."""
    plan = ring_plan(slot_bytes, extra, max_slots)
    if plan is None:
        return None
    warps, per_sm, slots, _ = plan
    rows_per_group = -(-rows // (sm_count() * per_sm * (warps // group)))
    cap = max(2, -(-rows_per_group // 3))
    if slots > cap:
        plan = ring_plan(slot_bytes, extra, cap)  # same warps, fewer slots
    warps, per_sm, slots, smem = plan
    opt_in_smem(k, smem)
    per_sm = min(per_sm, resident_blocks(k, 32 * warps, smem))

    counted = dynamic and rows_per_group >= RING_DYNAMIC_ROWS

    def run(grid, block, args, shared_mem):  # (the ring kernels begin with PDL_WAIT)
        counters = ring_counters() if counted else np.uint64(0)
        launch(k, grid, block, args + (counters, np.int32(slots)), shared_mem)
    run.kernel, run.counted, run.slots = k, counted, slots  # (for a caller's launch plan)
    return run, balanced_grid(-(-rows // (warps // group)), per_sm), 32 * warps, smem

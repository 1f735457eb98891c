"""CUDA statistics of one FP8 cast for FP8Inspector (tecupy/inspect.py): cuda/inspect.cu.
One pass over x and its codes (or the codes alone) adds into row `row` of the step's int64
accumulator acc [records, 8] on the device; nothing is read back here (no host sync)."""
import numpy as np

from .. import backends, loader
from .dtypes import CTYPE, FP8TYPE, LOW_PRECISION, on_gpu, on_gpu_low_precision
from .launch import grid_1d, launch, resident_blocks

FILE = "inspect.cu"
_VECS = {"float": 4, "__half": 8, "__nv_bfloat16": 8}  # 16-byte loads of x
THREADS = 256  # per block; the grid: as many blocks as are resident at once (inspect_cast:
# 38 registers for sm_90a, 6 blocks per SM, ~800 on an H100), each ending in 7 atomics
# the magnitude code of each format's max (0x7E: 448 in E4M3, 0x7B: 57344 in E5M2)
MAX_CODE = {"e4m3": 0x7E, "e5m2": 0x7B}
loader.declare(FILE, [f"{k}<{CTYPE[d]}, {f}, {v}>" for k in ("inspect_cast", "inspect_block_cast")
                      for d in LOW_PRECISION for f in FP8TYPE.values()
                      for v in (1, _VECS[CTYPE[d]])]
               + ["inspect_codes<1>", "inspect_codes<16>"])


def _contiguous(a):
    import cupy
    return a if a.flags.c_contiguous else cupy.ascontiguousarray(a)


@backends.register("inspect_cast", "cuda", supports=on_gpu_low_precision)
def inspect_cast(x, codes, fmt, scale, scale_inv, acc, row, stride):
    """Add the statistics of the cast of x (float32 / half / bf16) into `codes` (uint8, x's
    size and element order) with `scale` and `scale_inv` (float32 (1,)) into acc[row]
    (int64 [records, 8], see cuda/inspect.cu); the round-trip sums over the elements
    i % stride == 0."""
    x, codes = _contiguous(x), _contiguous(codes)
    if codes.size != x.size:
        raise ValueError(f"inspect_cast: {codes.size} codes for {x.size} values")
    t = CTYPE[x.dtype]
    v = _VECS[t]
    if x.data.ptr % 16 or codes.data.ptr % v:
        v = 1
    k = loader.function(FILE, f"inspect_cast<{t}, {FP8TYPE[fmt.name]}, {v}>")
    n = x.size
    launch(k, (grid_1d(n, v, THREADS, resident_blocks(k, THREADS, 0)),), (THREADS,),
           (x, codes, scale, scale_inv, acc, np.int32(row), np.int64(n),
            np.int64(max(1, stride))))


@backends.register("inspect_block_cast", "cuda", supports=on_gpu_low_precision)
def inspect_block_cast(x, codes, fmt, scale_inv, acc, row, stride):
    """inspect_cast of a block cast (Float8BlockScaling; the reference's docstring): x
    [rows, cols] and its row-wise codes, scale_inv in its 1x128 or 128x128 layout (read in
    place through its strides); one pass over x and codes, plus a max over scale_inv for
    word 1 (the smallest block scale)."""
    from ..reference.block_scaling import block_dim_of
    if codes.shape != x.shape or x.ndim != 2:
        raise ValueError(f"inspect_block_cast: codes {codes.shape} for x {x.shape} (2-D)")
    x, codes = _contiguous(x), _contiguous(codes)
    cols = x.shape[1]
    r_stride, b_stride = (s // 4 for s in scale_inv.strides)
    if block_dim_of(x.shape, scale_inv.shape, "inspect_block_cast") == 1:  # [cols/128, rows]
        rdiv, r_stride, b_stride = 1, b_stride, r_stride
    else:                                                                # [rows/128, cols/128]
        rdiv = 128
    acc[row, 1:2] = (1.0 / scale_inv.max().astype(np.float64)).reshape(1).view(np.int64) \
        if scale_inv.size else np.array([np.nan]).view(np.int64)
    t = CTYPE[x.dtype]
    v = _VECS[t]
    if x.data.ptr % 16 or codes.data.ptr % v or cols % v:  # (a chunk in one row and block)
        v = 1
    k = loader.function(FILE, f"inspect_block_cast<{t}, {FP8TYPE[fmt.name]}, {v}>")
    n = x.size
    launch(k, (grid_1d(n, v, THREADS, resident_blocks(k, THREADS, 0)),), (THREADS,),
           (x, codes, scale_inv, np.int64(cols), np.int64(rdiv), np.int64(r_stride),
            np.int64(b_stride), acc, np.int32(row), np.int64(n), np.int64(max(1, stride))))


@backends.register("inspect_codes", "cuda", supports=on_gpu)
def inspect_codes(codes, fmt, scale, amax, acc, row):
    """A producer-fused cast from its codes alone into acc[row]: amax (float32 (1,), the
    slot the producer maxed into; None: NaN), the scale, the non-NaN, +-0 and +-max codes."""
    codes = _contiguous(codes)
    v = 1 if codes.data.ptr % 16 else 16
    k = loader.function(FILE, f"inspect_codes<{v}>")
    n = codes.size
    launch(k, (grid_1d(n, v, THREADS, resident_blocks(k, THREADS, 0)),), (THREADS,),
           (codes, scale, np.uint64(0) if amax is None else amax, acc, np.int32(row),
            np.int64(n), np.int32(MAX_CODE[fmt.name])))

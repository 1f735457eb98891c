"""tecupy.gemm.tune(m, n, k, ...): pick the FP8 GEMM configuration for a shape by timing the
candidates on this GPU; the winner is remembered on disk (TECUPY_CACHE_DIR) and used by
every later FP8 GEMM of that shape. Without tuning, a fixed default per accumulation mode
runs. Measuring lives here, not in kernels/ (launch wrappers only): the kernel module keeps
the candidates and the table it reads on each call."""
import numpy as np

from .kernels import fp8_gemm as _kernel
from .kernels.fp8_gemm import CANDIDATES, CONFIGS  # noqa: F401


def tune(m, n, k, a_fmt="e4m3", b_fmt="e4m3", split_accumulator=False, calls=10):
    """Time every candidate configuration on random operands of shape (M, N, K), remember the
    fastest in TECUPY_CACHE_DIR/fp8_gemm_tuned.json (used by every later call of that shape
    and format pair) and return {config: ms}."""
    import cupy
    from . import bfloat16
    from .bench.timing import gpu_time_ms  # (a leaf: it imports nothing of tecupy)
    from .fp8 import as_format
    fa, fb = as_format(a_fmt), as_format(b_fmt)
    rng = cupy.random.default_rng()
    a = rng.integers(0, 0x70, (m, k), dtype=np.uint8)  # finite codes of both formats
    b = rng.integers(0, 0x70, (n, k), dtype=np.uint8)
    one = cupy.ones(1, np.float32)
    times = {}
    for config in CANDIDATES[split_accumulator]:
        def call():
            return _kernel.launch(config, a, fa, one, b, fb, one, bfloat16, None)
        times[config] = gpu_time_ms(call, [()], calls=calls)
    best = min(times, key=times.get)
    _kernel.remember(m, n, k, fa.name, fb.name, split_accumulator, best)
    return times

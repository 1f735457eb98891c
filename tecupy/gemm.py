"""tecupy.gemm.tune(m, n, k, ...): pick the FP8 GEMM configuration for a shape by timing the
candidates on this GPU; the winner is remembered on disk (TECUPY_CACHE_DIR) and used by
every later FP8 GEMM of that shape. Without tuning, a fixed default per accumulation mode
runs."""
from .kernels.fp8_gemm import CANDIDATES, CONFIGS, tune  # noqa: F401

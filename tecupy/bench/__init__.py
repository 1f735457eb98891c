"""Benchmarks, not timed tests: `python -m tecupy.bench SUITE` (GPU only). One module per
suite, each with run(args): kernels (memory-bound kernels against copy bandwidth and
PyTorch), gemm (the FP8 GEMM against torch._scaled_mm), attention (fused attention against
PyTorch's SDPA backends), layer (the main job's layer step and its kernel time per kernel).
timing.py is the one timing helper, shared with tecupy.gemm.tune and the main job.

Nothing is imported here: `from tecupy.bench.timing import ...` stays light."""

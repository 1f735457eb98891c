"""CUDA implementations (the `cuda` backend): short wrappers that check, allocate and
launch kernels from cuda/*.cu compiled by the loader. Importing registers them."""
from . import (activation, attention, cast, dropout, fp8_gemm, gemm, norm, scaling,  # noqa: F401
               softmax, transpose)

"""CUDA implementations (the `cuda` backend): short wrappers that check, allocate and
launch kernels from cuda/*.cu compiled by the loader. Importing registers them."""
from . import (activation, attention, cast, colsum, dropout, fp8_gemm, gemm, norm,  # noqa: F401
               scaling, softmax, transpose)
from . import embedding, inspect, loss, rope  # noqa: F401
from . import block_scaling  # noqa: F401

"""CUDA implementations (the `cuda` backend): short wrappers that check, allocate and
launch kernels from cuda/*.cu compiled by the loader. Importing registers them."""
from . import activation, cast, dropout, gemm, norm, scaling, softmax  # noqa: F401

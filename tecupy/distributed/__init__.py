"""tecupy.distributed: process groups and tensor-parallel ops (issue 25; in progress).

ProcessGroup is the API every backend provides (rank, size, all_reduce, all_gather,
reduce_scatter, broadcast, barrier, split); ThreadGroup / run_threads is the reference
backend, N ranks as threads on NumPy, for CI. The NCCL backend is not written yet (see the
README's "Multi-GPU (in progress)"); nothing here imports CuPy or NCCL.
"""
from .env import DistConfig, EnvError, init_from_env  # noqa: F401
from .group import GroupAborted, ProcessGroup  # noqa: F401
from .tensor_parallel import (column_parallel_linear, copy_to_tp, gather_from_tp,  # noqa: F401
                              gather_sequence, reduce_from_tp, reduce_scatter_sequence,
                              row_parallel_linear, scatter_to_tp, shard)
from .threads import ThreadGroup, run_threads  # noqa: F401

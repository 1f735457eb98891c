"""tecupy.distributed: process groups, tensor-parallel ops, data parallel (issue 25).

ProcessGroup is the API every backend provides (rank, size, all_reduce, all_gather,
reduce_scatter, broadcast, barrier, split). NcclGroup runs it over cupy.cuda.nccl, one
process per GPU, made by init_process_group() from the launcher's variables (torchrun,
mpirun, srun, or `python -m tecupy.distributed.launch`) or by spawn(fn, nprocs);
ThreadGroup / run_threads is the reference backend, N ranks as threads on NumPy, for CI.
NCCL is loaded only when init_process_group makes an NcclGroup. Data parallel:
GradientReducer / all_reduce_gradients (gradients averaged in buckets, overlapped with the
backward) and ZeroOptimizer (ZeRO-1: the optimizer state sharded). The tensor-parallel modules
are tecupy.nn's, with tp_group / tp_size / sequence_parallel (README, Multi-GPU).
"""
from .data_parallel import (GradientReducer, ShardedGradients, all_reduce_gradients,  # noqa: F401
                            plan_buckets)
from .env import DistConfig, EnvError, init_from_env  # noqa: F401
from .group import GroupAborted, ProcessGroup  # noqa: F401
from .multiproc import RankFailed, spawn  # noqa: F401
from .nccl import NcclGroup  # noqa: F401
from .process import (InitTimeout, abort_process_group, destroy_process_group,  # noqa: F401
                      get_world_group, init_process_group)
from .store import Store, StoreServer, StoreTimeout  # noqa: F401
from .fp8_gather import gather_sequence_linear  # noqa: F401
from .tensor_parallel import (column_parallel_linear, copy_to_tp, gather_from_tp,  # noqa: F401
                              gather_sequence, rank_seed, reduce_from_tp,
                              reduce_scatter_sequence, replicated_grad, row_parallel_linear,
                              scatter_to_tp, shard, shard_parts)
from .threads import ThreadGroup, run_threads  # noqa: F401
from .zero import ZeroOptimizer  # noqa: F401

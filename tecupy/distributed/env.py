"""init_from_env: where this process sits in the job, from the variables its launcher set.

    torchrun          RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_ADDR, MASTER_PORT)
    mpirun (Open MPI) OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, OMPI_COMM_WORLD_LOCAL_RANK
    MPICH/Intel MPI   PMI_RANK, PMI_SIZE, MPI_LOCALRANKID (or PMI_LOCAL_RANK)
    srun (Slurm)      SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID

The first launcher whose rank variable is set wins, in that order (torchrun inside an srun
job spawns several ranks per Slurm task, so its own variables are the right ones).
MASTER_ADDR and MASTER_PORT (the TCP store that will exchange NCCL's unique id) are needed
whenever there is more than one rank, whatever the launcher: mpirun and srun do not set
them. The result is a plain DistConfig; nothing is initialised here.
"""
import dataclasses
import os

# (launcher, rank variable, size variable, local rank variables (the first set is used))
LAUNCHERS = (
    ("torchrun", "RANK", "WORLD_SIZE", ("LOCAL_RANK",)),
    ("openmpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
     ("OMPI_COMM_WORLD_LOCAL_RANK",)),
    ("pmi", "PMI_RANK", "PMI_SIZE", ("MPI_LOCALRANKID", "PMI_LOCAL_RANK")),
    ("slurm", "SLURM_PROCID", "SLURM_NTASKS", ("SLURM_LOCALID",)),
)
STORE_VARS = ("MASTER_ADDR", "MASTER_PORT")
# every variable init_from_env reads (tests clear them all)
ENV_VARS = tuple(v for _, r, s, loc in LAUNCHERS for v in (r, s, *loc)) + STORE_VARS


class EnvError(ValueError):
    """The launcher's variables are missing or malformed; the message names them."""


@dataclasses.dataclass(frozen=True)
class DistConfig:
    rank: int
    world_size: int
    local_rank: int  # the GPU of this host to use
    master_addr: str | None  # None for a single rank
    master_port: int | None
    launcher: str  # 'torchrun', 'openmpi', 'pmi' or 'slurm'


def init_from_env(env=None):
    """-> DistConfig from `env` (default os.environ); EnvError naming what is missing."""
    env = os.environ if env is None else env
    for launcher, rank_var, size_var, local_vars in LAUNCHERS:
        if rank_var in env:
            return _config(env, launcher, rank_var, size_var, local_vars)
    ranks = ", ".join(f"{r} ({name})" for name, r, _, _ in LAUNCHERS)
    raise EnvError(f"init_from_env: no launcher's rank variable is set (looked for {ranks}); "
                   "launch with torchrun, mpirun or srun, or set RANK, WORLD_SIZE, "
                   "LOCAL_RANK, MASTER_ADDR and MASTER_PORT")


def _config(env, launcher, rank_var, size_var, local_vars):
    if size_var not in env:
        raise EnvError(f"init_from_env: {rank_var} is set ({launcher}) but {size_var} is not")
    size = _int(env, size_var, 1)
    rank = _int(env, rank_var, 0, size - 1)
    local = [v for v in local_vars if v in env]
    if not local and size > 1:
        raise EnvError(f"init_from_env: {rank_var} and {size_var} are set ({launcher}) but "
                       f"not {' or '.join(local_vars)}, which picks this host's GPU")
    local_rank = _int(env, local[0], 0) if local else 0
    addr, port = _store(env, launcher, size)
    return DistConfig(rank, size, local_rank, addr, port, launcher)


def _store(env, launcher, size):
    if size == 1 and not any(v in env for v in STORE_VARS):
        return None, None
    missing = [v for v in STORE_VARS if not env.get(v)]
    if missing:
        hint = ("" if launcher == "torchrun" else f"; {launcher} does not set them: export "
                "MASTER_ADDR (the host of rank 0, e.g. under Slurm $(scontrol show hostnames "
                "$SLURM_JOB_NODELIST | head -n1)) and a free MASTER_PORT")
        raise EnvError(f"init_from_env: {' and '.join(missing)} not set (the TCP store "
                       f"that exchanges NCCL's unique id needs both){hint}")
    return env["MASTER_ADDR"], _int(env, "MASTER_PORT", 1, 65535)


def _int(env, var, low, high=None):
    text = env[var]
    try:
        v = int(text)
    except ValueError:
        v = None
    if v is None or v < low or (high is not None and v > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise EnvError(f"init_from_env: {var} must be an integer {span}; got {text!r}")
    return v

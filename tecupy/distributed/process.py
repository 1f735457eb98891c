"""init_process_group: this process's NcclGroup over the whole job, from its launcher.

    group = tecupy.distributed.init_process_group()   # torchrun / mpirun / srun / launch
    ...
    tecupy.distributed.destroy_process_group()        # or let the process end

Steps: init_from_env (env.py) says where this rank sits; it selects GPU LOCAL_RANK; rank 0
serves the TCP store (store.py) at MASTER_PORT; every rank checks in there, and a rank
missing after `timeout` seconds is named on every rank that came ("rank(s) [2] did not
arrive ..."); rank 0's NCCL unique id goes through the store; each rank then makes its
communicator. A watchdog thread per process follows the store's abort (nccl.py).

Once made, an uncaught exception in this process (sys.excepthook) aborts the job before
its traceback prints, so every other rank fails within seconds instead of hanging in
NCCL; a clean exit (atexit) closes the store, rank 0 last.
"""
import atexit
import sys

from .env import init_from_env
from .group import GroupAborted
from .nccl import CupyNccl, NcclGroup, _Job
from .store import Store, StoreServer, StoreTimeout

DEFAULT_TIMEOUT = 300.0
_world = None  # (group, job) of init_process_group, until destroy_process_group


class InitTimeout(TimeoutError):
    """Ranks did not reach the store in time; .missing lists them."""


def init_process_group(backend="nccl", timeout=DEFAULT_TIMEOUT, env=None, grace=2.0,
                       exit_on_abort=True):
    """-> NcclGroup of every rank of the job (also kept for get_world_group()).

    backend: "nccl" (cupy.cuda.nccl), or an api object with CupyNccl's methods (tests).
    timeout: seconds to wait for the store and for every rank to check in.
    grace: after another rank aborts the job, seconds this process gets to end by itself
    before its watchdog exits it (status 1) with the reason; exit_on_abort=False keeps it
    alive (its collectives raise GroupAborted)."""
    global _world
    if _world is not None:
        raise RuntimeError("init_process_group: already initialised in this process "
                           f"({_world[0]!r}); destroy_process_group() first")
    cfg = init_from_env(env)
    api = CupyNccl() if backend == "nccl" else backend
    device = api.set_device(cfg.local_rank)
    server, host, port = None, cfg.master_addr, cfg.master_port
    if cfg.world_size == 1 and host is None:
        host, port = "127.0.0.1", 0
    if cfg.rank == 0:
        server = StoreServer("127.0.0.1" if host == "127.0.0.1" else "0.0.0.0", port)
        port = server.port
    store = Store(host, port, cfg.rank, timeout)
    try:
        uid = _check_in(store, cfg, api, timeout)
        job = _Job(api, store, cfg.rank, cfg.world_size, device, server, grace, exit_on_abort)
    except BaseException:
        store.close()
        if server is not None:
            server.wait_clients_closed(timeout=5.0)  # (the others learn why first)
            server.close()
        raise
    try:
        comm = api.communicator(cfg.world_size, uid, cfg.rank)
    except BaseException as e:
        job.abort(f"rank {cfg.rank}: NCCL initialisation failed: {type(e).__name__}: {e}")
        job.close()
        raise
    job.comms.append(comm)
    group = NcclGroup(job, comm, cfg.rank, cfg.world_size, "g")
    _world = (group, job)
    _install_hooks()
    return group


_LATE = "init_process_group: rank(s) "  # how a check-in timeout's reason begins


def _check_in(store, cfg, api, timeout):
    """Every rank checks in; -> rank 0's NCCL unique id. InitTimeout names the absent."""
    n = cfg.world_size
    store.set(f"arrived/{cfg.rank}", "1")
    try:
        store.wait([f"arrived/{r}" for r in range(n)], timeout)
    except StoreTimeout as e:
        missing = sorted(int(k.split("/")[1]) for k in e.missing)
        came = [r for r in range(n) if r not in missing]
        reason = (f"{_LATE}{missing} of {n} did not arrive at the store "
                  f"{store.host}:{store.port} within {timeout:g} s (rank(s) {came} did)")
        err = InitTimeout(store.abort(reason))
        err.missing = missing
    except GroupAborted as e:  # another rank timed out (or raised) first
        err = InitTimeout(str(e))
    else:
        err = None
    if err is not None:
        # rank 0 keeps serving a while after a check-in timeout, its own or another rank's,
        # so that late ranks learn why (not after a crash: the crashed rank never comes)
        if cfg.rank == 0 and str(err).startswith(_LATE):
            _linger(store, n, timeout)
        raise err
    if cfg.rank == 0:
        store.set("uid", api.get_unique_id())
    try:
        return store.get("uid", timeout)
    except GroupAborted as e:  # (a late rank: everyone arrived, but too late)
        raise InitTimeout(str(e)) from None


def _linger(store, n, timeout):
    """Rank 0, after init failed: serve the store until every rank has checked in (each
    late one then reads the job's abort and raises InitTimeout, instead of finding no store),
    or min(max(timeout, 5), 30) seconds."""
    try:
        store.wait([f"arrived/{r}" for r in range(n)], min(max(timeout, 5.0), 30.0),
                   abortable=False)
    except StoreTimeout:
        pass


def get_world_group():
    """The group of init_process_group (None before it and after destroy)."""
    return None if _world is None else _world[0]


def destroy_process_group():
    """Destroy the communicators and close the store (rank 0 waits for the others)."""
    global _world
    if _world is None:
        return
    _, job = _world
    _world = None
    job.close()


def abort_process_group(reason):
    """Abort the job from this process: every rank's group raises GroupAborted(reason)
    and their processes exit within their grace. -> the reason that won (the first)."""
    if _world is None:
        return reason
    return _world[1].abort(reason)


_hooked = False


def _install_hooks():
    global _hooked
    if _hooked:
        return
    _hooked = True
    previous = sys.excepthook

    def excepthook(kind, value, tb):
        if _world is not None and not issubclass(kind, GroupAborted):
            job = _world[1]
            abort_process_group(f"rank {job.rank} raised {kind.__name__}: {value}")
        previous(kind, value, tb)
    sys.excepthook = excepthook
    atexit.register(destroy_process_group)

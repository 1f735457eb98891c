"""spawn(fn, nprocs, *args): fn(group, *args) on nprocs processes of this host, one per
GPU (multiprocessing 'spawn'), each with the variables torchrun sets (rank_env) and its
group from init_process_group; results in rank order. If a rank raises, the job aborts
(every other rank's collectives raise GroupAborted, or its watchdog ends it), ranks still
alive `grace` seconds later are killed, and the first rank's own exception is re-raised
here. `python -m tecupy.distributed.launch` (launch.py) does the same for scripts.
"""
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait

from .group import GroupAborted


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, local_rank, world_size, local_world_size, master_addr, master_port,
             node_rank=0):
    """The variables torchrun gives a rank (strings)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
            "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(node_rank),
            "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port)}


class RankFailed(RuntimeError):
    """A rank failed without an exception to re-raise (killed, or its error unpicklable)."""


def spawn(fn, nprocs, *args, backend="nccl", timeout=300.0, grace=10.0, abort_grace=2.0,
          env=None):
    """Run fn(group, *args) in nprocs processes (multiprocessing 'spawn'; fn and args must
    pickle), group = init_process_group(backend) of that rank; -> results in rank order.
    If a rank raises, the others abort; the first rank's own exception (not a
    GroupAborted, where there is one) is re-raised here with the other ranks' errors as
    notes. timeout: init_process_group's; abort_grace: its `grace` (how long a rank whose
    group another rank aborted may take to end before its watchdog exits it); grace: how
    long the parent waits for the other ranks once one failed, before killing them.
    env: extra variables for every rank."""
    if not (isinstance(nprocs, int) and nprocs >= 1):
        raise ValueError(f"spawn: nprocs must be an int >= 1; got {nprocs!r}")
    ctx = mp.get_context("spawn")
    base = dict(env or {})
    port = free_port()
    procs, conns = [], []
    for rank in range(nprocs):
        mine, theirs = ctx.Pipe(duplex=False)
        variables = {**base, **rank_env(rank, rank, nprocs, nprocs, "127.0.0.1", port)}
        p = ctx.Process(target=_child, name=f"tecupy-rank{rank}", daemon=False,
                        args=(fn, args, variables, backend, timeout, abort_grace, theirs))
        p.start()
        theirs.close()
        procs.append(p)
        conns.append(mine)
    results, errors = _collect(procs, conns, grace)
    _raise_first(errors)
    return [results[r] for r in range(nprocs)]


def _child(fn, args, variables, backend, timeout, abort_grace, conn):
    os.environ.update(variables)
    rank = int(variables["RANK"])
    from . import process
    try:
        group = process.init_process_group(backend, timeout=timeout, grace=abort_grace)
        result = fn(group, *args)
        conn.send(("ok", rank, _pickled(result)))
        process.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent, then exit 1
        if not isinstance(e, GroupAborted):
            process.abort_process_group(f"rank {rank} raised {type(e).__name__}: {e}")
        text = "".join(traceback.format_exception(e))
        try:
            conn.send(("error", rank, (_pickled(e), type(e).__name__, str(e), text)))
        except OSError:
            pass
        sys.exit(1)


def _pickled(obj):
    try:
        return pickle.dumps(obj)
    except Exception as e:  # noqa: BLE001
        return pickle.dumps(RankFailed(f"(result not picklable: {type(e).__name__}: {e})"))


def _collect(procs, conns, grace):
    """Wait for every rank: results, errors by rank. Once a rank has failed, ranks still
    running after `grace` seconds are killed (their error says so)."""
    results, errors, live = {}, {}, dict(enumerate(procs))
    open_conns = dict(enumerate(conns))
    failed_at = None
    while live or open_conns:
        ready = wait(list(open_conns.values()) + [p.sentinel for p in live.values()], 0.1)
        for rank, c in list(open_conns.items()):
            if c in ready:
                try:
                    kind, _, payload = c.recv()
                except (EOFError, OSError):
                    del open_conns[rank]
                    continue
                if kind == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = _rebuild(rank, *payload)
        for rank, p in list(live.items()):
            if p.sentinel in ready or not p.is_alive():
                p.join()
                del live[rank]
                if rank not in results and rank not in errors and p.exitcode != 0:
                    _drain(open_conns, rank, results, errors)
                    errors.setdefault(rank, RankFailed(
                        f"rank {rank} exited with status {p.exitcode} without a result "
                        "(killed, crashed, or ended by its watchdog: see its stderr)"))
        if errors and failed_at is None:
            failed_at = time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > grace:
            for rank, p in live.items():
                p.kill()
                p.join()
                errors.setdefault(rank, RankFailed(
                    f"rank {rank} killed: still running {grace:g} s after a rank failed"))
            live.clear()
            _drain_all(open_conns, results, errors)
    return results, errors


def _drain(open_conns, rank, results, errors):
    c = open_conns.pop(rank, None)
    while c is not None and c.poll():
        try:
            kind, _, payload = c.recv()
        except (EOFError, OSError):
            break
        (results if kind == "ok" else errors)[rank] = (
            pickle.loads(payload) if kind == "ok" else _rebuild(rank, *payload))


def _drain_all(open_conns, results, errors):
    for rank in list(open_conns):
        _drain(open_conns, rank, results, errors)


def _rebuild(rank, blob, kind, message, text):
    try:
        err = pickle.loads(blob)
    except Exception:  # noqa: BLE001
        err = RankFailed(f"{kind}: {message}")
    err.__dict__.setdefault("rank", rank)
    err._tecupy_traceback = text
    return err


def _raise_first(errors):
    if not errors:
        return
    own = [r for r in sorted(errors) if not isinstance(errors[r], (GroupAborted, RankFailed))]
    first = (own or sorted(errors))[0]
    err = errors[first]
    if hasattr(err, "add_note"):
        err.add_note(f"(raised on rank {first} in tecupy.distributed.spawn; its traceback:\n"
                     f"{getattr(err, '_tecupy_traceback', '')})")
        for r in sorted(errors):
            if r != first:
                err.add_note(f"rank {r}: {type(errors[r]).__name__}: {errors[r]}")
    raise err

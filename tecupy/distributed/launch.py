"""Launch ranks on one host (or one node of several), with the variables torchrun sets.

    python -m tecupy.distributed.launch --nproc 2 train.py --tp 2      # a script
    python -m tecupy.distributed.launch --nproc 2 -m tecupy.bench distributed
    results = tecupy.distributed.spawn(fn, 2, *args)                    # fn(group, *args)

Each rank gets RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR
and MASTER_PORT (a free port unless given), as torchrun's static rendezvous does; several
nodes: run it on each with --nnodes N --node-rank i --master-addr <host of node 0>
--master-port P. If a rank fails, the others get `grace` seconds to end (their watchdogs
end them once the abort reaches them); those still alive are then killed. Each failed rank
is named on stderr; the exit status is the first failed rank's (each rank's own stderr
says why: the rank that raised prints its traceback, the others the abort's reason).
"""
import argparse
import os
import signal
import subprocess
import sys
import time

from .multiproc import free_port, rank_env


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tecupy.distributed.launch",
                                description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", "--nproc-per-node", type=int, required=True, dest="nproc",
                   help="ranks on this node (one per GPU)")
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1",
                   help="host of node 0 (serves the store)")
    p.add_argument("--master-port", type=int, default=None,
                   help="the store's port (default: a free one; needed with --nnodes > 1)")
    p.add_argument("--grace", type=float, default=10.0,
                   help="seconds the other ranks get to end once one has failed")
    p.add_argument("-m", dest="module", action="store_true",
                   help="run the target as a module (python -m)")
    p.add_argument("target", help="script (or module, with -m)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if a.nproc < 1 or a.nnodes < 1 or not 0 <= a.node_rank < a.nnodes:
        p.error("need --nproc >= 1, --nnodes >= 1 and 0 <= --node-rank < --nnodes")
    if a.nnodes > 1 and a.master_port is None:
        p.error("--nnodes > 1 needs --master-port (the same on every node)")
    port = a.master_port or free_port()
    world = a.nproc * a.nnodes
    cmd = [sys.executable] + (["-m"] if a.module else []) + [a.target] + a.args
    procs = []
    for local in range(a.nproc):
        rank = a.node_rank * a.nproc + local
        env = {**os.environ, **rank_env(rank, local, world, a.nproc, a.master_addr, port,
                                        a.node_rank)}
        procs.append((rank, subprocess.Popen(cmd, env=env)))

    def forward(signum, frame):  # (scancel, kill: the ranks go too; their exits end the wait)
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)
    signal.signal(signal.SIGTERM, forward)
    return _supervise(procs, a.grace)


def _supervise(procs, grace):
    """Wait for the ranks; once one fails, kill those alive `grace` s later. -> exit status
    (of the first rank seen to fail; which rank caused it, each rank's stderr says)."""
    first, failed_at = None, None
    live = dict(procs)
    while live:
        for rank, proc in list(live.items()):
            code = proc.poll()
            if code is None:
                continue
            del live[rank]
            if code != 0:
                sys.stderr.write(f"tecupy.distributed.launch: rank {rank} failed (exit "
                                 f"status {code})\n")
                if first is None:
                    first, failed_at = (rank, code), time.monotonic()
        if failed_at is not None and live and time.monotonic() - failed_at > grace:
            for rank, proc in live.items():
                proc.send_signal(signal.SIGKILL)
                proc.wait()
            sys.stderr.write(f"tecupy.distributed.launch: killed rank(s) {sorted(live)}: "
                             f"still running {grace:g} s after rank {first[0]} failed\n")
            live.clear()
        time.sleep(0.05)
    return 0 if first is None else (first[1] if first[1] > 0 else 1)


if __name__ == "__main__":
    sys.exit(main())

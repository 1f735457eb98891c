"""tecupy.distributed without a GPU: the TCP store, init_process_group and NcclGroup over a
fake NCCL (NumPy buffers, moved through the store by pointer, count and NCCL dtype code as
NCCL would), spawn and the launch CLI in real processes, faults (a raising rank, a rank stuck
in a host sync, a rank killed, an init timeout naming the absent rank), TECUPY_DIST_DEBUG,
and bucketed data-parallel gradient averaging against the thread reference."""
import ctypes
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from tecupy import distributed as dist
from tecupy._array import bfloat16
from tecupy.distributed.multiproc import free_port
from tecupy.distributed.nccl import NCCL_DTYPES
from tecupy.distributed.store import Store, StoreLost, StoreServer, StoreTimeout

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
_DT = {code: dt for dt, code in NCCL_DTYPES.items()}


# -- a fake NCCL: what NcclGroup hands NCCL (pointers, counts, codes) done on host memory --

def _view(ptr, count, code):
    dt = _DT[code]
    return np.frombuffer((ctypes.c_char * (count * dt.itemsize)).from_address(ptr), dt, count)


def _reduce(parts, op):
    acc = parts[0].copy()
    for a in parts[1:]:
        (np.add if op == 0 else np.maximum)(acc, a, out=acc)
    return acc


class FakeComm:
    def __init__(self, size, uid, rank):
        self.size, self.rank, self.uid, self.seq = size, rank, uid.decode(), 0
        self.store = None if size == 1 else Store(os.environ["MASTER_ADDR"],
                                                  int(os.environ["MASTER_PORT"]), rank, 10)

    def _exchange(self, data, code):
        if self.store is None:
            return [np.frombuffer(data, _DT[code])]
        self.seq += 1
        key = f"fake/{self.uid}/{self.seq}"
        self.store.set(f"{key}/{self.rank}", data)
        parts = self.store.wait([f"{key}/{r}" for r in range(self.size)])
        return [np.frombuffer(p, _DT[code]) for p in parts]

    def allReduce(self, send, recv, count, code, op, stream):
        parts = self._exchange(_view(send, count, code).tobytes(), code)
        _view(recv, count, code)[...] = _reduce(parts, op)

    def allGather(self, send, recv, count, code, stream):
        parts = self._exchange(_view(send, count, code).tobytes(), code)
        _view(recv, count * self.size, code)[...] = np.concatenate(parts)

    def reduceScatter(self, send, recv, count, code, op, stream):
        parts = self._exchange(_view(send, count * self.size, code).tobytes(), code)
        full = _reduce(parts, op)
        _view(recv, count, code)[...] = full[self.rank * count:(self.rank + 1) * count]

    def bcast(self, buf, count, code, root, stream):
        mine = _view(buf, count, code)
        parts = self._exchange(mine.tobytes() if self.rank == root else b"", code)
        mine[...] = parts[root]

    def abort(self):  # (frees the communicator, as ncclCommAbort does)
        sys.stderr.write(f"fake ncclCommAbort on rank {self.rank}\n")
        sys.stderr.flush()
        self.destroy()

    def destroy(self):
        if self.store is not None:
            self.store.close()


class OnOtherGpu(np.ndarray):
    """An array the fake says lives on another GPU."""


class _FakeGroupCalls:  # ncclGroupStart / End: the fake's calls run as they come
    @staticmethod
    def groupStart():
        pass

    @staticmethod
    def groupEnd():
        pass


class FakeNccl:
    name, xp, nccl = "fake", np, _FakeGroupCalls

    def set_device(self, local_rank):
        return local_rank

    def get_unique_id(self):
        return os.urandom(8).hex().encode()

    def communicator(self, size, uid, rank):
        return FakeComm(size, uid, rank)

    def can_split(self):
        return False  # split goes through the store (a new unique id per color)

    def device_of(self, op, x, device):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"{op}: not an array")
        return device + 1 if isinstance(x, OnOtherGpu) else device

    @staticmethod
    def ptr(x):
        return x.ctypes.data

    def stream(self):
        return 0

    def synchronize(self):
        pass

    def synchronize_device(self):
        pass


FAKE = FakeNccl()


# -- the store -------------------------------------------------------------------------

def test_store_set_get_add_wait_and_timeouts():
    server = StoreServer("127.0.0.1", 0)
    a, b = Store("127.0.0.1", server.port, 0), Store("127.0.0.1", server.port, 1)
    try:
        a.set("k", b"\x00\xffbytes")
        assert b.get("k", timeout=1) == b"\x00\xffbytes"
        assert [a.add("n"), b.add("n", 5)] == [1, 6]
        assert a.set("first", "x", first=True) == b"x" and b.set("first", "y", first=True) == b"x"
        later = threading.Timer(0.2, lambda: a.set("late", "1"))
        later.start()
        assert b.wait(["k", "late"], timeout=5) == [b"\x00\xffbytes", b"1"]
        t0 = time.perf_counter()
        with pytest.raises(StoreTimeout, match=r"\['never'\] not set within 0.3 s") as e:
            b.wait(["k", "never"], timeout=0.3)
        assert e.value.missing == ["never"] and time.perf_counter() - t0 < 2
    finally:
        a.close(), b.close(), server.close()


def test_store_abort_first_reason_wins_and_wakes_waiters():
    server = StoreServer("127.0.0.1", 0)
    a, b, w = (Store("127.0.0.1", server.port, r) for r in (0, 1, 1))
    seen = []
    watcher = threading.Thread(target=lambda: seen.append(w.watch_abort()))
    watcher.start()
    timer = threading.Timer(0.2, lambda: a.abort("rank 0 raised X"))
    try:
        timer.start()
        t0 = time.perf_counter()
        with pytest.raises(dist.GroupAborted, match="rank 0 raised X"):
            b.wait(["never"], timeout=30)
        assert time.perf_counter() - t0 < 2
        assert b.abort("rank 1 raised Y") == "rank 0 raised X" == b.aborted()
        watcher.join(2)
        assert seen == ["rank 0 raised X"]
    finally:
        timer.join(5)  # (its abort call has its reply before the store closes)
        for s in (a, b, w):
            s.close()
        server.close()


def test_store_unclean_disconnect_aborts_naming_the_rank_clean_close_does_not():
    server = StoreServer("127.0.0.1", 0)
    a, b, c = (Store("127.0.0.1", server.port, r) for r in (0, 1, 2))
    try:
        c.close()  # says bye: no abort
        time.sleep(0.1)
        assert a.aborted() is None
        b._sock.close()  # vanishes, as a killed process does
        with pytest.raises(dist.GroupAborted, match="rank 1 lost its connection to the store"):
            a.wait(["never"], timeout=5)
    finally:
        a.close(), server.close()


def test_store_client_names_rank_0_when_there_is_no_server_and_sees_it_go():
    port = free_port()
    t0 = time.perf_counter()
    with pytest.raises(StoreTimeout, match=rf"rank 3: no store at 127.0.0.1:{port} after "
                                           r"0.3 s .*rank 0, which serves it, did not start"):
        Store("127.0.0.1", port, 3, timeout=0.3)
    assert time.perf_counter() - t0 < 2
    server = StoreServer("127.0.0.1", 0)
    s = Store("127.0.0.1", server.port, 1)
    server.close()
    with pytest.raises(StoreLost, match="rank 0 exited or crashed"):
        s.watch_abort()


# -- NcclGroup over the fake NCCL, in real processes ---------------------------------------

DTYPES = [np.float32, np.float16, bfloat16, np.float64, np.uint8, np.int32, np.int64]


def _data(rank, dtype, shape=(6, 4)):
    rng = np.random.default_rng(rank)
    return (rng.standard_normal(shape) * 8).astype(dtype)


def _collectives(g):
    out = {}
    for dt in DTYPES:
        x = _data(g.rank, dt)
        strided = np.zeros((6, 8), dt)[:, ::2]  # all_reduce in place into a strided view
        strided[...] = x
        out[np.dtype(dt).name] = [
            g.all_reduce(x.copy()), g.all_reduce(x.copy(), op="max"), g.all_reduce(strided),
            g.all_gather(x, axis=0), g.all_gather(x, axis=1), g.reduce_scatter(x, axis=0),
            g.reduce_scatter(x[:, :3 * (4 // 3)] if g.size == 3 else x, axis=1, op="max"),
            g.broadcast(x.copy(), root=g.size - 1)]
    g.barrier()
    return out


def _with_splits(g):
    out = _collectives(g)
    _boundary(g)
    sub = g.split(color=g.rank % 2, key=-g.rank)  # {2,0}, {1}: key reverses the order
    none = g.split(color=None if g.rank else 0)
    gathered = sub.all_gather(np.array([g.rank], np.int64))
    grads = [_data(g.rank, np.float32, s) for s in ((5, 3), (7,), (2, 2, 2))]
    grads.append(_data(g.rank, np.float64, (4,)))
    dist.all_reduce_gradients(grads, g, bucket_mb=60 / 2**20)
    return out, (sub.rank, sub.size, gathered.tolist()), none is None, grads


def test_nccl_group_over_fake_nccl_equals_thread_reference():
    """3 processes, NcclGroup's buffers through the fake NCCL: every collective and dtype
    bit-identical to ThreadGroup's (both reduce in rank order), splits through the store,
    bucketed gradient averaging."""
    got = dist.spawn(_with_splits, 3, backend=FAKE, timeout=30)  # (and _boundary's checks)
    want = dist.run_threads(3, _collectives)
    for r in range(3):
        for name, arrays in want[r].items():
            for k, (a, b) in enumerate(zip(got[r][0][name], arrays)):
                assert a.dtype == b.dtype and a.shape == b.shape, (r, name, k)
                np.testing.assert_array_equal(a, b, err_msg=f"rank {r} {name} #{k}")
    assert [o[1] for o in got] == [(1, 2, [2, 0]), (0, 1, [1]), (0, 2, [2, 0])]
    assert [o[2] for o in got] == [False, True, True]

    def reference(g):
        grads = [_data(g.rank, np.float32, s) for s in ((5, 3), (7,), (2, 2, 2))]
        return dist.all_reduce_gradients(grads + [_data(g.rank, np.float64, (4,))], g)
    for r, ref in enumerate(dist.run_threads(3, reference)):
        for a, b in zip(got[r][3], ref):
            np.testing.assert_array_equal(a, b)


def _boundary(g):
    with pytest.raises(TypeError, match="dtype complex64 is not supported by the NCCL group; "
                                        "supported: float32, float16, bfloat16"):
        g.all_reduce(np.ones(3, np.complex64))
    with pytest.raises(ValueError, match=f"x is on GPU {g.rank + 1} but this rank's group is "
                                         f"on GPU {g.rank}"):
        g.all_gather(np.ones(3).view(OnOtherGpu))
    with pytest.raises(TypeError, match="x must be an array; got list"):
        g.broadcast([1.0])
    with pytest.raises(ValueError, match="not a multiple of the group's size 3"):
        g.reduce_scatter(np.ones(4, np.float32))
    assert repr(g) == f"<NcclGroup rank {g.rank} of 3 on GPU {g.rank}>"


def _raise_on_1(g):
    if g.rank == 1:
        time.sleep(0.3)
        raise ValueError("boom on rank 1")
    if g.rank == 0:
        time.sleep(60)  # a host sync on a collective that never ends: only the watchdog helps
    g.all_reduce(np.ones(4, np.float32))


def test_raising_rank_aborts_the_others_within_seconds(capfd):
    """Rank 1 raises; rank 2, in an all-reduce, gets GroupAborted naming it; rank 0, stuck
    in a host sync, is aborted and ended by its watchdog, not by spawn's 30 s grace."""
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="boom on rank 1") as e:
        dist.spawn(_raise_on_1, 3, backend=FAKE, timeout=30, grace=30, abort_grace=0.5)
    assert time.perf_counter() - t0 < 10
    notes = "\n".join(e.value.__notes__)
    assert "raised on rank 1" in notes
    assert "rank 2: GroupAborted: all_reduce((4,) float32, sum) on rank 2: group aborted: " \
           "rank 1 raised ValueError: boom on rank 1" in notes
    assert "rank 0: RankFailed: rank 0 exited with status 1" in notes
    err = capfd.readouterr().err
    assert "fake ncclCommAbort on rank 0" in err
    assert "tecupy.distributed: rank 0 of 3 exits: group aborted: rank 1 raised ValueError: " \
           "boom on rank 1" in err


def _mismatch(g):
    x = np.ones(4, np.float32)
    return g.all_reduce(x) if g.rank == 0 else g.all_gather(x)


def test_debug_mode_names_each_ranks_call():
    with pytest.raises(dist.GroupAborted, match=r"different collectives \(rank 0: all_reduce"
                                                r"\(\(4,\) float32, sum\), rank 1: all_gather"):
        dist.spawn(_mismatch, 2, backend=FAKE, timeout=30, env={"TECUPY_DIST_DEBUG": "1"})


def test_single_rank_group_in_process():
    g = dist.init_process_group(FAKE, env={"RANK": "0", "WORLD_SIZE": "1"})
    try:
        assert dist.get_world_group() is g and (g.rank, g.size) == (0, 1)
        with pytest.raises(RuntimeError, match="already initialised"):
            dist.init_process_group(FAKE, env={"RANK": "0", "WORLD_SIZE": "1"})
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        np.testing.assert_array_equal(g.all_gather(x, axis=1), x)
        np.testing.assert_array_equal(g.all_reduce(x.copy()), x)
    finally:
        dist.destroy_process_group()
    assert dist.get_world_group() is None
    with pytest.raises(dist.GroupAborted, match="the process group was destroyed"):
        g.all_reduce(np.ones(2, np.float32))


# -- the launch CLI, with scripts ------------------------------------------------------------

def _launch(tmp_path, body, *args, timeout=60):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(f"""\
        import os, sys, time
        sys.path[:0] = [{HERE!r}, {ROOT!r}]
        import numpy as np
        from tecupy import distributed as dist
        from test_distributed_launch import FAKE
        rank = int(os.environ["RANK"])


        def say(*words):  # one write per line: the ranks share the pipe
            sys.stdout.write(" ".join(map(str, words)) + "\\n")
            sys.stdout.flush()
        """) + textwrap.dedent(body))
    cmd = [sys.executable, "-m", "tecupy.distributed.launch", *args, str(script)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    return p, time.perf_counter() - t0


def test_launch_sets_torchruns_variables(tmp_path):
    body = """
        keys = "RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK MASTER_ADDR MASTER_PORT"
        say(" ".join(os.environ[k] for k in keys.split()))
        cfg = dist.init_from_env()
        say("cfg", cfg.rank, cfg.world_size, cfg.local_rank, cfg.launcher)
        """
    p, _ = _launch(tmp_path, body, "--nproc", "2", "--nnodes", "2", "--node-rank", "1",
                   "--master-addr", "node0", "--master-port", "29511")
    assert p.returncode == 0, p.stderr
    lines = sorted(p.stdout.split("\n"))
    assert "2 0 4 2 1 node0 29511" in lines and "3 1 4 2 1 node0 29511" in lines
    assert "cfg 2 4 0 torchrun" in lines and "cfg 3 4 1 torchrun" in lines


def test_launch_whole_job_and_an_uncaught_exception(tmp_path):
    body = """
        g = dist.init_process_group(FAKE, timeout=30, grace=5)
        say("sum", g.all_reduce(np.full(2, rank + 1.0, np.float32)).tolist())
        if rank == 1:
            raise KeyError("rank 1 fails after the first all-reduce")
        g.all_reduce(np.ones(2, np.float32))
        """
    p, dt = _launch(tmp_path, body, "--nproc", "2", "--grace", "30")
    assert p.stdout.count("sum [3.0, 3.0]") == 2
    assert p.returncode == 1 and dt < 10, p.stderr
    assert "GroupAborted: all_reduce((2,) float32, sum) on rank 0: group aborted: rank 1 " \
           "raised KeyError: 'rank 1 fails after the first all-reduce'" in p.stderr
    assert "tecupy.distributed.launch: rank 1 failed (exit status 1)" in p.stderr


def _late_rank_2(tmp_path, rank0_timeout):
    """3 ranks; rank 2 calls init_process_group only once rank 1's has timed out (0.5 s);
    rank 0's timeout is rank0_timeout. -> the launch's stdout, after checking that every rank
    raised InitTimeout naming rank 2 (and exited with status 3) within 15 s. Rank 1 starts
    once rank 0 is about to serve the store: on a loaded machine (the suite with -n 6 on an
    H100 host) rank 0's imports ended more than 0.5 s after rank 1's, whose connection then
    timed out (StoreTimeout) before its check-in could."""
    body = f"""
        here = os.path.dirname(__file__)
        flag, started = (os.path.join(here, f) for f in ("rank1_timed_out", "rank0_started"))
        if rank == 0:
            open(started, "w").close()
        while rank == 1 and not os.path.exists(started):  # rank 0 imported: its store is up
            time.sleep(0.02)
        while rank == 2 and not os.path.exists(flag):  # late: after rank 1 gave up
            time.sleep(0.02)
        try:
            dist.init_process_group(FAKE, timeout={rank0_timeout} if rank == 0 else 0.5)
        except dist.InitTimeout as e:
            say(f"rank {{rank}}: {{e}}")
            if rank == 1:
                open(flag, "w").close()
            sys.exit(3)
        """
    p, dt = _launch(tmp_path, body, "--nproc", "3")
    assert p.returncode == 3 and dt < 15, p.stdout + p.stderr
    for r in (0, 1, 2):
        assert f"rank {r}: init_process_group: rank(s) [2] of 3 did not arrive at the store " \
               "127.0.0.1:" in p.stdout, p.stdout + p.stderr
    return p.stdout


def test_init_timeout_names_the_rank_that_did_not_arrive(tmp_path):
    assert "within 0.5 s (rank(s) [0, 1] did)" in _late_rank_2(tmp_path, 0.5)


def test_init_timeout_reaches_a_late_rank_after_another_ranks_timeout(tmp_path):
    """Rank 1's check-in times out before rank 0's (rank 0 waits longer): rank 0 still keeps
    the store up for the late rank 2, which learns the reason (InitTimeout, not a lost
    store). Before, rank 0 closed the store as soon as rank 1 left, a race that failed CI."""
    _late_rank_2(tmp_path, 3.0)


def test_launch_kills_a_rank_that_outlives_the_grace(tmp_path):
    body = """
        if rank == 1:
            sys.exit(4)
        time.sleep(60)
        """
    p, dt = _launch(tmp_path, body, "--nproc", "2", "--grace", "0.5")
    assert p.returncode == 4 and dt < 10
    assert "killed rank(s) [0]: still running 0.5 s after rank 1 failed" in p.stderr


def _killed(g):
    if g.rank == 1:
        os.kill(os.getpid(), 9)
    g.all_reduce(np.ones(2, np.float32))


def test_a_killed_rank_aborts_the_others():
    t0 = time.perf_counter()
    with pytest.raises(dist.GroupAborted, match="rank 1 lost its connection to the store"):
        dist.spawn(_killed, 2, backend=FAKE, timeout=30, grace=30)
    assert time.perf_counter() - t0 < 10


# -- data parallel: buckets ------------------------------------------------------------------

def test_dp_overlap_over_fake_nccl():
    """The GPU test's data-parallel body (tests/test_distributed_nccl.py: reducer.gradient
    driven by Tape.gradient's on_grad vs all_reduce_gradients after the backward; FP8 layer)
    in 2 processes through NcclGroup over the fake NCCL: bit-identical."""
    from test_distributed_nccl import _dp_overlap, check_dp_overlap
    check_dp_overlap(dist.spawn(_dp_overlap, 2, True, backend=FAKE, timeout=60), gpu=False)


def test_tp_layer_over_fake_nccl():
    """The GPU test's tensor-parallel body (tests/test_distributed_nccl.py: TP=2
    TransformerLayer with sequence parallel, FP8 with reduce_amax, two steps, vs the
    single-device layer) at a small size in 2 processes through NcclGroup over the fake
    NCCL (its uint8 code gather, float32 amax and scale reductions)."""
    from test_distributed_nccl import _tp_layer, check_tp_layer
    c = dict(hidden=64, ffn=128, heads=4, s=32, b=2)
    got = dist.spawn(_tp_layer, 2, True, True, c, backend=FAKE, timeout=60)
    worst, count = check_tp_layer(got, True, True, c)
    assert count == 13 and worst < 1e-5  # x and 12 parameters; one scale: fp32 rounding


def test_plan_buckets():
    g = [np.zeros(n, dt) for n, dt in ((10, np.float32), (5, np.float32), (30, np.float32),
                                       (2, np.float64), (3, np.float64), (4, np.float32))]
    assert dist.plan_buckets(g, 60) == [[0, 1], [2], [3, 4], [5]]
    assert dist.plan_buckets(g, 1 << 20) == [[0, 1, 2], [3, 4], [5]]


class _Recorder(dist.ProcessGroup):
    """One rank that records the sizes it all-reduces."""

    def __init__(self):
        super().__init__(0, 1)
        self.calls = []

    def _all_reduce(self, x, op):
        self.calls.append(x.size)
        return x


def test_reducer_launches_buckets_in_order_whatever_order_gradients_come():
    grads = [np.full(n, float(n), np.float32) for n in (4, 4, 8, 2)]
    group = _Recorder()
    r = dist.GradientReducer(group, grads, bucket_mb=32 / 2**20, order="given")
    assert r.buckets == [[0, 1], [2], [3]]
    r.ready(3, grads[3])
    r.ready(2, grads[2])
    assert group.calls == []  # bucket 0 first, as on every other rank
    r.ready(0, grads[0])
    r.ready(1, grads[1])
    assert group.calls == [8, 8, 2]
    with pytest.raises(ValueError, match="gradient 1 given twice"):
        r.ready(1, grads[1])
    assert [a[0] for a in r.finish()] == [4.0, 4.0, 8.0, 2.0]
    assert r.arrived == [3, 2, 0, 1]
    with pytest.raises(ValueError, match=r"gradients \[0, 1, 2, 3\] never given"):
        r.finish()


def test_reducer_buckets_follow_the_order():
    """Buckets are cut along `order`: the reverse of the given order by default (a backward
    finishes the last layers first), or a permutation such as a last step's `arrived`."""
    grads = [np.zeros(n, np.float32) for n in (4, 4, 8, 2)]
    group = _Recorder()
    assert dist.GradientReducer(group, grads, 32 / 2**20).buckets == [[3], [2], [1, 0]]
    r = dist.GradientReducer(group, grads, 32 / 2**20, order=[2, 0, 3, 1])
    assert r.buckets == [[2], [0, 3], [1]]
    r.ready(0, grads[0])
    r.ready(2, grads[2])
    assert group.calls == [8]
    with pytest.raises(ValueError, match=r"no gradient 4 \(this reducer has 4: 0..3\)"):
        r.ready(4, grads[0])
    for bad in ([0, 1, 2], [0, 1, 2, 2], "backward"):
        with pytest.raises(ValueError, match="order must be 'reverse', 'given' or a "
                                             "permutation of 0..3"):
            dist.GradientReducer(group, grads, order=bad)
    with pytest.raises(TypeError, match="grads_like must be a list/tuple or dict"):
        dist.GradientReducer(group, grads[0])


@pytest.mark.parametrize("n", [2, 3])
def test_all_reduce_gradients_is_the_mean_one_call_per_bucket(n, monkeypatch):
    shapes = [(64, 32), (32,), (16, 64), (64,), (5, 7)]
    calls = []
    real = dist.ThreadGroup._all_reduce
    monkeypatch.setattr(dist.ThreadGroup, "_all_reduce",
                        lambda self, x, op: calls.append(x.size) or real(self, x, op))

    def grads_of(rank):
        rng = np.random.default_rng(rank)
        return [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def body(g):
        grads = {f"p{i}": a for i, a in enumerate(grads_of(g.rank))}
        grads["skip"] = None
        return dist.all_reduce_gradients(grads, g, bucket_mb=8192 / 2**20)
    got = dist.run_threads(n, body)
    per = [grads_of(r) for r in range(n)]
    for i in range(len(shapes)):
        mean = per[0][i].copy()
        for p in per[1:]:
            mean += p[i]  # rank order, as the reference communicator sums
        mean /= n
        for r in range(n):
            np.testing.assert_array_equal(got[r][f"p{i}"], mean)
    assert got[0]["skip"] is None
    # 8 KiB buckets: [p0] (8 KiB), [p1, p2, p3, p4] (4.5 KiB): 2 all-reduces per rank
    assert sorted(calls) == sorted([2048, 32 + 1024 + 64 + 35] * n)

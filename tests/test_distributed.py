"""tecupy.distributed on the thread-backed reference communicator: collectives against
NumPy, launcher environments, tensor-parallel MLPs equal to the single-device run (outputs
and gradients, float64), a raising rank aborting the others, and split subgroups."""
import time

import numpy as np
import pytest

import tecupy
from tecupy import distributed as dist
from tecupy.distributed.env import ENV_VARS


def per_rank(n, shape, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_collectives_match_numpy(n):
    xs = per_rank(n, (4 * n, 3))

    def body(g):
        x = xs[g.rank]
        return (g.all_reduce(x.copy()), g.all_reduce(x.copy(), op="max"),
                g.all_gather(x, axis=1), g.reduce_scatter(x, axis=0),
                g.reduce_scatter(x, axis=0, op="max"), g.broadcast(x.copy(), root=n - 1),
                g.barrier())
    out = dist.run_threads(n, body)
    total = xs[0].copy()
    for x in xs[1:]:
        total += x  # rank order, as the reference reduces
    for r, (s, m, gat, rs, rsm, b, _) in enumerate(out):
        np.testing.assert_array_equal(s, total)  # bit-identical on every rank
        np.testing.assert_array_equal(m, np.max(xs, axis=0))
        np.testing.assert_array_equal(gat, np.concatenate(xs, axis=1))
        np.testing.assert_array_equal(rs, np.split(total, n)[r])
        np.testing.assert_array_equal(rsm, np.split(np.max(xs, axis=0), n)[r])
        np.testing.assert_array_equal(b, xs[n - 1])


def test_all_reduce_in_place_and_checks():
    def body(g):
        x = np.full(3, g.rank + 1.0)
        assert g.all_reduce(x) is x
        with pytest.raises(ValueError, match="op must be one of"):
            g.all_reduce(x, op="mean")
        with pytest.raises(ValueError, match="not a multiple of the group's size 2"):
            g.reduce_scatter(np.ones(3))
        with pytest.raises(ValueError, match="root must be a rank"):
            g.broadcast(x, root=2)
        return x
    for x in dist.run_threads(2, body):
        np.testing.assert_array_equal(x, [3.0, 3.0, 3.0])


def test_all_reduce_many_in_place_and_checks():
    """all_reduce_many: each array reduced in place (views too: a history's row 0), the
    list returned; the op and every array checked as all_reduce checks them."""
    def body(g):
        h = np.zeros((3, 4), np.float32)
        h[0] = np.arange(4) * (g.rank + 1)
        y = np.array([float(g.rank), -1.0])
        got = g.all_reduce_many([h[0], y], "max")
        assert got[0].base is h and got[1] is y
        with pytest.raises(ValueError, match="op must be one of"):
            g.all_reduce_many([y], op="mean")
        with pytest.raises(TypeError, match="all_reduce_many"):
            g.all_reduce_many([y, [1.0, 2.0]])
        s = g.all_reduce_many([np.full(2, g.rank + 1.0)])
        return h, y, s[0]
    for h, y, s in dist.run_threads(2, body):
        np.testing.assert_array_equal(h[0], np.arange(4) * 2.0)
        np.testing.assert_array_equal(h[1:], 0.0)
        np.testing.assert_array_equal(y, [1.0, -1.0])
        np.testing.assert_array_equal(s, [3.0, 3.0])


def test_split_subgroups():
    def body(g):
        tp = g.split(color=g.rank // 2, key=g.rank)  # {0,1}, {2,3}
        dp = g.split(color=g.rank % 2, key=-g.rank)  # {2,0}, {3,1}: key reverses the order
        none = g.split(color=None if g.rank else 0)
        s = tp.all_reduce(np.array([float(g.rank)]))
        gathered = dp.all_gather(np.array([g.rank]))
        return tp.rank, tp.size, s[0], dp.rank, gathered.tolist(), none
    out = dist.run_threads(4, body)
    assert [o[:3] for o in out] == [(0, 2, 1.0), (1, 2, 1.0), (0, 2, 5.0), (1, 2, 5.0)]
    assert [o[3] for o in out] == [1, 1, 0, 0]
    assert [o[4] for o in out] == [[2, 0], [3, 1], [2, 0], [3, 1]]
    assert out[0][5].size == 1 and [o[5] for o in out[1:]] == [None] * 3


def test_raising_rank_aborts_the_others():
    seen = {}

    def body(g):
        if g.rank == 1:
            time.sleep(0.05)
            raise ValueError("boom on rank 1")
        try:
            g.all_reduce(np.ones(2))
        except dist.GroupAborted as e:
            seen[g.rank] = str(e)
            raise
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="boom on rank 1"):
        dist.run_threads(3, body, timeout=30)
    assert time.perf_counter() - t0 < 2
    assert sorted(seen) == [0, 2]
    assert all("rank 1 raised ValueError: boom on rank 1" in m for m in seen.values())


def test_timeout_names_the_late_rank():
    def body(g):
        if g.rank != 2:
            g.barrier()
    t0 = time.perf_counter()
    with pytest.raises(dist.GroupAborted, match=r"rank\(s\) \[2\] did not arrive"):
        dist.run_threads(3, body, timeout=0.3)
    assert time.perf_counter() - t0 < 2


def test_mismatched_collectives_fail_on_every_rank():
    def body(g):
        x = np.ones(4)
        return g.all_reduce(x) if g.rank == 0 else g.all_gather(x)
    with pytest.raises(dist.GroupAborted, match="different collectives.*rank 1: all_gather"):
        dist.run_threads(2, body, timeout=5)


def _mlp(x, w1, b1, w2, b2):
    return tecupy.linear(tecupy.gelu(tecupy.linear(x, w1, b1)), w2, b2)


def _mlp_params(seed=1, d=8, h=16):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((5, 3, d)), rng.standard_normal((h, d)) * 0.3,
            rng.standard_normal(h) * 0.1, rng.standard_normal((d, h)) * 0.3,
            rng.standard_normal(d) * 0.1, rng.standard_normal((5, 3, d)))


@pytest.mark.parametrize("tp", [2, 4])
def test_column_row_mlp_equals_single_device(tp):
    x, w1, b1, w2, b2, dy = _mlp_params()
    with tecupy.Tape() as tape:
        y = _mlp(x, w1, b1, w2, b2)
    want = [y, *tape.gradient(y, [x, w1, b1, w2, b2], output_grad=dy)]

    def body(g):
        p = dict(w1=dist.shard(w1, g, 0), b1=dist.shard(b1, g, 0), w2=dist.shard(w2, g, 1))
        with tecupy.Tape() as t:
            h = tecupy.gelu(dist.column_parallel_linear(x, p["w1"], p["b1"], g))
            out = dist.row_parallel_linear(h, p["w2"], b2, g)
        return [out, *t.gradient(out, [x, p["w1"], p["b1"], p["w2"], b2], output_grad=dy)]
    got = dist.run_threads(tp, body)
    for r, (y_r, dx, dw1, db1, dw2, db2) in enumerate(got):
        np.testing.assert_allclose(y_r, want[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(dx, want[1], rtol=1e-12, atol=1e-12)
        for a, full, axis in ((dw1, want[2], 0), (db1, want[3], 0), (dw2, want[4], 1)):
            np.testing.assert_allclose(a, np.split(full, tp, axis=axis)[r], rtol=1e-12,
                                       atol=1e-12)
        np.testing.assert_allclose(db2, want[5], rtol=1e-12, atol=1e-12)


def _reference(x, w1, b1, w2, b2, dy):
    with tecupy.Tape() as tape:
        y = _mlp(x, w1, b1, w2, b2)
    return [y, *tape.gradient(y, [x, w1, b1, w2], output_grad=dy)]


def test_gathered_column_then_scattered_row_equals_single_device():
    """gather_from_tp / scatter_to_tp: column-parallel with gather_output, row-parallel
    splitting a replicated input itself."""
    x, w1, b1, w2, b2, dy = _mlp_params(seed=2)
    want = _reference(x, w1, b1, w2, b2, dy)

    def body(g):
        p = [dist.shard(w1, g, 0), dist.shard(b1, g, 0), dist.shard(w2, g, 1)]
        with tecupy.Tape() as t:
            h = dist.column_parallel_linear(x, p[0], p[1], g, gather_output=True)
            y = dist.row_parallel_linear(tecupy.gelu(h), p[2], b2, g, input_is_parallel=False)
        return [y, *t.gradient(y, [x, *p], output_grad=dy)]
    for r, got in enumerate(dist.run_threads(2, body)):
        np.testing.assert_allclose(got[0], want[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-12, atol=1e-12)
        for a, full, axis in zip(got[2:], want[2:], (0, 0, 1)):
            np.testing.assert_allclose(a, np.split(full, 2, axis=axis)[r], rtol=1e-12,
                                       atol=1e-12)


def test_sequence_parallel_mlp_equals_single_device():
    """gather_sequence before the column-parallel linear (in place of copy_to_tp) and
    reduce_scatter_sequence after the row-parallel one (in place of reduce_from_tp): each
    rank holds its slice of the sequence (axis 0) in and out."""
    x, w1, b1, w2, _, dy = _mlp_params(seed=3)
    x, dy = x[:4], dy[:4]  # a sequence of 4 splits over 2 ranks
    want = _reference(x, w1, b1, w2, None, dy)

    def body(g):
        p = [dist.shard(w1, g, 0), dist.shard(b1, g, 0), dist.shard(w2, g, 1)]
        xs = dist.shard(x, g, 0)
        with tecupy.Tape() as t:
            h = tecupy.gelu(tecupy.linear(dist.gather_sequence(xs, g), p[0], p[1]))
            y = dist.reduce_scatter_sequence(tecupy.linear(h, p[2]), g)
        return [y, *t.gradient(y, [xs, *p], output_grad=dist.shard(dy, g, 0))]
    for r, got in enumerate(dist.run_threads(2, body)):
        for a, full, axis in zip(got, want, (0, 0, 0, 0, 1)):
            np.testing.assert_allclose(a, np.split(full, 2, axis=axis)[r], rtol=1e-12,
                                       atol=1e-12)


@pytest.fixture
def env(monkeypatch):
    """A clean launcher environment; returns monkeypatch.setenv over a dict."""
    for v in ENV_VARS:
        monkeypatch.delenv(v, raising=False)

    def set_env(**kv):
        for k, v in kv.items():
            monkeypatch.setenv(k, str(v))
    return set_env


STORE = dict(MASTER_ADDR="node0", MASTER_PORT=29500)


@pytest.mark.parametrize("launcher,kv", [
    ("torchrun", dict(RANK=3, WORLD_SIZE=8, LOCAL_RANK=1)),
    ("openmpi", dict(OMPI_COMM_WORLD_RANK=3, OMPI_COMM_WORLD_SIZE=8,
                     OMPI_COMM_WORLD_LOCAL_RANK=1)),
    ("pmi", dict(PMI_RANK=3, PMI_SIZE=8, MPI_LOCALRANKID=1)),
    ("slurm", dict(SLURM_PROCID=3, SLURM_NTASKS=8, SLURM_LOCALID=1)),
])
def test_env_launchers(env, launcher, kv):
    env(**kv, **STORE)
    assert dist.init_from_env() == dist.DistConfig(3, 8, 1, "node0", 29500, launcher)


def test_env_precedence_and_single_rank(env):
    env(RANK=1, WORLD_SIZE=2, LOCAL_RANK=1, SLURM_PROCID=0, SLURM_NTASKS=1, SLURM_LOCALID=0,
        **STORE)
    assert dist.init_from_env().launcher == "torchrun"  # torchrun inside an srun task
    cfg = dist.init_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert cfg == dist.DistConfig(0, 1, 0, None, None, "slurm")


@pytest.mark.parametrize("kv,match", [
    (dict(), "no launcher's rank variable.*RANK.*OMPI_COMM_WORLD_RANK.*PMI_RANK.*SLURM"),
    (dict(RANK=0), "RANK is set .* but WORLD_SIZE is not"),
    (dict(RANK=0, WORLD_SIZE=2, **STORE), "not LOCAL_RANK"),
    (dict(PMI_RANK=0, PMI_SIZE=2, **STORE), "not MPI_LOCALRANKID or PMI_LOCAL_RANK"),
    (dict(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0), "MASTER_ADDR and MASTER_PORT not set"),
    (dict(SLURM_PROCID=0, SLURM_NTASKS=2, SLURM_LOCALID=0, MASTER_ADDR="a"),
     "MASTER_PORT not set.*slurm does not set them"),
    (dict(RANK=2, WORLD_SIZE=2, LOCAL_RANK=0, **STORE), r"RANK must be an integer in \[0, 1\]"),
    (dict(RANK=0, WORLD_SIZE="two"), "WORLD_SIZE must be an integer >= 1; got 'two'"),
    (dict(RANK=0, WORLD_SIZE=2, LOCAL_RANK=0, MASTER_ADDR="a", MASTER_PORT=0), "MASTER_PORT"),
])
def test_env_errors_name_the_variables(env, kv, match):
    env(**kv)
    with pytest.raises(dist.EnvError, match=match):
        dist.init_from_env()


@pytest.mark.parametrize("tp", [2, 4])
def test_linear_modules_column_row_equal_single_device(tp):
    """nn.Linear(parallel_mode=..., tp_group=...): shards of the single-device layers of the
    same seeds; the column->gelu->row MLP's output and gradients equal the single run."""
    mk = dict(params_dtype=np.float64, device="cpu")
    fc1, fc2 = tecupy.nn.Linear(8, 16, seed=5, **mk), tecupy.nn.Linear(16, 8, seed=6, **mk)
    fc2.bias[:] = 0.5
    x, *_, dy = _mlp_params(seed=4)
    with tecupy.Tape() as tape:
        y = fc2(tecupy.gelu(fc1(x)))
    want = [y, *tape.gradient(y, [x, fc1.weight, fc1.bias, fc2.weight, fc2.bias],
                              output_grad=dy)]

    def body(g):
        a = tecupy.nn.Linear(8, 16, seed=5, parallel_mode="column", tp_group=g, **mk)
        b = tecupy.nn.Linear(16, 8, seed=6, parallel_mode="row", tp_group=g, tp_size=tp, **mk)
        b.bias[:] = 0.5
        assert (a.out_features, b.in_features, a.weight.shape) == (16 // tp, 16 // tp,
                                                                  (16 // tp, 8))
        with tecupy.Tape() as t:
            out = b(tecupy.gelu(a(x)))
        return [out, *t.gradient(out, [x, a.weight, a.bias, b.weight, b.bias], output_grad=dy)]
    for r, got in enumerate(dist.run_threads(tp, body)):
        for a, full, axis in zip(got, want, (None, None, 0, 0, 1, None)):
            ref = full if axis is None else np.split(full, tp, axis=axis)[r]
            np.testing.assert_allclose(a, ref, rtol=1e-12, atol=1e-12)


def test_linear_tp_option_errors():
    def body(g):
        with pytest.raises(ValueError, match="parallel_mode must be one of 'column', 'row'"):
            tecupy.nn.Linear(4, 4, parallel_mode="col", tp_group=g, device="cpu")
        with pytest.raises(TypeError, match="tp_group must be None or a tecupy.distributed"):
            tecupy.nn.Linear(4, 4, parallel_mode="row", tp_group=2, device="cpu")
        with pytest.raises(ValueError, match="tp_size must be None or the size of tp_group"):
            tecupy.nn.Linear(4, 4, parallel_mode="row", tp_group=g, tp_size=4, device="cpu")
        with pytest.raises(ValueError, match=r"splits out_features \(3\) over tp_size 2"):
            tecupy.nn.Linear(4, 3, parallel_mode="column", tp_group=g, device="cpu")
        plain = tecupy.nn.Linear(4, 6, parallel_mode="column", device="cpu")  # no group: whole
        assert plain.weight.shape == (6, 4) and plain.tp_size == 1
    dist.run_threads(2, body)


# -- data parallel: the all-reduce overlapped with the backward (Tape.gradient's on_grad) --

@pytest.fixture
def progress(monkeypatch):
    """Per rank thread: node backwards run so far, and that count at each all-reduce."""
    import threading

    import tecupy.tape as tape_mod
    ran, at_reduce = {}, {}
    real_run, real_reduce = tape_mod._run, dist.ThreadGroup._all_reduce

    def counting(node, ogs, grads):
        me = threading.get_ident()
        ran[me] = ran.get(me, 0) + 1
        return real_run(node, ogs, grads)

    def reducing(self, x, op):
        me = threading.get_ident()
        at_reduce.setdefault(me, []).append(ran.get(me, 0))
        return real_reduce(self, x, op)
    monkeypatch.setattr(tape_mod, "_run", counting)
    monkeypatch.setattr(dist.ThreadGroup, "_all_reduce", reducing)

    def take():
        """-> this thread's (nodes run, [nodes run at each all-reduce]); starts anew."""
        me = threading.get_ident()
        return ran.pop(me, 0), at_reduce.pop(me, [])
    return take


def _dp_step(layer, rank, step, fp8):
    """This rank's batch of this step through `layer`; -> (y, dy, tape)."""
    rng = np.random.default_rng(100 * step + rank)
    x = rng.standard_normal((8, 2, 32)).astype(np.float32)
    dy = rng.standard_normal((8, 2, 32)).astype(np.float32)
    recipe = tecupy.recipe.DelayedScaling(amax_history_len=4) if fp8 else None
    with tecupy.Tape() as tape, tecupy.fp8_autocast(enabled=fp8, fp8_recipe=recipe):
        y = layer(x)
    return y, dy, tape


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("fp8", [False, True], ids=["hp", "fp8"])
def test_reducer_on_grad_equals_all_reduce_after_the_backward(n, fp8, progress):
    """reducer.gradient (tape.gradient(on_grad=reducer.ready), then finish) on ThreadGroup
    ranks: bit-identical to tape.gradient then all_reduce_gradients (a twin layer), on every
    rank, two steps; its first buckets are all-reduced while the backward still runs, the
    other path's after it."""
    kb = 4096 / 2**20  # 4 KiB buckets: several per step

    def body(g):
        twins = [tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=3) for _ in "ab"]
        reducer = dist.GradientReducer(g, twins[0], bucket_mb=kb)
        out = []
        for step in range(2):
            y, dy, tape = _dp_step(twins[0], g.rank, step, fp8)
            over = reducer.gradient(tape, y, output_grad=dy)
            total, at = progress()
            assert len(at) == len(reducer.buckets) > 2
            assert at[0] < total // 2 and at[-1] == total  # overlapped
            y, dy, tape = _dp_step(twins[1], g.rank, step, fp8)
            after = dist.all_reduce_gradients(tape.gradient(y, twins[1], output_grad=dy), g,
                                              bucket_mb=kb)
            total, at = progress()
            assert at and set(at) == {total}  # after the backward
            out.append((over, after))
        return out
    got = dist.run_threads(n, body)
    for r in range(n):
        for step in range(2):
            over, after = got[r][step]
            assert list(over) == list(after)
            for k in after:
                np.testing.assert_array_equal(over[k], after[k], err_msg=f"{k} rank {r}")
                np.testing.assert_array_equal(after[k], got[0][step][1][k])  # every rank
    assert not all(np.array_equal(a, b) for a, b in zip(got[0][0][0].values(),
                                                        got[0][1][0].values()))


def test_reducer_mean_with_a_parameter_unreached_on_one_rank():
    """Rank 1's fc2 is on its tape but off the path to its output: its gradients are the
    zeros passed after the backward; every rank gets (rank 0's + 0) / 2, and a bucket
    whose gradients came early on rank 0 waits for rank 1's end (no deadlock)."""
    mk = dict(device="cpu", params_dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((4, 8))

    def body(g):
        fc1, fc2 = tecupy.nn.Linear(8, 8, seed=1, **mk), tecupy.nn.Linear(8, 8, seed=2, **mk)
        params = {"fc1.weight": fc1.weight, "fc1.bias": fc1.bias, "fc2.weight": fc2.weight,
                  "fc2.bias": fc2.bias}
        reducer = dist.GradientReducer(g, params, bucket_mb=600 / 2**20)
        with tecupy.Tape() as tape:
            h = fc1(x)
            z = fc2(h)
            y = tecupy.relu(z) if g.rank == 0 else tecupy.gelu(h)
        grads = reducer.gradient(tape, y)
        return grads, reducer.arrived
    (g0, arrived0), (g1, arrived1) = dist.run_threads(2, body)
    fc1, fc2 = (tecupy.nn.Linear(8, 8, seed=s, **mk) for s in (1, 2))
    with tecupy.Tape() as tape:
        y0 = tecupy.relu(fc2(fc1(x)))
    with tecupy.Tape() as tape1:
        y1 = tecupy.gelu(fc1(x))
    want0 = tape.gradient(y0, [fc1.weight, fc1.bias, fc2.weight, fc2.bias])
    want1 = tape1.gradient(y1, [fc1.weight, fc1.bias])
    for k, name in enumerate(g0):
        other = want1[k] if k < 2 else np.zeros_like(want0[k])
        want = want0[k].copy()
        want += other
        want /= 2
        np.testing.assert_array_equal(g0[name], want, err_msg=name)
        np.testing.assert_array_equal(g1[name], want, err_msg=name)
    assert arrived0 == [2, 3, 0, 1] and arrived1 == [0, 1, 2, 3]  # rank 1: fc2's at the end


def test_reducer_gradient_after_a_failed_backward():
    """A backward that fails after some gradients were handed over (and their bucket
    all-reduced) leaves the reducer ready for the next step."""
    from tecupy.tape import record
    mk = dict(device="cpu", params_dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((4, 8))

    def failing(dh):
        raise RuntimeError("backward failed")

    def body(g):
        lin = tecupy.nn.Linear(8, 8, seed=1, **mk)
        reducer = dist.GradientReducer(g, lin, bucket_mb=1)
        with tecupy.Tape() as tape:
            h = x * 1.0
            record(failing, (x,), (h,))
            y = lin(h)
        with pytest.raises(RuntimeError, match="backward failed"):
            reducer.gradient(tape, y)
        with tecupy.Tape() as tape:
            y = lin(x)
        return reducer.gradient(tape, y)
    for grads in dist.run_threads(2, body):
        np.testing.assert_array_equal(grads["bias"], np.full(8, 4.0))


def test_bench_dp_steps_on_threads():
    """python -m tecupy.bench distributed's part 3, its steps on ThreadGroup ranks (HP, no
    optimizer: the layer is unchanged by a step): after and overlapped give the same bits,
    the mean of the ranks' single-GPU gradients."""
    from tecupy.bench.distributed import dp_steps

    def body(g):
        layer = tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=3, hidden_dropout=0.0,
                                           attention_dropout=0.0)  # (as the bench's)
        rng = np.random.default_rng(g.rank)
        x, dy = (rng.standard_normal((8, 2, 32)).astype(np.float32) for _ in range(2))
        steps = dp_steps(layer, x, dy, None, g, bucket_mb=4096 / 2**20)
        return {kind: fn() for kind, fn in steps.items()}
    got = dist.run_threads(2, body)
    for k, single in got[0]["single"].items():
        mean = single.copy()
        mean += got[1]["single"][k]
        mean /= 2
        for r in range(2):
            np.testing.assert_array_equal(got[r]["after"][k], mean, err_msg=k)
            np.testing.assert_array_equal(got[r]["overlapped"][k], mean, err_msg=k)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_bench_dp_steps_zero_equals_all_reduce_on_threads(optimizer):
    """Part 3 with an optimizer on 3 ranks: the ZeRO-1 steps (reduce_scatter, after and
    overlapped) leave the parameters bit-identical to all_reduce then the optimizer over
    every parameter, on every rank, over 2 steps."""
    from tecupy.bench.distributed import dp_steps
    kb = 4096 / 2**20

    def body(g):
        out = {}
        for red, kind in (("all_reduce", "after"), ("all_reduce", "overlapped"),
                          ("reduce_scatter", "after"), ("reduce_scatter", "overlapped")):
            layer = tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=3,
                                               hidden_dropout=0.0, attention_dropout=0.0)
            for step in range(2):
                rng = np.random.default_rng(10 * step + g.rank)
                x, dy = (rng.standard_normal((8, 2, 32)).astype(np.float32) for _ in "ab")
                dp_steps(layer, x, dy, None, g, kb, red, optimizer)[kind]()
            out[(red, kind)] = {k: p.copy() for k, p in layer.named_parameters().items()}
        return out
    got = dist.run_threads(3, body)
    want = got[0][("all_reduce", "after")]
    for r in range(3):
        for run, params in got[r].items():
            for k, p in params.items():
                np.testing.assert_array_equal(p, want[k], err_msg=f"{run} {k} rank {r}")
    with pytest.raises(ValueError, match="reduce_scatter.*pass optimizer='adamw' or 'sgd'"):
        dist.run_threads(1, lambda g: dp_steps(None, None, None, None, g, 1, "reduce_scatter"))


def test_bench_sweep_table_and_options(capsys):
    """The sweep's table (a row per channel count, bucket and reduction; weak scaling =
    1-GPU step / step; the best of each column), the options' checks and the channel
    variables."""
    import argparse

    from tecupy.bench.distributed import channel_env, config, print_sweep

    def args(**kw):
        base = dict(sizes="1,4", layer="full", bucket_mb="25,100", nccl_channels="0,8",
                    reduce="all_reduce,reduce_scatter", optimizer="adamw")
        return argparse.Namespace(**{**base, **kw})
    cfg = config(args())
    assert cfg["buckets"] == [25.0, 100.0] and cfg["channels"] == [0, 8]
    assert cfg["reduces"] == ["all_reduce", "reduce_scatter"] and cfg["sizes"] == [1, 4]
    for bad, match in ((dict(bucket_mb="25,x"), "--bucket-mb: a comma-separated list"),
                       (dict(nccl_channels="-8"), "--nccl-channels: a comma-separated"),
                       (dict(reduce="all_gather"), "--reduce: all_reduce and/or"),
                       (dict(optimizer="none"), "reduce_scatter.*add --optimizer adamw")):
        with pytest.raises(SystemExit, match=match):
            config(args(**bad))
    assert channel_env(0) == {}
    assert channel_env(8) == {"NCCL_MIN_NCHANNELS": "8", "NCCL_MAX_NCHANNELS": "8",
                              "NCCL_MIN_CTAS": "8", "NCCL_MAX_CTAS": "8"}

    def steps(slow):
        rows = {}
        for name, one in (("HP", 10.0), ("FP8", 8.0)):
            rows[name] = {"single": (one, 1.0)}
            for mb in (25.0, 100.0):
                for red in ("all_reduce", "reduce_scatter"):
                    rows[name][(mb, red, "after")] = (one * 1.25 * slow, 1.0)
                    rows[name][(mb, red, "overlapped")] = (one * (1.1 if mb == 100 else 1.2)
                                                           * slow, 1.0)
        return {"bus": {"all_reduce": 240.0, "reduce_scatter": 250.0}, "steps": rows}
    print_sweep({0: steps(1.0), 8: steps(1.0 / 1.05)}, 4, cfg)
    out = capsys.readouterr().out
    assert "sweep at 4 GPUs" in out and "each step ending with adamw" in out
    assert ("| 8 | 100 | reduce_scatter | 250 | 10.00 | 11.90 (84.0%) | 10.48 (95.5%) | "
            "8.00 | 9.52 (84.0%) | 8.38 (95.5%) |") in out
    assert "| default | 25 | all_reduce | 240 | 10.00 | 12.50 (80.0%) |" in out
    assert "best FP8 overlapped: 95.5% (NCCL channels 8, 100 MiB buckets, all_reduce)" in out


def test_bench_sweep_rows_on_threads(monkeypatch, capsys):
    """Part 3's orchestration (_rank "dp": each bucket size x reduction, after and
    overlapped, HP and FP8, the 1-GPU step on rank 0 alone) on 2 ThreadGroup ranks with a
    small CPU layer, every step run once (timing and the bandwidth probe faked): the rows
    the table reads, and the table."""
    import cupy

    import tecupy.__main__
    from tecupy.bench import distributed as bench

    def build(shape, device):
        layer = tecupy.nn.TransformerLayer(32, 64, 2, device="cpu", seed=3,
                                           hidden_dropout=0.0, attention_dropout=0.0)
        rng = np.random.default_rng(0)
        return layer, *(rng.standard_normal((8, 2, 32)).astype(np.float32) for _ in "ab")
    ran = []

    def timed(g, step, alone=False):
        if alone and g.rank:
            return None
        ran.append(len(step()))
        return (10.0, 1.0) if alone else (12.5, 1.0)
    monkeypatch.setattr(tecupy.__main__, "build", build)
    monkeypatch.setattr(bench, "_timed", timed)
    monkeypatch.setattr(bench, "_bus", lambda g, reduces: {r: 200.0 for r in reduces})
    monkeypatch.setattr(cupy, "get_default_memory_pool",
                        lambda: type("Pool", (), {"free_all_blocks": lambda self: None})())
    cfg = {"layer": "small", "buckets": [4096 / 2**20, 1.0], "optimizer": "adamw",
           "reduces": ["all_reduce", "reduce_scatter"]}
    got = dist.run_threads(2, bench._rank, cfg, "dp")
    rows = got[0]["steps"]
    assert got[1]["steps"]["FP8"]["single"] is None  # (rank 0 alone)
    for name in ("HP", "FP8"):
        assert set(rows[name]) == {"single"} | {(mb, red, kind) for mb in cfg["buckets"]
                                               for red in cfg["reduces"]
                                               for kind in ("after", "overlapped")}
    assert len(ran) == 2 * (1 + 8 + 8)  # per precision: single on rank 0, 8 steps x 2 ranks
    bench.print_sweep({0: got[0]}, 2, cfg)
    out = capsys.readouterr().out
    assert "| default | 1 | reduce_scatter | 200 | 10.00 | 12.50 (80.0%) |" in out


class Spy:
    """A ThreadGroup rank that records the array each collective is given (the reducer and
    ZeroOptimizer need only rank, size and the collectives); all_reduce_into and
    all_gather_into stand for NcclGroup's (no copy)."""

    def __init__(self, g):
        self.g, self.rank, self.size, self.calls = g, g.rank, g.size, []

    def all_reduce(self, x, op="sum"):
        self.calls.append(("all_reduce", x))
        return self.g.all_reduce(x, op)

    def all_reduce_into(self, x, out, op="sum"):
        self.calls.append(("all_reduce_into", x))
        out[...] = x
        return self.g.all_reduce(out, op)

    def reduce_scatter(self, x, axis=0, op="sum"):
        self.calls.append(("reduce_scatter", x))
        return self.g.reduce_scatter(x, axis, op)

    def all_gather(self, x, axis=0):
        self.calls.append(("all_gather", x))
        return self.g.all_gather(x, axis)

    def all_gather_into(self, x, out):
        self.calls.append(("all_gather_into", x))
        out[...] = self.g.all_gather(x).reshape(out.shape)
        return out


def _grads_of(rank, shapes):
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(s).astype(np.float32) for s in shapes]


def test_large_gradients_reduced_with_no_copy():
    """bucket_mb = 8 KiB: the (64, 32) float32 gradient (8 KiB) goes to the collective as
    it is: all_reduce_gradients all-reduces it in place, the reducer reads it into a new
    array (all_reduce_into), leaving it as it was; the small ones are one bucket (a copy);
    both give the mean."""
    shapes = [(64, 32), (32,), (5, 7)]
    kb8 = 8192 / 2**20

    def body(g):
        spy = Spy(g)
        grads = _grads_of(g.rank, shapes)
        kept = [a.copy() for a in grads]
        reducer = dist.GradientReducer(spy, grads, bucket_mb=kb8, order="given")
        assert reducer.direct == [True, False]
        for i, a in enumerate(grads):
            reducer.ready(i, a)
        means = reducer.finish()
        (op0, x0), (op1, x1) = spy.calls
        assert op0 == "all_reduce_into" and np.shares_memory(x0, grads[0])  # no copy
        assert op1 == "all_reduce" and x1.size == 32 + 35 and not np.shares_memory(x1, grads[1])
        for a, b in zip(grads, kept):
            np.testing.assert_array_equal(a, b)  # only read
        spy.calls.clear()
        assert dist.all_reduce_gradients(grads, spy, bucket_mb=kb8) is grads
        assert spy.calls[0][0] == "all_reduce" and spy.calls[0][1] is grads[0]  # in place
        return means, grads
    got = dist.run_threads(2, body)
    per = [_grads_of(r, shapes) for r in range(2)]
    for i in range(len(shapes)):
        mean = per[0][i].copy()
        mean += per[1][i]
        mean /= 2
        for r in range(2):
            np.testing.assert_array_equal(got[r][0][i], mean)
            np.testing.assert_array_equal(got[r][1][i], mean)


def test_all_reduce_gradients_reduces_an_array_given_twice_once():
    """Two parameters added together get the very same gradient array from the tape: in
    place, it must be reduced once (a second in-place all-reduce would sum the sums; the
    mean of equal values would hide it: average=False)."""
    def body(g):
        a, b = (np.zeros((64, 32)) for _ in "ab")
        with tecupy.Tape() as tape:
            y = tecupy.add(a, b)
        dy = np.full((64, 32), float(g.rank + 1))
        grads = tape.gradient(y, [a, b], output_grad=dy)
        assert grads[0] is grads[1]
        return dist.all_reduce_gradients(grads, g, bucket_mb=1 / 1024, average=False)
    for grads in dist.run_threads(2, body):
        np.testing.assert_array_equal(grads[1], np.full((64, 32), 3.0))  # (not 6)


@pytest.mark.parametrize("n", [2, 3])
def test_reducer_reduce_scatter_gives_each_rank_its_chunk(n):
    """reduce="reduce_scatter": each bucket zero-padded to a multiple of n, this rank's
    chunk of its mean (ShardedGradients), the same bits as the all-reduced mean's elements;
    a large gradient that splits evenly goes as it is."""
    shapes = [(64, 48), (7,), (5, 3), (1001,)]
    mb = 2048 / 2**20

    def body(g):
        spy = Spy(g)
        grads = _grads_of(g.rank, shapes)
        rs = dist.GradientReducer(spy, grads, bucket_mb=mb, reduce="reduce_scatter")
        for i in rs.order:
            rs.ready(i, grads[i])
        shards = rs.finish()
        assert isinstance(shards, dist.ShardedGradients) and len(shards) == len(rs.buckets)
        for b, (_, x) in enumerate(spy.calls):  # one reduce_scatter per bucket, in order
            i = rs.buckets[b][0]
            assert np.shares_memory(x, grads[i]) == rs.direct[b] == (i == 0), b
        means = dist.all_reduce_gradients([a.copy() for a in grads], g, bucket_mb=mb)
        return rs.buckets, rs.padded, shards, means
    got = dist.run_threads(n, body)
    buckets, padded = got[0][0], got[0][1]
    assert buckets == [[3], [2, 1], [0]]  # reverse order; (1001,) alone: 4004 B >= 2 KiB
    assert padded == [-(-1001 // n) * n, -(-22 // n) * n, 3072]
    for r in range(n):
        _, _, shards, means = got[r]
        for b, idx in enumerate(buckets):
            flat = np.concatenate([means[i].ravel() for i in idx])
            flat = np.concatenate([flat, np.zeros(padded[b] - flat.size, np.float32)])
            k = padded[b] // n
            np.testing.assert_array_equal(shards[b], flat[r * k:(r + 1) * k])


def test_reducer_ready_checks_the_gradient_against_the_plan():
    grads = [np.zeros((4, 2), np.float32)]
    r = dist.GradientReducer(_Recorder1(), grads, order="given")
    with pytest.raises(ValueError, match=r"gradient 0 is \(8,\) float32; the buckets were "
                                         r"planned for \(4, 2\) float32"):
        r.ready(0, np.zeros(8, np.float32))
    with pytest.raises(ValueError, match="gradient 0 is .* float64"):
        r.ready(0, np.zeros((4, 2)))
    with pytest.raises(ValueError, match="reduce must be one of 'all_reduce', "
                                         "'reduce_scatter'"):
        dist.GradientReducer(_Recorder1(), grads, reduce="all_gather")
    with pytest.raises(ValueError, match="bucket_mb must be"):
        dist.GradientReducer(_Recorder1(), grads, bucket_mb=-1)


class _Recorder1(dist.ProcessGroup):
    def __init__(self):
        super().__init__(0, 1)

    def _all_reduce(self, x, op):
        return x


def test_reducer_leaves_a_gradient_the_backward_still_reads_alone():
    """y = x @ w.T + b, b of y's shape: add's backward hands the same dy to b and to the
    linear's output, so b's gradient (handed over right after the add) is the array the
    linear's backward reads next. The reducer must not change it before the backward ends
    (an in-place all-reduce of a bucket of one would): w's mean as after the backward."""
    mk = dict(device="cpu", params_dtype=np.float64)

    def body(g, overlapped):
        lin = tecupy.nn.Linear(8, 6, bias=False, seed=1, **mk)
        b = np.random.default_rng(5).standard_normal((4, 6))
        x = np.random.default_rng(g.rank).standard_normal((4, 8))
        params = [lin.weight, b]
        with tecupy.Tape() as tape:
            y = tecupy.add(lin(x), b)
        dy = np.random.default_rng(10 + g.rank).standard_normal((4, 6))
        if overlapped:
            reducer = dist.GradientReducer(g, params, bucket_mb=8 / 2**20)  # one per bucket
            grads = reducer.gradient(tape, y, output_grad=dy)
            assert reducer.arrived == [1, 0] and reducer.buckets == [[1], [0]]
            return grads
        return dist.all_reduce_gradients(tape.gradient(y, params, output_grad=dy), g)
    want = dist.run_threads(2, body, False)
    for r, got in enumerate(dist.run_threads(2, body, True)):
        for a, b in zip(got, want[r]):
            np.testing.assert_array_equal(a, b)


def test_nccl_call_description_is_written_only_when_read():
    """NcclGroup's description of a call ("op(shape dtype, extra)") is formatted for a
    message only (an abort, the debug check), not on every call."""
    from tecupy.distributed.nccl import _name
    x = np.zeros((2, 3), np.float32)
    what = _name("all_reduce", x, "max")
    assert not isinstance(what, str)
    assert str(what) == f"{what}" == "all_reduce((2, 3) float32, max)"

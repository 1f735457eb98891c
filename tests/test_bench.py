"""The benchmark package without a GPU: `python -m tecupy.bench` parses its suites and says
in one line that it needs a device, every suite imports and has run(args), and the one
timing helper computes its medians per call from CUDA events (a fake clock stands in for
CuPy's and torch's events here)."""
import types

import numpy as np
import pytest

from conftest import HAVE_GPU
from tecupy.bench import __main__ as bench_main
from tecupy.bench import timing

SUITES = ("kernels", "gemm", "attention", "layer", "inspect")


def test_help_lists_the_suites(capsys):
    with pytest.raises(SystemExit) as exit_:
        bench_main.main(["--help"])
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and "{" + ",".join(SUITES) + "}" in out


@pytest.mark.parametrize("suite", SUITES)
def test_suite_imports_and_has_run(suite):
    import importlib
    assert callable(importlib.import_module(f"tecupy.bench.{suite}").run)


@pytest.mark.skipif(HAVE_GPU, reason="checks the message shown where no GPU is present")
def test_no_gpu_is_one_line():
    with pytest.raises(SystemExit, match="tecupy.bench needs a CUDA device"):
        bench_main.main(["kernels"])


def test_tune_is_public_and_out_of_kernels():
    import tecupy
    from tecupy.kernels import fp8_gemm
    assert callable(tecupy.gemm.tune) and not hasattr(fp8_gemm, "tune")
    assert set(tecupy.gemm.CANDIDATES) == {False, True}


def _fake_gpu(name):
    """An array module whose CUDA events read a clock that the timed calls advance."""
    clock = [0.0]
    xp = types.ModuleType(name)

    class Event:
        def __init__(self, enable_timing=False):
            assert name != "torch" or enable_timing, "torch events must be asked to time"

        def record(self):
            self.t = clock[0]

        def synchronize(self):
            pass

        def elapsed_time(self, stop):  # torch's spelling
            return stop.t - self.t

    xp.cuda = types.SimpleNamespace(
        Event=Event, get_elapsed_time=lambda a, b: b.t - a.t, synchronize=lambda: None,
        Device=lambda: types.SimpleNamespace(synchronize=lambda: None))
    return xp, clock


@pytest.mark.parametrize("name", ["cupy", "torch"])
def test_gpu_time_ms_is_per_call_and_rotates_the_sets(name):
    xp, clock = _fake_gpu(name)
    seen = []

    def fn(ms):
        seen.append(ms)
        clock[0] += ms
    got = timing.gpu_time_ms(fn, [(1.0,), (3.0,)], calls=4, repeats=3, xp=xp)
    assert got == 2.0 and seen == [1.0, 3.0] + [1.0, 3.0] * 6  # warm-up, then 3 x 4 calls


def test_host_timing_on_numpy():
    assert timing.once_ms(lambda: sum(range(1000)), np) >= 0
    calls = []
    assert timing.time_ms(lambda: calls.append(1), np, warmup=2, repeat=3) >= 0
    assert len(calls) == 5


def test_input_sets_defeat_l2():
    made = timing.input_sets(object, 1 << 20)
    assert len(made) == 16 and len(set(map(id, made))) == 16  # 2 x L2 over 1 MiB: capped
    assert len(timing.input_sets(object, 4 * timing.L2_BYTES)) == 1


def test_layer_stack_checkpointed_equals_plain():
    """bench layer --layers N: the stack's step (each layer through tecupy.checkpoint or
    not) gives the same output and gradients, by parameter name and x."""
    from tecupy.__main__ import build, step
    from tecupy.bench.layer import Stack
    shape = (32, 64, 2, 8, 2)  # hidden, ffn, heads, seq, batch
    layers = [build(shape, "cpu")[0] for _ in range(2)]
    _, x, dy = build(shape, "cpu")
    plain, ckpt = (step(Stack(layers, c), x, dy, None) for c in (False, True))
    np.testing.assert_array_equal(plain[0], ckpt[0])
    assert set(plain[1]) == set(ckpt[1]) == {"x"} | {
        f"layer{i}.{k}" for i in range(2) for k in layers[0].named_parameters()}
    for k in plain[1]:
        np.testing.assert_array_equal(plain[1][k], ckpt[1][k])


def test_layers_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench_main.main(["layer", "--layers", "0"])
    assert "--layers must be >= 1, got 0" in capsys.readouterr().err


def test_inspect_suite_arguments(capsys):
    """bench inspect takes --size small|medium|full, as bench layer does."""
    with pytest.raises(SystemExit) as exit_:
        bench_main.main(["inspect", "--size", "huge"])
    assert exit_.value.code == 2 and "invalid choice: 'huge'" in capsys.readouterr().err
    if not HAVE_GPU:
        with pytest.raises(SystemExit, match="tecupy.bench needs a CUDA device"):
            bench_main.main(["inspect", "--size", "small"])


@pytest.mark.parametrize("block", [False, True], ids=["delayed", "block"])
def test_inspect_bench_times_each_configuration(rng, block):
    """bench inspect's measure on the CPU with a fake timer: each configuration is timed in
    each pass (the second in reverse order) and keeps its fastest; "no hooks" runs without
    the hooks, "off" with them and no inspector, "on" / "on, exact" with an inspector that
    sees the layer's casts (under Float8BlockScaling an inspector of every cast: the layer's
    would record none)."""
    from tecupy import quantization
    from tecupy.bench import inspect as bench_inspect
    from tecupy.inspect import ACTIVE_INSPECTOR
    hook, seen = quantization._inspected, []
    times = iter([0.5, 5.0, 4.0, 3.0, 2.0, 1.0, 6.0, 7.0, 8.0])  # (a warm-up first)

    def rate(fn, xp):
        fn()
        fn()
        ins = ACTIVE_INSPECTOR.get()
        seen.append((quantization._inspected is hook, ins and ins.exact))
        t = next(times)
        return t, t / 2
    from tecupy.recipe import Float8BlockScaling
    rows, inspected = bench_inspect.measure((32, 64, 2, 16, 2), "cpu", rate, passes=2,
                                            recipe=Float8BlockScaling() if block else None)
    order = [(False, None), (True, None), (True, False), (True, True)]
    assert seen == [(True, None)] + order + order[::-1]  # (warm-up; second pass in reverse)
    assert rows == {"no hooks": (5.0, 2.5), "off": (4.0, 2.0), "on": (3.0, 1.5),
                    "on, exact": (1.0, 0.5)}
    assert quantization._inspected is hook
    # qkv, proj, fc1, fc2: input, weight and grad_output of each; two steps per timing
    assert inspected["on"] == inspected["on, exact"] == (2, 12)


def test_no_hooks_takes_every_hook_out(rng):
    from tecupy import fp8
    from tecupy.bench.inspect import no_hooks
    from tecupy.inspect import FP8Inspector
    x = rng.standard_normal((16, 16)).astype(np.float32)
    q = fp8.E4M3
    with FP8Inspector() as ins:
        with no_hooks():
            fp8.quantize(x, 1.0, q)
            fp8.dact_cast(x, x, None, "gelu", np.ones(1, np.float32), fp8.E5M2, None)
        assert ins.labels == []
        fp8.quantize(x, 1.0, q)
        fp8.dact_cast(x, x, None, "gelu", np.ones(1, np.float32), fp8.E5M2, None)
    assert ins.labels == ["quantize0", "dact_cast0"]
